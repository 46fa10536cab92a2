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
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-mbmi2", "-fopenmp", "-shared", "-fPIC",
          "-std=c11")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c", "bmi2")
# Where the CPU has them, the int8-activation kernels use AVX512-VNNI's byte dot products (one
# instruction per 32 weights instead of two) and AVX512BW's byte masks; without, AVX2's.
VNNI_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
VNNI_CFLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
# Where it also has AVX512-VBMI, the exact kernels build Q5_0/Q5_1/Q5_K/Q6_K codes as bytes with
# its byte permutes (vpermb, vpmultishiftqb): the same integer codes as without, fewer instructions.
VBMI_CPU_FLAGS = ("avx512vbmi",)
VBMI_CFLAGS = ("-mavx512vbmi",)

# ggml type ids (GGMLQuantizationType values) of the weight formats the kernels read in place.
# F32 weights are served as torch tensors; Q2_K, Q3_K and the IQ types are dequantized at load.
FORMATS = {
    "F16": 1, "BF16": 30,
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
    "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
}
# Bumped with cpu_kernels.c's tri_abi_version whenever the ctypes boundary changes.
ABI_VERSION = 7
# How the kernels multiply x with quantized weights (cpu_kernels.c, lin_activations): exact fp32,
# or x rounded per 32-block to int8 (every product of every block format, llama.cpp's numerics).
# The tolerance is in docs/kernels.md; 16-bit float weights always multiply exactly.
ACTIVATIONS = {"exact": 0, "int8": 1}
# How a packed weight's rows lie in memory (cpu_kernels.c): "rows", each row's blocks together
# (every kernel reads it); "x8", groups of 8 rows interleaved so that the int8 GEMM puts one
# output row in each SIMD lane (no horizontal sums), read only with int8 activations, for the
# formats in X8_FORMATS; or "x16", groups of 16 rows interleaved for the exact kernels (one row
# a lane, every sum bitwise the row layout's), read only with exact activations, for the
# formats in X16_FORMATS. One layout per tensor, converted in place: never two copies.
LAYOUTS = ("rows", "x8", "x16")
X8_FORMATS = ("Q4_K", "Q6_K")
X16_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# cpu_kernels.c's flags on a tri_lin format for a part in that layout, and its rows a group.
_LAYOUT_FLAGS = {"rows": 0, "x8": 0x100, "x16": 0x200}
_GROUP_ROWS = {"x8": 8, "x16": 16}
# What each grouped layout is read with, and the formats that have it.
_LAYOUT_NEEDS = {"x8": ("int8", X8_FORMATS), "x16": ("exact", X16_FORMATS)}


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded."""


def cache_dir() -> Path:
    root = os.environ.get("TRIO_INFER_CACHE_DIR") or Path.home() / ".cache" / "trio-infer"
    return Path(root) / "kernels"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


def cpu_supported() -> bool:
    """True if this CPU has the instructions the kernels are compiled for (Linux x86-64)."""
    return all(f in _cpu_flags() for f in REQUIRED_CPU_FLAGS)


def cflags() -> tuple[str, ...]:
    """The compiler flags for this CPU: :data:`CFLAGS`, with AVX512-VNNI (and VBMI) where it has
    them."""
    flags = _cpu_flags()
    if not all(f in flags for f in VNNI_CPU_FLAGS):
        return CFLAGS
    if all(f in flags for f in VBMI_CPU_FLAGS):
        return CFLAGS + VNNI_CFLAGS + VBMI_CFLAGS
    return CFLAGS + VNNI_CFLAGS


def build(directory: Path | None = None) -> Path:
    """Compile the library if this source and these flags have no cached build; return its path."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BuildError("no C compiler (gcc or $CC) found")
    source = SOURCE.read_bytes()
    flags = cflags()
    digest = hashlib.sha256(source + " ".join((cc, *flags)).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"libtrio_cpu_{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name, then rename: concurrent builders never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"],
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
def availability() -> tuple[CpuKernels | None, str | None]:
    """``(kernels, None)``, or ``(None, why)`` where they cannot run here: the one place that
    decides, so the server can say at startup what is missing (nothing degrades silently)."""
    if os.environ.get("TRIO_INFER_KERNELS", "") == "reference":
        return None, "TRIO_INFER_KERNELS=reference asks for the torch references"
    try:
        return require(), None
    except (BuildError, OSError) as exc:
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def waits_sleep_at_once() -> bool:
    """Whether this process's OpenMP threads sleep as soon as they wait (a spin count of 0),
    read from the environment as libgomp reads it when it loads: GOMP_SPINCOUNT where set, else
    OMP_WAIT_POLICY=PASSIVE. A barrier then costs a sleep and a wake-up (tens of microseconds),
    which decides whether a short op pays for a second thread."""
    spins = os.environ.get("GOMP_SPINCOUNT", "").strip().lower()
    if spins:
        if spins in ("infinite", "infinity"):
            return False
        try:
            return float(spins) <= 0  # libgomp also takes a suffix (k, M...): >0 whatever it is
        except ValueError:
            return spins.startswith(("0", "-"))
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def load() -> CpuKernels | None:
    """The kernels, built if needed; None where they cannot run (the torch path is used then)."""
    return availability()[0]


def _kernels() -> CpuKernels:
    kernels, why = availability()
    if kernels is None:
        raise BuildError(f"the CPU kernels are unavailable: {why}")
    return kernels


@dataclass(frozen=True)
class PackedWeight:
    """A weight matrix [N, K] kept in a ggml format (``fmt``, one of :data:`FORMATS`), read in
    place by the C kernels.

    ``data`` is [N, packed row bytes] uint8: each output feature's row, rearranged once by
    :meth:`from_blocks` (codes, then high bits, then scales: see cpu_kernels.c). Rows stay rows,
    so fused projections are the concatenation of their parts' rows and a row permutation
    (llama.cpp's q/k layout) permutes rows of ``data``.
    """

    fmt: str
    data: torch.Tensor
    in_features: int
    # One of ACTIVATIONS: how x is multiplied with these weights.
    activations: str = "exact"
    # One of LAYOUTS; "x8" only for X8_FORMATS with int8 activations, "x16" only for
    # X16_FORMATS with exact ones (see with_layout).
    layout: str = "rows"

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r}: one of {', '.join(ACTIVATIONS)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: one of {', '.join(LAYOUTS)}")
        if self.layout != "rows" and not self._takes(self.layout):
            activations, formats = _LAYOUT_NEEDS[self.layout]
            raise ValueError(f"the {self.layout} layout is read only with {activations} "
                             f"activations, for {', '.join(formats)} (not {self.fmt} with "
                             f"{self.activations})")

    def _takes(self, layout: str) -> bool:
        activations, formats = _LAYOUT_NEEDS[layout]
        return self.fmt in formats and self.activations == activations

    @classmethod
    def from_blocks(cls, fmt: str, blocks: torch.Tensor | np.ndarray, in_features: int,
                    activations: str = "exact") -> PackedWeight:
        """From ggml's blocks as a GGUF file stores them: [N, native row bytes] uint8 (any
        array that exposes its buffer; a read-only memory map is read, never written)."""
        kernels = _kernels()
        native = kernels.native_row_bytes(fmt, in_features)
        array = np.asarray(blocks)
        if native == 0 or array.dtype != np.uint8 or array.ndim != 2 or array.shape[1] != native:
            raise ValueError(f"{fmt} blocks of shape {tuple(array.shape)} for {in_features} columns")
        array = np.ascontiguousarray(array)
        out = cls.empty(fmt, array.shape[0], in_features, activations)
        kernels.pack(fmt, array, in_features, out.data, torch.get_num_threads())
        return out

    @classmethod
    def empty(cls, fmt: str, out_features: int, in_features: int,
              activations: str = "exact") -> PackedWeight:
        row = _kernels().row_bytes(fmt, in_features) if fmt in FORMATS else 0
        if row == 0:
            raise ValueError(f"cannot pack a [{out_features}, {in_features}] {fmt} weight")
        return cls(fmt, torch.empty(out_features, row, dtype=torch.uint8), in_features,
                   activations)

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def parts(self) -> tuple[PackedWeight, ...]:
        return (self,)

    def with_activations(self, activations: str) -> PackedWeight:
        return dataclasses.replace(self, activations=activations)

    def with_layout(self, layout: str) -> PackedWeight:
        """This weight in ``layout``, its bytes converted **in place** (the same memory, never a
        second copy; this descriptor no longer describes them, so the caller replaces it
        everywhere it is held). "x8" is taken by the formats in :data:`X8_FORMATS` with int8
        activations and at least 8 rows, "x16" by those in :data:`X16_FORMATS` with exact
        activations and at least 16 rows; any other weight stays in rows."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
        if layout != "rows" and (not self._takes(layout)
                                 or self.out_features < _GROUP_ROWS[layout]):
            layout = "rows"
        if layout == self.layout:
            return self
        kernels, threads = _kernels(), torch.get_num_threads()
        if self.layout != "rows":
            kernels.relayout(self, self.layout, to_layout=False, threads=threads)
        if layout != "rows":
            kernels.relayout(self, layout, to_layout=True, threads=threads)
        return dataclasses.replace(self, layout=layout)


@dataclass(frozen=True)
class PackedParts:
    """A fused projection whose parts a GGUF file keeps in different formats (Q4_K_M quantizes q
    and k to Q4_K and v to Q6_K in some layers): one :class:`PackedWeight` per part, their rows
    one after the other in the output. The kernels take up to 3 parts in one call."""

    parts: tuple[PackedWeight, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.parts) <= MAX_PARTS or len({p.in_features for p in self.parts}) != 1:
            raise ValueError(f"{len(self.parts)} parts of a packed weight, or differing widths")

    @property
    def fmt(self) -> str:
        return "+".join(p.fmt for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def activations(self) -> str:
        return self.parts[0].activations

    def with_activations(self, activations: str) -> PackedParts:
        """Asked of every part; the kernels take int8 where no part is 16-bit floats
        (cpu_kernels.c, lin_activations)."""
        return PackedParts(tuple(p.with_activations(activations) for p in self.parts))

    @property
    def layout(self) -> str:
        """The grouped layout of any part ("rows" where none is grouped)."""
        return next((p.layout for p in self.parts if p.layout != "rows"), "rows")

    def with_layout(self, layout: str) -> PackedParts:
        """Asked of every part, each converted in place where it takes it (see
        :meth:`PackedWeight.with_layout`)."""
        return PackedParts(tuple(p.with_layout(layout) for p in self.parts))


Packed = PackedWeight | PackedParts


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_F = ctypes.c_float
_I = ctypes.c_int
_P = ctypes.c_void_p
_SZ = ctypes.c_size_t
_I64 = ctypes.c_int64
MAX_PARTS = 3


class _Lin(ctypes.Structure):
    _fields_ = [("nparts", _I), ("K", _I), ("N", _I), ("bias", _P), ("activations", _I),
                ("fmt", _I * MAX_PARTS), ("w", _P * MAX_PARTS), ("row_bytes", _SZ * MAX_PARTS),
                ("rows", _I * MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("H", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("I", _I),
                ("page_size", _I), ("kv_f16", _I), ("eps", _F), ("scale", _F),
                ("embed_fmt", _I), ("embed", _P), ("embed_row_bytes", _SZ), ("embed_rows", _I64),
                ("final_norm", _P), ("lm_head", _Lin), ("cos_sin", _P),
                ("layers", ctypes.POINTER(_Layer))]


def _lin(w: Packed, bias: torch.Tensor | None) -> _Lin:
    lin = _Lin(len(w.parts), w.in_features, w.out_features, _ptr(bias),
               ACTIVATIONS[w.activations])
    for i, part in enumerate(w.parts):
        lin.fmt[i] = _fmt_code(part)
        lin.w[i] = part.data.data_ptr()
        lin.row_bytes[i] = part.data.stride(0)
        lin.rows[i] = part.out_features
    return lin


def _fmt_code(w: PackedWeight) -> int:
    """The format as cpu_kernels.c takes it: the ggml type id, with its layout's flag."""
    return FORMATS[w.fmt] | _LAYOUT_FLAGS[w.layout]


def _kv_f16(cache: torch.Tensor) -> int:
    if cache.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"the C kernels read an fp32 or fp16 KV cache, not {cache.dtype}")
    return int(cache.dtype == torch.float16)


class CpuKernels:
    """Typed entry points over the loaded library. Every tensor must be contiguous (or have the
    row stride passed) and on the CPU; the shape checks live in :mod:`kernels.ops`. The library's
    ABI version and struct sizes are checked against this module's mirrors when it loads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        sig = {
            "tri_abi_version": (_I, []),
            "tri_struct_size": (_SZ, [_I]),
            "tri_row_bytes": (_SZ, [_I, _I]),
            "tri_native_row_bytes": (_SZ, [_I, _I]),
            "tri_pack": (_I, [_I, _P, _I64, _I, _P, _I]),
            "tri_linear": (_I, [ctypes.POINTER(_Lin), _P, _I, _P, _I]),
            "tri_few_rows_exact": (_I, []),
            "tri_dequant_rows": (_I, [_I, _P, _SZ, _P, _I, _I, _P, _I64]),
            "tri_relayout": (_I, [_I, _P, _I64, _I, _SZ, _I, _I, _I]),
            "tri_rms_norm": (None, [_P, _P, _P, _P, _I, _I, _F, _P, _I]),
            "tri_silu_and_mul": (None, [_P, _I, _I, _P, _I]),
            "tri_rope_store": (
                None, [_P, _I, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _P, _P, _P, _I]),
            "tri_decode_attention": (
                _I, [_P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P, _I, _I, _I]),
            "tri_extend_attention": (
                _I, [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _P, _I, _I, _I]),
            "tri_model_valid": (_I, [ctypes.POINTER(_Model)]),
            "tri_decode_step": (
                _I, [ctypes.POINTER(_Model), _P, _P, _I, _P, _P, _P, _P, _I, _P, _I, _P, _I]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        version = lib.tri_abi_version()
        sizes = [lib.tri_struct_size(i) for i in range(3)]
        mirrors = [ctypes.sizeof(s) for s in (_Lin, _Layer, _Model)]
        if version != ABI_VERSION or sizes != mirrors:
            raise BuildError(f"cpu_kernels.c ABI {version} with struct sizes {sizes} does not "
                             f"match kernels/cpu.py's ({ABI_VERSION}, {mirrors})")

    def row_bytes(self, fmt: str, in_features: int) -> int:
        """Bytes of one packed row of ``in_features`` weights; 0 if the kernels cannot take it."""
        return int(self._lib.tri_row_bytes(FORMATS[fmt], in_features)) if fmt in FORMATS else 0

    def native_row_bytes(self, fmt: str, in_features: int) -> int:
        """Bytes of one row as a GGUF file stores it; 0 for a format the kernels do not read."""
        return (int(self._lib.tri_native_row_bytes(FORMATS[fmt], in_features))
                if fmt in FORMATS else 0)

    def pack(self, fmt: str, blocks: np.ndarray, in_features: int, out: torch.Tensor,
             threads: int) -> None:
        rc = self._lib.tri_pack(FORMATS[fmt], blocks.ctypes.data, blocks.shape[0], in_features,
                                out.data_ptr(), threads)
        if rc != 0:
            raise ValueError(f"cannot pack {fmt} rows of {in_features} weights")

    def few_rows_exact(self) -> int:
        """Rows of x below which an exact :meth:`linear` gives each row bitwise the result it
        has alone (the few-rows kernel; from there, the tiles, whose sums run in another order)."""
        return int(self._lib.tri_few_rows_exact())

    def linear(self, x: torch.Tensor, w: Packed, bias: torch.Tensor | None,
               threads: int) -> torch.Tensor:
        """x [M, K] fp32 contiguous -> [M, N]."""
        m = x.shape[0]
        y = torch.empty(m, w.out_features, dtype=torch.float32)
        lin = _lin(w, bias)
        rc = self._lib.tri_linear(ctypes.byref(lin), x.data_ptr(), m, y.data_ptr(), threads)
        if rc == -2:
            raise MemoryError("tri_linear could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"tri_linear rejected {w.fmt} [{w.out_features}, {w.in_features}]")
        return y

    def dequant_rows(self, w: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int64) of a packed weight, as fp32 [len(rows), K]."""
        out = torch.empty(rows.shape[0], w.in_features, dtype=torch.float32)
        rc = self._lib.tri_dequant_rows(_fmt_code(w), w.data.data_ptr(), w.data.stride(0),
                                        rows.data_ptr(), rows.shape[0], w.in_features,
                                        out.data_ptr(), w.out_features)
        if rc == -2:
            raise MemoryError("tri_dequant_rows could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"tri_dequant_rows rejected {w.fmt} rows of {w.in_features}")
        return out

    def relayout(self, w: PackedWeight, layout: str, to_layout: bool, threads: int) -> None:
        """``w``'s bytes, in place, from the row layout to ``layout`` (``to_layout``) or back."""
        if not w.data.is_contiguous():
            raise ValueError("only a contiguous packed weight changes layout")
        rc = self._lib.tri_relayout(FORMATS[w.fmt], w.data.data_ptr(), w.out_features,
                                    w.in_features, w.data.stride(0), _LAYOUT_FLAGS[layout],
                                    int(to_layout), threads)
        if rc == -2:
            raise MemoryError("tri_relayout could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"{w.fmt} [{w.out_features}, {w.in_features}] has no {layout} layout")

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
        """In place: rotary on q [T, Hq, D] and k [T, Hkv, D]; then k, v into their slots of an
        fp32 or fp16 cache."""
        t, hq, d = q.shape
        hkv = k.shape[1]
        self._lib.tri_rope_store(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                 v.data_ptr(), v.stride(0), positions.data_ptr(),
                                 slots.data_ptr(), t, hq, hkv, d, cos_sin.data_ptr(),
                                 k_cache.data_ptr(), v_cache.data_ptr(), _kv_f16(k_cache))

    def extend_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, max_len: int,
                         threads: int) -> torch.Tensor:
        """Causal attention of the chunks of new tokens q [T, Hq, D] (query_start_loc [B + 1]
        int64 splits them by sequence) -> [T, Hq, D]; as :meth:`decode_attention` per token."""
        t, hq, d = q.shape
        _, page_size, hkv, _ = k_cache.shape
        out = torch.empty(t, hq, d, dtype=torch.float32)
        rc = self._lib.tri_extend_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            page_table.data_ptr(), page_table.stride(0), query_start_loc.data_ptr(),
            seq_lens.data_ptr(), seq_lens.shape[0], hq, hkv, d, page_size, scale, out.data_ptr(),
            max_len, threads, _kv_f16(k_cache))
        if rc == -2:
            raise MemoryError("tri_extend_attention could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"chunks or context lengths outside [1, {max_len}] or past the "
                             "page table")
        return out

    def decode_step(self, weights: DecoderWeights, page_size: int,
                    kv_dtype: torch.dtype = torch.float32) -> DecodeStep:
        """The whole decode step of the model ``weights`` describes, as one call."""
        return DecodeStep(self._lib, weights, page_size, kv_dtype)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         max_len: int, threads: int) -> torch.Tensor:
        b, hq, d = q.shape
        _, page_size, hkv, _ = k_cache.shape
        out = torch.empty(b, hq, d, dtype=torch.float32)
        rc = self._lib.tri_decode_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            page_table.data_ptr(), page_table.stride(0), seq_lens.data_ptr(), b, hq, hkv, d,
            page_size, scale, out.data_ptr(), max_len, threads, _kv_f16(k_cache))
        if rc == -2:
            raise MemoryError("tri_decode_attention could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"a context length outside [1, {max_len}] or past the page table")
        return out


# -- a whole decode step in one call (tri_decode_step) -----------------------------------------------


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One pre-norm decoder layer (Llama, Qwen2, Qwen3): norms' weights and packed linears with
    their biases (None where the model has none)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: tuple[Packed, torch.Tensor | None]
    o: tuple[Packed, torch.Tensor | None]
    gate_up: tuple[Packed, torch.Tensor | None]
    down: tuple[Packed, torch.Tensor | None]


@dataclass(frozen=True)
class DecoderWeights:
    """What :class:`DecodeStep` needs of a model: shapes, the embedding table (packed or fp32
    [vocab, H]), the layers, the final norm, the lm_head (packed) and the rotary cos/sin table."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    embed: PackedWeight | torch.Tensor
    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor
    lm_head: Packed
    cos_sin: torch.Tensor


class DecodeStep:
    """A model's whole decode step as one C call (``tri_decode_step``); see cpu_kernels.c.

    Holds the C description of the model (pointers into the given tensors, which it keeps alive),
    checked by the library once here. :meth:`__call__` runs B sequences decoding one token each
    and returns their logits."""

    def __init__(self, lib: ctypes.CDLL, w: DecoderWeights, page_size: int,
                 kv_dtype: torch.dtype = torch.float32) -> None:
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
            embed_fmt, embed, row = _fmt_code(w.embed), w.embed.data, w.embed.data.stride(0)
        else:
            embed_fmt, embed, row = 0, w.embed, w.embed.stride(0) * 4
        self.kv_dtype = kv_dtype
        self._model = _Model(len(w.layers), hidden, w.num_heads, w.num_kv_heads, w.head_dim, inter,
                             page_size, int(kv_dtype == torch.float16), w.eps, w.head_dim**-0.5,
                             embed_fmt, embed.data_ptr(), row, embed.shape[0],
                             w.final_norm.data_ptr(),
                             _lin(w.lm_head, None), w.cos_sin.data_ptr(), layers)
        if not lib.tri_model_valid(ctypes.byref(self._model)):
            raise ValueError("tri_model_valid rejected the decoder's description")
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
        contiguous); caches [pages, page_size, Hkv, D] per layer, of this step's KV dtype ->
        logits [B, vocab]."""
        if k_caches[0].dtype != self.kv_dtype:
            raise ValueError(f"a {self.kv_dtype} step given a {k_caches[0].dtype} KV cache")
        b = ids.shape[0]
        logits = torch.empty(b, self.vocab_size, dtype=torch.float32)
        ks, vs = self._cache_pointers(k_caches, v_caches)
        rc = self._lib.tri_decode_step(ctypes.byref(self._model), ks, vs, b, ids.data_ptr(),
                                       positions.data_ptr(), slots.data_ptr(),
                                       page_table.data_ptr(), page_table.stride(0),
                                       seq_lens.data_ptr(), max_len, logits.data_ptr(), threads)
        if rc == -2:
            raise MemoryError("tri_decode_step could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"a context length outside [1, {max_len}] or past the page table")
        return logits
