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

    ``data`` is [N, K / 32 * block bytes] uint8: each output feature's row of blocks, with the
    row's bytes rearranged by :meth:`from_blocks` (all its codes, then all its fp16 scales, then
    Q4_1's minimums: see cpu_kernels.c). Rows stay rows, so fused projections are the
    concatenation of their parts' rows and a row permutation (llama.cpp's q/k layout) permutes
    rows of ``data``.
    """

    fmt: str
    data: torch.Tensor
    in_features: int
    # Decode-sized products (1-3 rows of x) round x to int16 per 32-block first and multiply in
    # integers: ~1.3x faster there, not exact (the tolerance is in docs/kernels.md).
    int16_activations: bool = False

    @classmethod
    def from_blocks(cls, fmt: str, blocks: torch.Tensor, in_features: int,
                    int16_activations: bool = False) -> PackedWeight:
        """From ggml's blocks as a GGUF file stores them: [N, K / 32 * block bytes] uint8."""
        if fmt not in FORMATS or in_features % BLOCK_SIZE:
            raise ValueError(f"cannot pack a [{blocks.shape[0]}, {in_features}] {fmt} weight")
        n, nb = blocks.shape[0], in_features // BLOCK_SIZE
        if tuple(blocks.shape) != (n, nb * BLOCK_BYTES[fmt]) or blocks.dtype != torch.uint8:
            raise ValueError(f"{fmt} blocks of shape {tuple(blocks.shape)} for {in_features} columns")
        b = blocks.reshape(n, nb, BLOCK_BYTES[fmt])
        header = 4 if fmt == "Q4_1" else 2  # d (and Q4_1's m) precede each block's codes
        parts = [b[:, :, header:], b[:, :, 0:2]] + ([b[:, :, 2:4]] if fmt == "Q4_1" else [])
        data = torch.cat([p.reshape(n, -1) for p in parts], dim=1)
        return cls(fmt, data, in_features, int16_activations)

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
            "tri_decode_step": (
                _I, [ctypes.POINTER(_Model), _P, _P, _I, _P, _P, _P, _P, _I, _P, _I, _P, _I]),
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

    def decode_step(self, weights: DecoderWeights, page_size: int) -> DecodeStep:
        """The whole decode step of the model ``weights`` describes, as one call."""
        return DecodeStep(self._lib, weights, page_size)

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


# -- a whole decode step in one call (tri_decode_step) -----------------------------------------------


class _Lin(ctypes.Structure):
    _fields_ = [("fmt", _I), ("w", _P), ("row_bytes", _SZ), ("N", _I), ("K", _I), ("bias", _P),
                ("int16_activations", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("H", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("I", _I),
                ("page_size", _I), ("eps", _F), ("scale", _F), ("embed_fmt", _I), ("embed", _P),
                ("embed_row_bytes", _SZ), ("final_norm", _P), ("lm_head", _Lin),
                ("cos_sin", _P), ("layers", ctypes.POINTER(_Layer))]


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One pre-norm decoder layer (Llama, Qwen2, Qwen3): norms' weights and block-format linears
    with their biases (None where the model has none)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: tuple[PackedWeight, torch.Tensor | None]
    o: tuple[PackedWeight, torch.Tensor | None]
    gate_up: tuple[PackedWeight, torch.Tensor | None]
    down: tuple[PackedWeight, torch.Tensor | None]


@dataclass(frozen=True)
class DecoderWeights:
    """What :class:`DecodeStep` needs of a model: shapes, the embedding table (blocks or fp32
    [vocab, H]), the layers, the final norm, the lm_head (blocks) and the rotary cos/sin table."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    embed: PackedWeight | torch.Tensor
    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor
    lm_head: PackedWeight
    cos_sin: torch.Tensor


class DecodeStep:
    """A model's whole decode step as one C call (``tri_decode_step``); see cpu_kernels.c.

    Holds the C description of the model (pointers into the given tensors, which it keeps alive).
    :meth:`__call__` runs B sequences decoding one token each and returns their logits."""

    def __init__(self, lib: ctypes.CDLL, w: DecoderWeights, page_size: int) -> None:
        self._lib = lib
        self._keep = w
        layers = (_Layer * len(w.layers))()
        for i, lw in enumerate(w.layers):
            layers[i] = _Layer(_ptr(lw.input_norm), _ptr(lw.post_norm), _ptr(lw.q_norm),
                               _ptr(lw.k_norm), _lin(*lw.qkv), _lin(*lw.o), _lin(*lw.gate_up),
                               _lin(*lw.down))
        self._layers = layers
        hidden = w.layers[0].input_norm.shape[0]
        inter = w.layers[0].down[0].in_features
        if isinstance(w.embed, PackedWeight):
            embed_fmt, embed, row = FORMATS[w.embed.fmt], w.embed.data, w.embed.data.stride(0)
        else:
            embed_fmt, embed, row = 0, w.embed, w.embed.stride(0) * 4
        self._model = _Model(len(w.layers), hidden, w.num_heads, w.num_kv_heads, w.head_dim, inter,
                             page_size, w.eps, w.head_dim**-0.5, embed_fmt, embed.data_ptr(), row,
                             w.final_norm.data_ptr(), _lin(w.lm_head, None), w.cos_sin.data_ptr(),
                             layers)
        self.vocab_size = w.lm_head.out_features
        self._caches: tuple[tuple[int, ...], ctypes.Array, ctypes.Array] | None = None

    def _cache_pointers(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                        ) -> tuple[ctypes.Array, ctypes.Array]:
        key = tuple(t.data_ptr() for t in (*k_caches, *v_caches))
        if self._caches is None or self._caches[0] != key:
            n = len(k_caches)
            self._caches = (key, (_P * n)(*key[:n]), (_P * n)(*key[n:]))
        return self._caches[1], self._caches[2]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 page_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 threads: int) -> torch.Tensor:
        """int64 contiguous ids, positions, slots, seq_lens [B] and page_table [B, pages] (rows
        contiguous); caches [pages, page_size, Hkv, D] fp32 per layer -> logits [B, vocab]."""
        b = ids.shape[0]
        logits = torch.empty(b, self.vocab_size, dtype=torch.float32)
        ks, vs = self._cache_pointers(k_caches, v_caches)
        rc = self._lib.tri_decode_step(ctypes.byref(self._model), ks, vs, b, ids.data_ptr(),
                                       positions.data_ptr(), slots.data_ptr(),
                                       page_table.data_ptr(), page_table.stride(0),
                                       seq_lens.data_ptr(), max_len, logits.data_ptr(), threads)
        if rc != 0:
            raise MemoryError("tri_decode_step could not allocate its scratch")
        return logits


def _lin(w: PackedWeight, bias: torch.Tensor | None) -> _Lin:
    return _Lin(FORMATS[w.fmt], w.data.data_ptr(), w.data.stride(0), w.out_features,
                w.in_features, _ptr(bias), int(w.int16_activations))
