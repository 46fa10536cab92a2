"""Random GGUF blocks for tests: every byte pattern is a valid block of a ggml format once its
fp16 scales are finite, so the kernels and the loader are tested on every format without a
quantizer (gguf-py has none for the K-quants)."""

from __future__ import annotations

import numpy as np
import torch

from trio_infer_kernels import cpu

# Where each format keeps its fp16 scales (d, and Q4_1/Q5_1's m or the K-quants' dmin) in a
# block as ggml stores it: random bytes there could be NaN or huge, so they are set to sane values.
SCALES_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
             "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")


def random_blocks(fmt: str, n: int, k: int, g: torch.Generator) -> np.ndarray:
    """[n, native row bytes] of random valid ``fmt`` blocks (16-bit formats: random weights)."""
    if fmt in ("F16", "BF16"):
        w = torch.randn(n, k, generator=g) * 0.05
        return (w.half() if fmt == "F16" else w.bfloat16()).view(torch.uint8).numpy()
    per = 256 if fmt in KQUANTS else 32
    nbytes = cpu.require().native_row_bytes(fmt, k) // (k // per)
    b = torch.randint(0, 256, (n, k // per, nbytes), generator=g, dtype=torch.uint8).numpy()
    for at in SCALES_AT[fmt]:
        d = (torch.rand(n, k // per, generator=g) * 0.02 + 0.001).half().numpy()
        b[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // per, 2)
    return b.reshape(n, -1)


