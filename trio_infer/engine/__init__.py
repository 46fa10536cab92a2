"""The sans-IO engine core: scheduling, the paged KV cache, sampling and stopping.

Nothing in this package imports trio or quart. An :class:`~trio_infer.engine.engine.Engine` is a
step function you can drive token by token from a plain loop or a test; the actors in
:mod:`trio_infer.runtime` wrap it for a server.
"""
