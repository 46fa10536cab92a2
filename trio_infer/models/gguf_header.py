"""Where a GGUF file's key/value metadata ends, found by skipping over it: no value is decoded,
and neither numpy nor the gguf package is imported (the front end calls it, and stays light).

Why: the tokenizer of a GGUF file is made from its metadata alone (``tokenizer.ggml.*``), so the
key of its cache (``runtime/tokenizer_cache.py``) is a hash of the bytes before this offset: the
header and every key/value, whatever the weights after them. Hashing the whole file instead cost
0.15 s on the default model's 98 MB and about a second per GB of a bigger one, at every start.

The layout is ``models/gguf_meta.py``'s (which decodes what this skips): the magic, a uint32
version, uint64 tensor and key/value counts, then each key/value as a string key (uint64 length +
bytes), a uint32 value type and the value; an array is a uint32 item type, a uint64 count and
the items.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from trio_infer.models.paths import GGUFError

_HEADER = struct.Struct("<4sIQQ")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ARRAY = struct.Struct("<IQ")
_STRING, _ARRAY_TYPE = 8, 9
# Bytes of each fixed-size value type (GGUF's numbering: uint8 0 ... float64 12).
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def metadata_end(path: str | Path) -> int:
    """The offset just past the last key/value of the GGUF file ``path``. Raises GGUFError if it
    is not a GGUF file or its metadata runs past its end."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < _HEADER.size:
            raise GGUFError(f"cannot read GGUF file {path}: {size} bytes is shorter than a header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            magic, _, _, n_kv = _HEADER.unpack_from(buf, 0)
            if magic != b"GGUF":
                raise GGUFError(f"cannot read GGUF file {path}: it starts with {magic!r}, not b'GGUF' "
                            "(not a GGUF file)")
            try:
                pos = _HEADER.size
                for _ in range(n_kv):
                    pos = _skip_string(buf, pos)
                    (kind,) = _U32.unpack_from(buf, pos)
                    pos = _skip_value(buf, pos + 4, kind)
            except (struct.error, ValueError, OverflowError) as exc:
                raise GGUFError(f"cannot read GGUF file {path}: its metadata is truncated or "
                                f"corrupt ({exc})") from None
    if pos > size:
        raise GGUFError(f"cannot read GGUF file {path}: its metadata ends past the end of the file")
    return pos


def _skip_string(buf: mmap.mmap, pos: int) -> int:
    return pos + 8 + _U64.unpack_from(buf, pos)[0]


def _skip_value(buf: mmap.mmap, pos: int, kind: int) -> int:
    size = _SIZES.get(kind)
    if size is not None:
        return pos + size
    if kind == _STRING:
        return _skip_string(buf, pos)
    if kind != _ARRAY_TYPE:
        raise ValueError(f"unknown value type {kind} at byte {pos - 4}")
    item, count = _ARRAY.unpack_from(buf, pos)
    pos += _ARRAY.size
    size = _SIZES.get(item)
    if size is not None:
        return pos + count * size
    if count > len(buf):  # each item takes at least a byte
        raise ValueError(f"an array of {count} at byte {pos} is longer than the file")
    if item == _STRING:  # the one long loop: a vocabulary's strings, lengths only
        unpack = _U64.unpack_from
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        return pos
    for _ in range(count):  # arrays of arrays: rare, and short
        pos = _skip_value(buf, pos, item)
    return pos
