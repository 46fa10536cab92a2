"""Our kernels install as ``trio_infer_kernels``; the top-level name ``kernels`` is not ours.

The folder ``kernels/`` installs under the import name ``trio_infer_kernels`` (pyproject.toml's
``package-dir``). The name ``kernels`` is Hugging Face's distribution (its kernel hub), which
transformers requires from 5.25 on; the two share the environment, and transformers imports the
hub (docs/kernels.md, "The package's name").
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import trio_infer_kernels
from trio_infer_kernels import cpu

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _is_ours(name: str) -> bool:
    return name.lower().replace("_", "-") == "trio-infer"


def test_our_kernels_are_the_top_level_package_trio_infer_kernels_from_this_folder():
    assert any(_is_ours(name) for name in packages_distributions().get("trio_infer_kernels", []))
    folders = {Path(p).resolve() for p in trio_infer_kernels.__path__ if Path(p).is_dir()}
    assert folders == {REPO / "kernels"}
    # The C source is package data, found next to the module that compiles it.
    assert cpu.SOURCE == Path(cpu.__file__).with_name("cpu_kernels.c") and cpu.SOURCE.is_file()


def test_our_distribution_installs_no_top_level_kernels_package():
    assert not any(_is_ours(name) for name in packages_distributions().get("kernels", []))


def test_import_kernels_is_not_our_folder():
    # No __init__.py: the folder is a namespace portion, which any regular package named
    # `kernels` (Hugging Face's) wins over, even where the repository's root is on sys.path.
    assert not (REPO / "kernels" / "__init__.py").exists()
    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin is not None:  # a regular package or module
        assert REPO / "kernels" not in Path(spec.origin).resolve().parents, spec.origin


def test_with_hugging_faces_kernels_installed_transformers_imports_it_from_the_repo_root():
    """From the repository's root (its folder `kernels/` on sys.path, as for `python -m
    trio_infer`), `import kernels` is the hub's, and transformers' hub integration imports."""
    try:
        hub = distribution("kernels")
    except PackageNotFoundError:
        pytest.skip("Hugging Face's kernels distribution is not installed")
    code = (
        "import kernels, trio_infer_kernels.ops\n"
        "import transformers.integrations.hub_kernels\n"
        "from transformers.utils import is_kernels_available\n"
        "print(kernels.__file__, is_kernels_available())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path, available = proc.stdout.split()
    assert Path(path).resolve() == Path(hub.locate_file("kernels/__init__.py")).resolve()
    assert available == "True"


def test_pyproject_does_not_cap_transformers():
    (transformers,) = (Requirement(r) for r in PYPROJECT["project"]["dependencies"]
                       if Requirement(r).name == "transformers")
    assert all(s.operator in (">=", ">") for s in transformers.specifier), transformers


def test_pyproject_lists_every_package_folder():
    """A renamed folder takes a list of packages (not ``packages.find``): it must name them all."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"trio_infer_kernels": "kernels"}
    folders = {".".join(init.parent.relative_to(REPO).parts)
               for init in (REPO / "trio_infer").rglob("__init__.py")}
    assert set(setuptools["packages"]) == folders | {"trio_infer_kernels"}
    assert "*.c" in setuptools["package-data"]["trio_infer_kernels"]
