"""The C kernels of the CPU path (``cpu_kernels.c``): built once with the system's C compiler,
loaded with ctypes, called on numpy arrays or CPU torch tensors.

The library is compiled on first use into ``$TRIO_INFER_CACHE_DIR/kernels`` (default
``~/.cache/trio-infer/kernels``), named by a hash of the source and the compiler flags, so an
edited source rebuilds and a cached one loads in milliseconds. It needs gcc (or ``$CC``) and a CPU
with AVX2, FMA and F16C; without them :func:`load` returns None and the torch path runs instead.
``TRIO_INFER_KERNELS=reference`` also skips it (the torch references everywhere).

ctypes releases the GIL for the duration of each call, and OpenMP runs the call on the number of
threads the caller passes (torch's intra-op count), so the C kernels and torch share one setting.
Where a caller does not say (packing, a layout change), :func:`default_threads` counts the CPUs
this process may run on.

Why both kinds of arrays: the C side only needs a pointer and a row stride, and a batching worker
that never imports torch (about 220 MiB of resident memory) runs a numpy model over these
kernels, while the torch model calls them on CPU tensors. So this module does not import torch
(``import trio_infer_kernels.cpu`` leaves it out of ``sys.modules``), and every entry point takes,
for each array argument, a numpy array or a CPU torch tensor: three small helpers (:func:`_ptr`,
:func:`_row_stride`, :func:`_empty`) tell them apart with ``isinstance(a, np.ndarray)``, anything
else being a torch tensor. A result is of the kind of the call's main input (x, the embedding's
rows, attention's q, the decode step's ids): numpy in, numpy out (float32, C-contiguous); torch
in, torch out (torch imported lazily, where it already is). A packed weight's bytes
(:attr:`PackedWeight.data`) are always a numpy uint8 array.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
ABI_VERSION = 8
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


# A numpy array or a CPU torch tensor (see the module's docstring); Any, as torch is not imported.
Array = Any


def default_threads() -> int:
    """Threads for a call whose caller does not say: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity on this platform
        return os.cpu_count() or 1


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


def row_length_supported(fmt: str, in_features: int) -> bool:
    """Whether the packed layouts take rows of ``in_features`` weights in ``fmt`` (what
    ``tri_row_bytes`` accepts): multiples of 32 weights, of 256 for the K-quants. A GGUF tensor
    whose rows are another length (llama.cpp's quantizer leaves such a tensor at F16) is
    widened at load instead (models/loader.py says so in the log)."""
    return (fmt in FORMATS and in_features > 0 and in_features % 32 == 0
            and not (fmt.endswith("_K") and in_features % 256))


def attention_shape_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Head shapes the C attention takes (it reads head_dim in vectors of 8)."""
    return head_dim % 8 == 0 and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64


def compute_path() -> tuple[str, str | None]:
    """Which kernels serve on the CPU, and what is missing where a slower path stands in:
    ``("cpu-kernels", None)`` or ``("torch-reference", why)``;
    :func:`trio_infer_kernels.ops.compute_path` for every device (this one imports no torch, for
    the worker's report)."""
    kernels, why = availability()
    if kernels is not None:
        return "cpu-kernels", None
    return "torch-reference", (
        f"the CPU kernels are unavailable here ({why}): GGUF weights are dequantized to fp32 at "
        f"load (4-8x the memory of their blocks) and every op runs on torch (decode several "
        f"times slower)")


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

    ``data`` is a numpy uint8 array [N, packed row bytes] (never a torch tensor; rows
    contiguous): each output feature's row, rearranged once by :meth:`from_blocks` (codes, then
    high bits, then scales: see cpu_kernels.c). Rows stay rows, so fused projections are the
    concatenation of their parts' rows and a row permutation (llama.cpp's q/k layout) permutes
    rows of ``data``.
    """

    fmt: str
    data: np.ndarray
    in_features: int
    # One of ACTIVATIONS: how x is multiplied with these weights.
    activations: str = "exact"
    # One of LAYOUTS; "x8" only for X8_FORMATS with int8 activations, "x16" only for
    # X16_FORMATS with exact ones (see with_layout).
    layout: str = "rows"

    def __post_init__(self) -> None:
        if (not isinstance(self.data, np.ndarray) or self.data.dtype != np.uint8
                or self.data.ndim != 2 or (self.data.shape[1] > 1 and self.data.strides[1] != 1)):
            raise TypeError(f"a packed weight's data is a numpy uint8 array [N, row bytes] with "
                            f"contiguous rows, not {type(self.data).__name__} "
                            f"{getattr(self.data, 'dtype', '')}")
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
    def from_blocks(cls, fmt: str, blocks: Array, in_features: int,
                    activations: str = "exact", threads: int | None = None) -> PackedWeight:
        """From ggml's blocks as a GGUF file stores them: [N, native row bytes] uint8 (any
        array that exposes its buffer; a read-only memory map is read, never written), packed
        on ``threads`` (None: :func:`default_threads`)."""
        kernels = _kernels()
        native = kernels.native_row_bytes(fmt, in_features)
        array = np.asarray(blocks)
        if native == 0 or array.dtype != np.uint8 or array.ndim != 2 or array.shape[1] != native:
            raise ValueError(f"{fmt} blocks of shape {tuple(array.shape)} for {in_features} columns")
        array = np.ascontiguousarray(array)
        out = cls.empty(fmt, array.shape[0], in_features, activations)
        kernels.pack(fmt, array, in_features, out.data,
                     default_threads() if threads is None else threads)
        return out

    @classmethod
    def empty(cls, fmt: str, out_features: int, in_features: int,
              activations: str = "exact") -> PackedWeight:
        row = _kernels().row_bytes(fmt, in_features) if fmt in FORMATS else 0
        if row == 0:
            raise ValueError(f"cannot pack a [{out_features}, {in_features}] {fmt} weight")
        return cls(fmt, np.empty((out_features, row), dtype=np.uint8), in_features, activations)

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def parts(self) -> tuple[PackedWeight, ...]:
        return (self,)

    def with_activations(self, activations: str) -> PackedWeight:
        return dataclasses.replace(self, activations=activations)

    def with_layout(self, layout: str, threads: int | None = None) -> PackedWeight:
        """This weight in ``layout``, its bytes converted **in place** (the same memory, never a
        second copy; this descriptor no longer describes them, so the caller replaces it
        everywhere it is held). "x8" is taken by the formats in :data:`X8_FORMATS` with int8
        activations and at least 8 rows, "x16" by those in :data:`X16_FORMATS` with exact
        activations and at least 16 rows; any other weight stays in rows. Converted on
        ``threads`` (None: :func:`default_threads`)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
        if layout != "rows" and (not self._takes(layout)
                                 or self.out_features < _GROUP_ROWS[layout]):
            layout = "rows"
        if layout == self.layout:
            return self
        kernels = _kernels()
        threads = default_threads() if threads is None else threads
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

    def with_layout(self, layout: str, threads: int | None = None) -> PackedParts:
        """Asked of every part, each converted in place where it takes it (see
        :meth:`PackedWeight.with_layout`)."""
        return PackedParts(tuple(p.with_layout(layout, threads) for p in self.parts))


Packed = PackedWeight | PackedParts


def _ptr(a: Array | None) -> int | None:
    """The address of a numpy array's or a CPU torch tensor's first element (None for None)."""
    if a is None:
        return None
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


def _row_stride(a: Array) -> int:
    """The distance between rows (along the first axis), in elements. numpy gives an axis of
    length 1 any stride (0 for a row broadcast and then made contiguous), where the kernels read
    a page table's row stride as its width: a single row's stride is its length."""
    if a.shape[0] == 1:  # (a tensor made from such an array by torch.from_numpy keeps it)
        return math.prod(a.shape[1:]) if a.ndim > 1 else 1
    return a.strides[0] // a.itemsize if isinstance(a, np.ndarray) else a.stride(0)


def _empty(like: Array, *shape: int) -> Array:
    """A new float32 C-contiguous array of ``shape``, of the kind of ``like``: numpy for a numpy
    array, else a torch tensor (torch is imported only here, by a caller that holds tensors)."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=np.float32)
    import torch

    return torch.empty(shape, dtype=torch.float32)


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


def _lin(w: Packed, bias: Array | None) -> _Lin:
    lin = _Lin(len(w.parts), w.in_features, w.out_features, _ptr(bias),
               ACTIVATIONS[w.activations])
    for i, part in enumerate(w.parts):
        lin.fmt[i] = _fmt_code(part)
        lin.w[i] = _ptr(part.data)
        lin.row_bytes[i] = part.data.strides[0]
        lin.rows[i] = part.out_features
    return lin


def _fmt_code(w: PackedWeight) -> int:
    """The format as cpu_kernels.c takes it: the ggml type id, with its layout's flag."""
    return FORMATS[w.fmt] | _LAYOUT_FLAGS[w.layout]


# The KV cache kinds the C kernels read and write (cpu_kernels.c: KV_F32, KV_F16, KV_Q8_0,
# KV_Q4_0). A quantized cache is a uint8 array [pages, page_size, Hkv, head_dim / 32 * block
# bytes]: ggml's block_q8_0 (an fp16 scale, 32 int8 codes: 34 bytes) or block_q4_0 (an fp16
# scale, 16 bytes of nibbles: 18) in place of every 32 values of a head's row; which one, its
# row's length says.
KV_KINDS = {"float32": 0, "float16": 1, "q8_0": 2, "q4_0": 3}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
Q8_0_BLOCK_BYTES = BLOCK_BYTES["q8_0"]


def kv_kind_name(kind: Any, head_dim: int | None = None) -> str:
    """The name of a KV cache's kind: ``kind`` is a numpy dtype (or scalar type), a torch dtype,
    one of :data:`KV_KINDS`' names, or a cache (numpy array or torch tensor); a uint8 cache is
    q8_0 or q4_0 by the length of its rows of ``head_dim`` values. ValueError for any other."""
    cache = kind if isinstance(kind, np.ndarray) or hasattr(kind, "data_ptr") else None
    if cache is not None:
        kind = cache.dtype
    if isinstance(kind, str):
        name = kind
    elif str(kind) in ("torch.float32", "torch.float16", "torch.uint8"):  # torch not imported
        name = str(kind).removeprefix("torch.")
    else:
        try:
            name = np.dtype(kind).name if kind is not None else None
        except (TypeError, ValueError):
            name = None
    if name == "uint8":
        row = int(cache.shape[-1]) if cache is not None else None
        name = next((n for n, size in BLOCK_BYTES.items()
                     if head_dim is not None and row == head_dim // 32 * size), None)
        if name is None:
            raise ValueError(f"a uint8 KV cache of rows of {row} bytes is neither q8_0 nor q4_0 "
                             f"for heads of {head_dim}")
    if name in KV_KINDS:
        return name
    raise ValueError(f"the C kernels read an fp32, fp16, q8_0 or q4_0 KV cache, not {kind}")


def _kv_kind(kind: Any, head_dim: int | None = None) -> int:
    """The C kernels' code of a KV cache's kind (:func:`kv_kind_name`)."""
    return KV_KINDS[kv_kind_name(kind, head_dim)]


def _kv_is_f16(kind: Any) -> bool:
    """Whether a KV cache's kind (as :func:`kv_kind_name` reads it) is fp16."""
    return _kv_kind(kind) == KV_KINDS["float16"]


def _kv_f16(cache: Array, head_dim: int) -> int:
    """The kind code the C entry points take (their argument is named kv_f16)."""
    return _kv_kind(cache, head_dim)


def kv_row_bytes(kind: str, head_dim: int) -> int:
    """Bytes of one head's row of ``head_dim`` values in a cache of ``kind``."""
    if kind in BLOCK_BYTES:
        if head_dim % 32:
            raise ValueError(f"a {kind} KV cache takes heads of a multiple of 32 values, not {head_dim}")
        return head_dim // 32 * BLOCK_BYTES[kind]
    return head_dim * {"float32": 4, "float16": 2}[kind]


class CpuKernels:
    """Typed entry points over the loaded library. Each array argument is a numpy array or a CPU
    torch tensor, contiguous (or with the row stride passed); a result is of the kind of the
    call's main input (see the module's docstring). The shape checks live in
    :mod:`trio_infer_kernels.ops`. The library's ABI version and struct sizes are checked against
    this module's mirrors when it loads."""

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

    def pack(self, fmt: str, blocks: Array, in_features: int, out: Array, threads: int) -> None:
        """ggml's blocks [N, native row bytes] uint8 (rows contiguous, one after the other) into
        ``out`` [N, packed row bytes] uint8 (contiguous)."""
        rc = self._lib.tri_pack(FORMATS[fmt], _ptr(blocks), blocks.shape[0], in_features,
                                _ptr(out), threads)
        if rc != 0:
            raise ValueError(f"cannot pack {fmt} rows of {in_features} weights")

    def few_rows_exact(self) -> int:
        """Rows of x below which an exact :meth:`linear` gives each row bitwise the result it
        has alone (the few-rows kernel; from there, the tiles, whose sums run in another order)."""
        return int(self._lib.tri_few_rows_exact())

    def linear(self, x: Array, w: Packed, bias: Array | None, threads: int) -> Array:
        """x [M, K] fp32 contiguous -> [M, N], of x's kind."""
        m = x.shape[0]
        y = _empty(x, m, w.out_features)
        lin = _lin(w, bias)
        rc = self._lib.tri_linear(ctypes.byref(lin), _ptr(x), m, _ptr(y), threads)
        if rc == -2:
            raise MemoryError("tri_linear could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"tri_linear rejected {w.fmt} [{w.out_features}, {w.in_features}]")
        return y

    def dequant_rows(self, w: PackedWeight, rows: Array) -> Array:
        """Rows ``rows`` (int64, contiguous) of a packed weight, as fp32 [len(rows), K] of the
        kind of ``rows``."""
        out = _empty(rows, rows.shape[0], w.in_features)
        rc = self._lib.tri_dequant_rows(_fmt_code(w), _ptr(w.data), w.data.strides[0],
                                        _ptr(rows), rows.shape[0], w.in_features,
                                        _ptr(out), w.out_features)
        if rc == -2:
            raise MemoryError("tri_dequant_rows could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"tri_dequant_rows rejected {w.fmt} rows of {w.in_features}")
        return out

    def relayout(self, w: PackedWeight, layout: str, to_layout: bool, threads: int) -> None:
        """``w``'s bytes, in place, from the row layout to ``layout`` (``to_layout``) or back."""
        if not w.data.flags.c_contiguous:
            raise ValueError("only a contiguous packed weight changes layout")
        rc = self._lib.tri_relayout(FORMATS[w.fmt], _ptr(w.data), w.out_features,
                                    w.in_features, w.data.strides[0], _LAYOUT_FLAGS[layout],
                                    int(to_layout), threads)
        if rc == -2:
            raise MemoryError("tri_relayout could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"{w.fmt} [{w.out_features}, {w.in_features}] has no {layout} layout")

    def rms_norm(self, x: Array, weight: Array, eps: float, residual: Array | None,
                 threads: int) -> tuple[Array, Array | None]:
        """``(norm(x), None)``, or with ``residual``, ``(norm(x + residual), x + residual)``;
        of x's kind."""
        m, h = x.shape
        y = _empty(x, m, h)
        total = None if residual is None else _empty(x, m, h)
        self._lib.tri_rms_norm(_ptr(x), _ptr(residual), _ptr(total), _ptr(weight), m, h, eps,
                               _ptr(y), threads)
        return y, total

    def silu_and_mul(self, x: Array, threads: int) -> Array:
        m, two_i = x.shape
        y = _empty(x, m, two_i // 2)
        self._lib.tri_silu_and_mul(_ptr(x), m, two_i // 2, _ptr(y), threads)
        return y

    def rope_store(self, q: Array, k: Array, v: Array, positions: Array, slots: Array,
                   cos_sin: Array, k_cache: Array, v_cache: Array) -> None:
        """In place: rotary on q [T, Hq, D] and k [T, Hkv, D]; then k, v into their slots of an
        fp32, fp16, q8_0 or q4_0 cache."""
        t, hq, d = q.shape
        hkv = k.shape[1]
        self._lib.tri_rope_store(_ptr(q), _row_stride(q), _ptr(k), _row_stride(k),
                                 _ptr(v), _row_stride(v), _ptr(positions),
                                 _ptr(slots), t, hq, hkv, d, _ptr(cos_sin),
                                 _ptr(k_cache), _ptr(v_cache), _kv_f16(k_cache, d))

    def extend_attention(self, q: Array, k_cache: Array, v_cache: Array, page_table: Array,
                         query_start_loc: Array, seq_lens: Array, scale: float, max_len: int,
                         threads: int) -> Array:
        """Causal attention of the chunks of new tokens q [T, Hq, D] (query_start_loc [B + 1]
        int64 splits them by sequence) -> [T, Hq, D] of q's kind; as :meth:`decode_attention`
        per token."""
        t, hq, d = q.shape
        _, page_size, hkv, _ = k_cache.shape
        out = _empty(q, t, hq, d)
        rc = self._lib.tri_extend_attention(
            _ptr(q), _row_stride(q), _ptr(k_cache), _ptr(v_cache),
            _ptr(page_table), _row_stride(page_table), _ptr(query_start_loc),
            _ptr(seq_lens), seq_lens.shape[0], hq, hkv, d, page_size, scale, _ptr(out),
            max_len, threads, _kv_f16(k_cache, d))
        if rc == -2:
            raise MemoryError("tri_extend_attention could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"chunks or context lengths outside [1, {max_len}] or past the "
                             "page table")
        return out

    def decode_step(self, weights: DecoderWeights, page_size: int,
                    kv_dtype: Any = "float32") -> DecodeStep:
        """The whole decode step of the model ``weights`` describes, as one call; ``kv_dtype``
        is the KV cache's (a numpy or torch dtype, or "float32"/"float16")."""
        return DecodeStep(self._lib, weights, page_size, kv_dtype)

    def decode_attention(self, q: Array, k_cache: Array, v_cache: Array, page_table: Array,
                         seq_lens: Array, scale: float, max_len: int, threads: int) -> Array:
        """q [B, Hq, D] -> [B, Hq, D] of q's kind."""
        b, hq, d = q.shape
        _, page_size, hkv, _ = k_cache.shape
        out = _empty(q, b, hq, d)
        rc = self._lib.tri_decode_attention(
            _ptr(q), _row_stride(q), _ptr(k_cache), _ptr(v_cache),
            _ptr(page_table), _row_stride(page_table), _ptr(seq_lens), b, hq, hkv, d,
            page_size, scale, _ptr(out), max_len, threads, _kv_f16(k_cache, d))
        if rc == -2:
            raise MemoryError("tri_decode_attention could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"a context length outside [1, {max_len}] or past the page table")
        return out


# -- a whole decode step in one call (tri_decode_step) -----------------------------------------------


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One pre-norm decoder layer (Llama, Qwen2, Qwen3): norms' weights and packed linears with
    their biases (None where the model has none); arrays are numpy arrays or CPU torch tensors."""

    input_norm: Array
    post_norm: Array
    q_norm: Array | None
    k_norm: Array | None
    qkv: tuple[Packed, Array | None]
    o: tuple[Packed, Array | None]
    gate_up: tuple[Packed, Array | None]
    down: tuple[Packed, Array | None]


@dataclass(frozen=True)
class DecoderWeights:
    """What :class:`DecodeStep` needs of a model: shapes, the embedding table (packed or fp32
    [vocab, H]), the layers, the final norm, the lm_head (packed) and the rotary cos/sin table;
    arrays are numpy arrays or CPU torch tensors."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    embed: PackedWeight | Array
    layers: list[DecoderLayerWeights]
    final_norm: Array
    lm_head: Packed
    cos_sin: Array

    def arrays(self) -> list[Array]:
        """Every array besides the packed weights: the final norm, the rotary table, an fp32
        embedding, each layer's norms and biases."""
        out = [self.final_norm, self.cos_sin]
        if not isinstance(self.embed, PackedWeight):
            out.append(self.embed)
        for layer in self.layers:
            out += [a for a in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                                layer.qkv[1], layer.o[1], layer.gate_up[1], layer.down[1])
                    if a is not None]
        return out


class DecodeStep:
    """A model's whole decode step as one C call (``tri_decode_step``); see cpu_kernels.c.

    Holds the C description of the model (pointers into the given arrays, which it keeps alive),
    checked by the library once here. :meth:`__call__` runs B sequences decoding one token each
    and returns their logits. ``kv_dtype``, the KV cache's, is a numpy or torch dtype or
    "float32"/"float16"."""

    def __init__(self, lib: ctypes.CDLL, w: DecoderWeights, page_size: int,
                 kv_dtype: Any = "float32") -> None:
        self._lib = lib
        self._keep = w
        kv_f16 = _kv_kind(kv_dtype)
        layers = (_Layer * len(w.layers))()
        for i, lw in enumerate(w.layers):
            layers[i] = _Layer(_ptr(lw.input_norm), _ptr(lw.post_norm), _ptr(lw.q_norm),
                               _ptr(lw.k_norm), _lin(*lw.qkv), _lin(*lw.o), _lin(*lw.gate_up),
                               _lin(*lw.down))
        self._layers = layers
        hidden = w.layers[0].input_norm.shape[0]
        inter = w.layers[0].down[0].in_features
        if isinstance(w.embed, PackedWeight):
            embed_fmt, embed, row = _fmt_code(w.embed), w.embed.data, w.embed.data.strides[0]
        else:
            embed_fmt, embed, row = 0, w.embed, _row_stride(w.embed) * 4
        self.kv_dtype = kv_dtype
        self._kv_f16 = kv_f16
        self._head_dim = w.head_dim
        self._model = _Model(len(w.layers), hidden, w.num_heads, w.num_kv_heads, w.head_dim, inter,
                             page_size, int(kv_f16), w.eps, w.head_dim**-0.5,
                             embed_fmt, _ptr(embed), row, embed.shape[0], _ptr(w.final_norm),
                             _lin(w.lm_head, None), _ptr(w.cos_sin), layers)
        if not lib.tri_model_valid(ctypes.byref(self._model)):
            raise ValueError("tri_model_valid rejected the decoder's description")
        self.vocab_size = w.lm_head.out_features
        self._caches: tuple[tuple[int, ...], ctypes.Array, ctypes.Array] | None = None

    def _cache_pointers(self, k_caches: list[Array], v_caches: list[Array],
                        ) -> tuple[ctypes.Array, ctypes.Array]:
        key = tuple(_ptr(t) for t in (*k_caches, *v_caches))
        if self._caches is None or self._caches[0] != key:
            n = len(k_caches)
            self._caches = (key, (_P * n)(*key[:n]), (_P * n)(*key[n:]))
        return self._caches[1], self._caches[2]

    def __call__(self, ids: Array, positions: Array, slots: Array, page_table: Array,
                 seq_lens: Array, max_len: int, k_caches: list[Array], v_caches: list[Array],
                 threads: int) -> Array:
        """int64 contiguous ids, positions, slots, seq_lens [B] and page_table [B, pages] (rows
        contiguous); caches [pages, page_size, Hkv, D] per layer, of this step's KV dtype ->
        logits [B, vocab] of the kind of ``ids``."""
        if _kv_kind(k_caches[0], self._head_dim) != self._kv_f16:
            raise ValueError(f"a {self.kv_dtype} step given a {k_caches[0].dtype} KV cache")
        b = ids.shape[0]
        logits = _empty(ids, b, self.vocab_size)
        ks, vs = self._cache_pointers(k_caches, v_caches)
        rc = self._lib.tri_decode_step(ctypes.byref(self._model), ks, vs, b, _ptr(ids),
                                       _ptr(positions), _ptr(slots),
                                       _ptr(page_table), _row_stride(page_table),
                                       _ptr(seq_lens), max_len, _ptr(logits), threads)
        if rc == -2:
            raise MemoryError("tri_decode_step could not allocate its scratch")
        if rc != 0:
            raise ValueError(f"a context length outside [1, {max_len}] or past the page table")
        return logits
