"""The concurrency suite: registers its hypothesis profiles (see profiles.py)."""

from __future__ import annotations

from .profiles import PROFILE


def pytest_report_header(config) -> str:
    return f"concurrency suite: hypothesis profile {PROFILE} (HYPOTHESIS_PROFILE=fast|long|replay)"
