"""Hypothesis profiles for the concurrency suite (registered when conftest.py imports this).

``fast`` (the default, what ``make test`` runs) is derandomized: every run tries the same
examples, so a failure in CI fails again on your machine. ``long`` is random and tries thousands
of examples; run it after touching the engine, the scheduler, the worker or the front end::

    HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/concurrency

Both print the ``@reproduce_failure`` blob of a failing example; see docs/testing.md.

The profiles are applied to this suite's tests only (:func:`suite_settings`), never loaded
globally, so choosing one does not change how other suites' hypothesis tests run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(
    deadline=None,  # a scenario is a whole trio.run; its wall time varies with the machine
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # No "explain" phase: it re-runs examples under sys.settrace, which makes a whole trio.run
    # many times slower (a failing run then took minutes to shrink instead of seconds).
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    # Shrink the first bug found and stop, instead of shrinking every distinct failure.
    report_multiple_bugs=False,
)

# max_examples is per test; scale=... in suite_settings() scales it for the smaller suites.
settings.register_profile("concurrency-fast", max_examples=300, derandomize=True, database=None,
                          **_COMMON)
settings.register_profile("concurrency-long", max_examples=4000, **_COMMON)
# Replay: only the explicit examples and the database, no generation (with @reproduce_failure).
settings.register_profile(
    "concurrency-replay", **{**_COMMON, "max_examples": 1, "phases": [Phase.explicit, Phase.reuse]}
)

PROFILE = "concurrency-" + os.environ.get("HYPOTHESIS_PROFILE", "fast").removeprefix("concurrency-")
if PROFILE not in ("concurrency-fast", "concurrency-long", "concurrency-replay"):
    PROFILE = "concurrency-fast"  # some other suite's profile name: keep ours at its default


def suite_settings(scale: float = 1.0, **overrides) -> settings:
    """The active profile, with ``max_examples`` scaled for a test (the HTTP suite runs fewer)."""
    base = settings.get_profile(PROFILE)
    return settings(base, max_examples=max(1, round(base.max_examples * scale)), **overrides)
