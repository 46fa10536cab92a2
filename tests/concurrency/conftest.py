"""The concurrency suite: registers its hypothesis profiles (see profiles.py)."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from .profiles import PROFILE


def pytest_report_header(config) -> str:
    return f"concurrency suite: hypothesis profile {PROFILE} (HYPOTHESIS_PROFILE=fast|long|replay)"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The fake model's steps are a few tiny tensor ops, run inline in the worker task: with
    torch's thread pool each op pays for waking its threads (``repeat_interleave`` in
    ``ModelRunner.prepare``: 170 us with 2 threads, 19 us with 1, on 2 busy cores). One thread
    makes the suite about a third faster; the setting is restored for other suites."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
