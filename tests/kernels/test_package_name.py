"""Our top-level ``kernels`` package is the only one of that name in the environment.

Hugging Face's ``kernels`` distribution (required by transformers from 5.25) has the same
top-level name; with both installed, transformers imports ours in place of its own and the worker
dies at load (docs/kernels.md, "The package's name"). This says which distribution is in the way.
"""

from __future__ import annotations

from importlib.metadata import packages_distributions
from pathlib import Path

import kernels

REPO = Path(__file__).resolve().parents[2]


def test_no_other_installed_distribution_ships_a_top_level_kernels_package():
    others = sorted(
        name for name in packages_distributions().get("kernels", [])
        if name.lower().replace("_", "-") != "trio-infer"
    )
    assert not others, (
        f"installed distribution(s) {others} ship a top-level `kernels` package, the name of ours; "
        f"`pip uninstall {' '.join(others)}` (and keep transformers below 5.25)"
    )


def test_the_imported_kernels_package_is_this_repositorys():
    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"
