"""Run our server with the fake model taking ``--step-ms`` per engine step (simulated compute).

``python -m trio_infer.bench.fake_server --step-ms 20 -- serve --model fake --port 8123``
``python -m trio_infer.bench.fake_server --step-ms 20 -- hypercorn trio_infer.app:app ...``

Everything after ``--`` goes to ``python -m trio_infer`` unchanged (or, when it starts with
``hypercorn``, to ``python -m hypercorn``, which then needs ``--workers 0`` to serve in this
process, and ``TRIO_INFER_MODEL=fake`` in the environment); before handing over, the fake
model class that :func:`trio_infer.runtime.loading.build_engine` instantiates for ``--model fake``
is replaced by :class:`SteppedFakeModel`. With ``--step-ms 0`` nothing is replaced: the server
runs the ordinary instant fake model, inline on the event loop.

A stepped model is not ``instant``, so the runtime runs its steps in the worker thread exactly as
it runs a real model's; the sleep holds no GIL, like a forward pass in torch.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time

from trio_infer.models import fake


class SteppedFakeModel(fake.FakeModel):
    """The fake model, each forward taking ``step_ms`` of wall time (its own work included)."""

    step_s = 0.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.instant = False

    def forward(self, batch, k_caches, v_caches):  # type: ignore[override]
        t0 = time.perf_counter()
        logits = super().forward(batch, k_caches, v_caches)
        remaining = self.step_s - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        return logits


def install(step_ms: float) -> None:
    """Make ``--model fake`` build a :class:`SteppedFakeModel` of ``step_ms`` (0: leave it)."""
    if step_ms <= 0:
        return
    cls = type("SteppedFakeModel", (SteppedFakeModel,), {"step_s": step_ms / 1000.0})
    fake.FakeModel = cls  # build_engine imports it from the module at call time
    from trio_infer.runtime import loading

    if hasattr(loading, "FakeModel"):  # in case it is ever imported at module level instead
        loading.FakeModel = cls


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m trio_infer.bench.fake_server")
    p.add_argument("--step-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    install(args.step_ms)
    if rest[:1] == ["hypercorn"]:
        sys.argv = rest
        runpy.run_module("hypercorn", run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["trio_infer", *rest]
        runpy.run_module("trio_infer", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
