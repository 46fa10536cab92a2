"""A GGUF file's header, key/value metadata and tensor list, read from a memory map in one pass.

``gguf.GGUFReader`` parses every value, down to each element of each array, as a numpy view of a
memmap: about a million tiny views for SmolLM2's 49k-token vocabulary and merges, 4-5 s of a
start-up on a 2-core machine, before a single weight is read. This reader walks the same bytes
with :mod:`struct`: a scalar is one ``unpack_from``; a numeric array is one ``np.frombuffer``
view (no copy); an array of strings is one tight loop over its items' lengths (~6 ms for 100k
of them), their bytes decoded only when the array is first read (:class:`StringArray`). Tensor data are numpy views over the map, shaped as
``GGUFReader`` shapes them, and nothing is read from them until a caller does.

Layout (GGUF versions 2 and 3, little-endian): the magic ``GGUF``, a uint32 version, uint64
tensor and key/value counts; each key/value as a string key (uint64 length + UTF-8 bytes), a
uint32 value type and the value (an array: uint32 item type, uint64 count, the items); each
tensor as its name, uint32 number of dimensions, uint64 dimensions (the fastest-varying first),
uint32 type and uint64 offset from the data section, which starts at the next multiple of
``general.alignment`` (32 by default) after the tensor list.

A file that ends early, or whose counts, types or offsets make no sense, raises
:class:`~trio_infer.models.paths.GGUFError` saying it is truncated or corrupt, before any
caller sees a partial result.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from trio_infer.models.paths import GGUFError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Scalar value types: struct format (little-endian) and the numpy dtype of an array of them.
_SCALARS: dict[int, tuple[struct.Struct, np.dtype[Any]]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<?"), np.dtype(np.bool_)),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
_ARRAY = struct.Struct("<IQ")
_TENSOR_TAIL = struct.Struct("<IQ")  # type, offset

# Tensor types numpy holds as their own element type (GGUFReader's choice); the rest are bytes.
_NUMPY_TENSORS: dict[int, np.dtype[Any]] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


class _Corrupt(Exception):
    """Raised inside the parser; :meth:`GGUFMetadata.open` turns it into a GGUFError."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the file: where its data are, not the data."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension (columns) first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file


class GGUFMetadata:
    """An opened GGUF file: its metadata parsed, its tensors located, the file mapped (read-only;
    pages are read only when a tensor's data are)."""

    def __init__(self, path: Path, version: int, fields: dict[str, Any],
                 types: dict[str, GGUFValueType], tensors: list[TensorInfo], alignment: int,
                 data_offset: int, mapped: mmap.mmap) -> None:
        self.path = path
        self.version = version
        # key -> value: a scalar as a Python int, float or bool; a string as str; an array of
        # numbers as a read-only numpy array (a view of the map, no copy); an array of strings as
        # a StringArray (a sequence of str, decoded when first read); an array of arrays as a
        # list of those.
        self.fields = fields
        self.types = types  # key -> its GGUF value type (ARRAY for arrays)
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self._map = mapped

    @classmethod
    def open(cls, path: str | Path) -> GGUFMetadata:
        """Map and parse ``path``. Raises FileNotFoundError if it does not exist and
        :class:`GGUFError` if it is not a GGUF file we can read (truncated, corrupt, big-endian,
        an unknown version)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            try:
                if size < _HEADER.size:
                    raise _Corrupt(f"{size} bytes is shorter than a GGUF header")
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                return cls(path, *_parse(mapped, size), mapped)
            except (_Corrupt, struct.error, ValueError, OverflowError, UnicodeDecodeError) as exc:
                raise GGUFError(
                    f"cannot read GGUF file {path} ({size} bytes): it is truncated or corrupt "
                    f"({exc})"
                ) from exc

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (see ``fields`` for the types), or ``default``."""
        return self.fields.get(key, default)

    def tensor_data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's data as a read-only numpy view of the map, shaped as ``GGUFReader``
        shapes it: the element type and reversed GGUF shape for float and integer types, bytes
        (rows..., bytes per row) for the block-quantized ones and BF16."""
        from gguf.quants import quant_shape_to_byte_shape

        dims = tuple(reversed(tensor.shape))
        dtype = _NUMPY_TENSORS.get(tensor.tensor_type)
        if dtype is None:
            return np.frombuffer(self._map, np.uint8, tensor.n_bytes, tensor.data_offset).reshape(
                quant_shape_to_byte_shape(dims, tensor.tensor_type))
        return np.frombuffer(self._map, dtype, tensor.n_elements, tensor.data_offset).reshape(dims)


# -- the parser ----------------------------------------------------------------------------------


def _parse(buf: mmap.mmap, size: int) -> tuple[
        int, dict[str, Any], dict[str, GGUFValueType], list[TensorInfo], int, int]:
    magic, version, n_tensors, n_kv = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise _Corrupt(f"not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0:
            raise _Corrupt("a big-endian GGUF file; only little-endian files are supported")
        raise _Corrupt(f"GGUF version {version}; supported: "
                       f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    pos = _HEADER.size
    fields: dict[str, Any] = {}
    types: dict[str, GGUFValueType] = {}
    for _ in range(n_kv):
        key, pos = _string(buf, pos, size)
        (kind,), pos = _U32.unpack_from(buf, pos), pos + 4
        if key in fields:
            raise _Corrupt(f"the key {key!r} appears twice")
        fields[key], pos = _value(buf, pos, kind, size)
        types[key] = GGUFValueType(kind)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        alignment = fields["general.alignment"]
        if types["general.alignment"] != GGUFValueType.UINT32 or alignment <= 0 or (
                alignment & (alignment - 1)):
            raise _Corrupt(f"general.alignment {alignment!r} is not a power of two (uint32)")
    entries = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name, pos = _string(buf, pos, size)
        (n_dims,), pos = _U32.unpack_from(buf, pos), pos + 4
        if n_dims > 8:  # ggml's limit is 4
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        shape = struct.unpack_from(f"<{n_dims}Q", buf, pos)
        pos += 8 * n_dims
        (raw_type, offset), pos = _TENSOR_TAIL.unpack_from(buf, pos), pos + _TENSOR_TAIL.size
        if name in names:
            raise _Corrupt(f"the tensor {name!r} appears twice")
        names.add(name)
        entries.append((name, raw_type, shape, offset))
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for name, raw_type, shape, offset in entries:
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise _Corrupt(f"tensor {name!r} has an unknown type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[kind]
        n_elements = 1
        for dim in shape:
            n_elements *= dim
        if shape and shape[0] % block:
            raise _Corrupt(f"tensor {name!r}: {shape[0]} columns of {kind.name} are not a whole "
                           f"number of {block}-element blocks")
        n_bytes = n_elements // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise _Corrupt(f"tensor {name!r} ends at byte {start + n_bytes}, past the end")
        tensors.append(TensorInfo(name, kind, tuple(shape), n_elements, n_bytes, start))
    return version, fields, types, tensors, alignment, data_start


def _string(buf: mmap.mmap, pos: int, size: int) -> tuple[str, int]:
    (n,) = _U64.unpack_from(buf, pos)
    start, end = pos + 8, pos + 8 + n
    if end > size:
        raise _Corrupt(f"a string at byte {pos} ends past the end")
    return buf[start:end].decode("utf-8"), end


def _value(buf: mmap.mmap, pos: int, kind: int, size: int) -> tuple[Any, int]:
    scalar = _SCALARS.get(kind)
    if scalar is not None:
        fmt = scalar[0]
        return fmt.unpack_from(buf, pos)[0], pos + fmt.size
    if kind == GGUFValueType.STRING:
        return _string(buf, pos, size)
    if kind != GGUFValueType.ARRAY:
        raise _Corrupt(f"unknown value type {kind} at byte {pos - 4}")
    item, count = _ARRAY.unpack_from(buf, pos)
    pos += _ARRAY.size
    scalar = _SCALARS.get(item)
    if scalar is not None:  # one view, however long
        dtype = scalar[1]
        if pos + count * dtype.itemsize > size:
            raise _Corrupt(f"an array of {count} at byte {pos} ends past the end")
        return np.frombuffer(buf, dtype, count, pos), pos + count * dtype.itemsize
    if item == GGUFValueType.STRING:
        return _strings(buf, pos, count, size)
    if count > size:  # each item takes at least a byte
        raise _Corrupt(f"an array of {count} at byte {pos} is longer than the file")
    items = []
    for _ in range(count):  # arrays of arrays: rare, and short
        value, pos = _value(buf, pos, item, size)
        items.append(value)
    return items, pos


def _strings(buf: mmap.mmap, pos: int, count: int, size: int) -> tuple[StringArray, int]:
    """``count`` length-prefixed strings, their lengths walked now (where the array ends) and
    their bytes decoded when first read (:class:`StringArray`); the one loop over a vocabulary's
    items, kept tight (a truncated item makes the next length read fail; the last one is
    checked after)."""
    if count * 8 > size:
        raise _Corrupt(f"an array of {count} strings at byte {pos} is longer than the file")
    unpack = _U64.unpack_from
    start = pos
    for _ in range(count):
        pos += 8 + unpack(buf, pos)[0]
    if pos > size:
        raise _Corrupt("a string array ends past the end of the file")
    return StringArray(buf, start, count), pos


class StringArray(Sequence[str]):
    """An array of strings of the file, decoded on first use (all of it, once).

    Why: a vocabulary's tokens and merges (49k and 48k strings for SmolLM2) are most of a file's
    metadata, and the batching worker never reads them (tokenizing is the front end's, from the
    cached tokenizer): decoding them cost it 15-40 ms of its start-up for nothing; walking their
    lengths costs a third of that. Compares equal to a list of the same strings. Bytes that are
    not UTF-8 raise :class:`~trio_infer.models.paths.GGUFError` when read."""

    def __init__(self, buf: mmap.mmap, pos: int, count: int) -> None:
        self._buf = buf
        self._pos = pos
        self._count = count
        self._items: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._items is None:
            buf, pos, unpack = self._buf, self._pos, _U64.unpack_from
            items = []
            try:
                for _ in range(self._count):
                    end = pos + 8 + unpack(buf, pos)[0]
                    items.append(buf[pos + 8:end].decode("utf-8"))
                    pos = end
            except UnicodeDecodeError as exc:
                raise GGUFError(f"a string of the GGUF file at byte {pos} is not UTF-8 "
                                f"({exc})") from None
            self._items = items
        return self._items

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._decoded()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            other = other._decoded()
        return isinstance(other, list) and self._decoded() == other

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, as a list

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"
