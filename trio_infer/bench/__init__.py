"""Benchmarks: ``python -m trio_infer.bench {offline,serve,frontend} --help``.

- ``offline``: the engine alone against transformers baselines (:mod:`.offline`, :mod:`.profile`).
- ``serve``: a streaming load generator for any OpenAI-compatible server (:mod:`.serve`).
- ``frontend``: our HTTP stack alone over a fake model with simulated step time (:mod:`.frontend`).

See docs/benchmarks.md for the commands, the definitions of every figure and measured results.
"""
