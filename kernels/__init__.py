"""Compute kernels for trio-infer.

Each kernel lives in its own module next to a plain torch reference implementation. The engine
never imports a kernel module directly: it calls :mod:`kernels.ops`, which picks the Triton
implementation on CUDA tensors and the torch reference everywhere else.
"""
