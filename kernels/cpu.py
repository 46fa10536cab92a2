"""The C kernels of the CPU path (``cpu_kernels.c``): built once with the system's C compiler,
loaded with ctypes, called on torch tensors.

The library is compiled on first use into ``$TRIO_INFER_CACHE_DIR/kernels`` (default
``~/.cache/trio-infer/kernels``), named by a hash of the source and the compiler flags, so an
edited source rebuilds and a cached one loads in milliseconds. It needs gcc (or ``$CC``) and a CPU
with AVX2, FMA and F16C; without them :func:`load` returns None and the torch path runs instead.
``TRIO_INFER_KERNELS=reference`` also skips it (the torch references everywhere).

ctypes releases the GIL for the duration of each call, and OpenMP runs the call on the number of
threads the caller passes (torch's intra-op count), so the C kernels and torch share one setting.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

# ggml type ids of the weight formats the linear kernel reads (GGMLQuantizationType values),
# and the bytes of one block of 32 weights.
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BLOCK_SIZE = 32


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded."""


def cache_dir() -> Path:
    root = os.environ.get("TRIO_INFER_CACHE_DIR") or Path.home() / ".cache" / "trio-infer"
    return Path(root) / "kernels"


def cpu_supported() -> bool:
    """True if this CPU has the instructions the kernels are compiled for (Linux x86-64)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return all(f in flags for f in REQUIRED_CPU_FLAGS)


def build(directory: Path | None = None) -> Path:
    """Compile the library if this source and these flags have no cached build; return its path."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BuildError("no C compiler (gcc or $CC) found")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((cc, *CFLAGS)).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"libtrio_cpu_{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name, then rename: concurrent builders never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{cc} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def require() -> CpuKernels:
    """The kernels, or BuildError saying why they are unavailable (for tests and the bench)."""
    if not cpu_supported():
        raise BuildError(f"this CPU lacks one of {', '.join(REQUIRED_CPU_FLAGS)}")
    return CpuKernels(ctypes.CDLL(str(build())))


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, built if needed; None where they cannot run (the torch path is used then)."""
    if os.environ.get("TRIO_INFER_KERNELS", "") == "reference":
        return None
    try:
        return require()
    except (BuildError, OSError):
        return None


@dataclass(frozen=True)
class PackedWeight:
    """A weight matrix [N, K] kept in a ggml block format (``fmt``, one of :data:`FORMATS`).

    ``data`` is [N, K / 32 * block bytes] uint8, one row of blocks per output feature, so fused
    projections are the concatenation of their parts' rows and a row permutation (llama.cpp's
    q/k layout) permutes rows of ``data``.
    """

    fmt: str
    data: torch.Tensor
    in_features: int
    # Decode-sized products (1-3 rows of x) round x to int16 per 32-block first and multiply in
    # integers: ~1.3x faster there, not exact (the tolerance is in docs/kernels.md).
    int16_activations: bool = False

    @classmethod
    def empty(cls, fmt: str, out_features: int, in_features: int,
              int16_activations: bool = False) -> PackedWeight:
        if fmt not in FORMATS or in_features % BLOCK_SIZE:
            raise ValueError(f"cannot pack a [{out_features}, {in_features}] {fmt} weight")
        row = in_features // BLOCK_SIZE * BLOCK_BYTES[fmt]
        return cls(fmt, torch.empty(out_features, row, dtype=torch.uint8), in_features,
                   int16_activations)

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_F = ctypes.c_float
_I = ctypes.c_int
_P = ctypes.c_void_p
_SZ = ctypes.c_size_t


class CpuKernels:
    """Typed entry points over the loaded library. Every tensor must be contiguous (or have the
    row stride passed) and on the CPU; the shape checks live in :mod:`kernels.ops`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        sig = {
            "tri_linear": (_I, [_I, _P, _I, _I, _P, _SZ, _I, _P, _P, _I, _I]),
            "tri_dequant_rows": (None, [_I, _P, _SZ, _P, _I, _I, _P]),
            "tri_rms_norm": (None, [_P, _P, _P, _P, _I, _I, _F, _P, _I]),
            "tri_silu_and_mul": (None, [_P, _I, _I, _P, _I]),
            "tri_rope_store": (None, [_P, _I, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _P, _P, _P]),
            "tri_decode_attention": (
                None, [_P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P, _I, _I]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes

    def linear(self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None,
               threads: int) -> torch.Tensor:
        """x [M, K] fp32 contiguous -> [M, N]."""
        m = x.shape[0]
        y = torch.empty(m, w.out_features, dtype=torch.float32)
        row_bytes = w.data.stride(0) * w.data.element_size()
        rc = self._lib.tri_linear(FORMATS[w.fmt], x.data_ptr(), m, w.in_features,
                                  w.data.data_ptr(), row_bytes, w.out_features, _ptr(bias),
                                  y.data_ptr(), int(w.int16_activations), threads)
        if rc != 0:
            raise ValueError(f"tri_linear rejected {w.fmt} [{w.out_features}, {w.in_features}]")
        return y

    def dequant_rows(self, w: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int64) of a block-format weight, as fp32 [len(rows), K]."""
        out = torch.empty(rows.shape[0], w.in_features, dtype=torch.float32)
        self._lib.tri_dequant_rows(FORMATS[w.fmt], w.data.data_ptr(), w.data.stride(0),
                                   rows.data_ptr(), rows.shape[0], w.in_features, out.data_ptr())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None, threads: int,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(norm(x), None)``, or with ``residual``, ``(norm(x + residual), x + residual)``."""
        m, h = x.shape
        y = torch.empty_like(x)
        total = None if residual is None else torch.empty_like(x)
        self._lib.tri_rms_norm(x.data_ptr(), _ptr(residual), _ptr(total), weight.data_ptr(), m,
                               h, eps, y.data_ptr(), threads)
        return y, total

    def silu_and_mul(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        m, two_i = x.shape
        y = torch.empty(m, two_i // 2, dtype=torch.float32)
        self._lib.tri_silu_and_mul(x.data_ptr(), m, two_i // 2, y.data_ptr(), threads)
        return y

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, cos_sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """In place: rotary on q [T, Hq, D] and k [T, Hkv, D]; then k, v into their slots."""
        t, hq, d = q.shape
        hkv = k.shape[1]
        self._lib.tri_rope_store(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                 v.data_ptr(), v.stride(0), positions.data_ptr(),
                                 slots.data_ptr(), t, hq, hkv, d, cos_sin.data_ptr(),
                                 k_cache.data_ptr(), v_cache.data_ptr())

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         max_len: int, threads: int) -> torch.Tensor:
        b, hq, d = q.shape
        _, page_size, hkv, _ = k_cache.shape
        out = torch.empty(b, hq, d, dtype=torch.float32)
        self._lib.tri_decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                                       v_cache.data_ptr(), page_table.data_ptr(),
                                       page_table.stride(0), seq_lens.data_ptr(), b, hq, hkv, d,
                                       page_size, scale, out.data_ptr(), max_len, threads)
        return out
