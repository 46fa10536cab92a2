"""Fixtures of the HTTP tests (helpers live in helpers.py)."""

from __future__ import annotations

from typing import Any

import pytest

from trio_infer.models.synthetic import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The synthetic byte-level tokenizer with a ChatML template (what ``--model fake`` serves)."""
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))
