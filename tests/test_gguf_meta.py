"""models/gguf_meta.py: our GGUF metadata reader reads what ``gguf.GGUFReader`` reads (and
models/gguf_header.py finds where its key/values end, as GGUFReader does).

Compared field by field (value and type) and tensor by tensor (name, type, shape, offsets and the
data views) on files written by ``gguf.GGUFWriter`` with every value type, and on the default
model's file. A file truncated anywhere before its last tensor's data end is refused with
GGUFError, and bytes overwritten anywhere in the metadata give a GGUFError or a file that
parses, never another exception.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trio_infer.models.default_model import default_cache_dir, default_model_file
from trio_infer.models.gguf_header import metadata_end
from trio_infer.models.gguf_meta import GGUFMetadata
from trio_infer.models.paths import GGUFError

gguf = pytest.importorskip("gguf")
V = gguf.GGUFValueType

SMOLLM2 = default_model_file(default_cache_dir())

# key -> (value, type, array item type)
SCALARS: dict[str, tuple[Any, Any]] = {
    "t.uint8": (200, V.UINT8),
    "t.int8": (-100, V.INT8),
    "t.uint16": (60000, V.UINT16),
    "t.int16": (-30000, V.INT16),
    "t.uint32": (4_000_000_000, V.UINT32),
    "t.int32": (-2_000_000_000, V.INT32),
    "t.float32": (1e-5, V.FLOAT32),
    "t.bool.true": (True, V.BOOL),
    "t.bool.false": (False, V.BOOL),
    "t.uint64": (2**63 + 5, V.UINT64),
    "t.int64": (-(2**62), V.INT64),
    "t.float64": (3.141592653589793, V.FLOAT64),
    "t.string": ("plain", V.STRING),
    "t.string.unicode": ("héllo, 世界 🙂 \u0120\u010a", V.STRING),
    "t.string.empty": ("", V.STRING),
}
ARRAYS: dict[str, tuple[list[Any], Any]] = {
    "a.uint8": ([0, 1, 255], V.UINT8),
    "a.int8": ([-128, 0, 127], V.INT8),
    "a.uint16": ([1, 65535], V.UINT16),
    "a.int16": ([-32768, 32767], V.INT16),
    "a.uint32": ([7] * 100, V.UINT32),
    "a.int32": (list(range(-50, 50)), V.INT32),
    "a.float32": ([0.5, -1.25, 3e38], V.FLOAT32),
    "a.bool": ([True, False, True], V.BOOL),
    "a.uint64": ([2**64 - 1, 0], V.UINT64),
    "a.int64": ([-(2**63), 2**63 - 1], V.INT64),
    "a.float64": ([1e-300, 2.5], V.FLOAT64),
    "a.strings": (["a", "", "Ġthe", "日本語", "<|im_end|>", "x" * 100], V.STRING),
}


def write_every_type(path: Path, tensors: bool = True) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype) in SCALARS.items():
        writer.add_key_value(key, value, vtype)
    for key, (value, item) in ARRAYS.items():
        writer.add_key_value(key, value, V.ARRAY, sub_type=item)
    writer.add_key_value("a.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    if tensors:
        rng = np.random.default_rng(0)
        writer.add_tensor("f32.weight", rng.standard_normal((3, 5)).astype(np.float32))
        writer.add_tensor("f16.weight", rng.standard_normal((4, 64)).astype(np.float16))
        writer.add_tensor("vec.bias", rng.standard_normal(7).astype(np.float32))
        data = rng.standard_normal((2, 64)).astype(np.float32)
        for kind in ("Q8_0", "Q4_0", "BF16"):
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(f"{kind.lower()}.weight", gguf.quants.quantize(data, qtype),
                              raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf_reader(path: Path) -> GGUFMetadata:
    ours = GGUFMetadata.open(path)
    reader = gguf.GGUFReader(str(path))
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        theirs = reader.fields[key]
        value = ours.fields[key]
        assert ours.types[key] == theirs.types[0], key
        if isinstance(value, np.ndarray):
            assert not value.flags.writeable, key
            value = value.tolist()
        elif isinstance(value, list) and value and isinstance(value[0], np.ndarray):
            value = [x for v in value for x in v.tolist()]  # GGUFReader flattens nested arrays
        assert value == theirs.contents(), key
    assert ours.data_offset == reader.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(theirs.shape.tolist())
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        data = ours.tensor_data(mine)
        assert (data.dtype, data.shape) == (theirs.data.dtype, theirs.data.shape), mine.name
        assert np.array_equal(data, theirs.data), mine.name
    return ours


def test_every_value_type_reads_as_gguf_reader_reads_it(tmp_path: Path) -> None:
    ours = assert_same_as_gguf_reader(write_every_type(tmp_path / "all.gguf"))
    # And as written, in Python types (not numpy scalars):
    for key, (value, _) in SCALARS.items():
        got = ours.get(key)
        assert type(got) is type(value), key
        assert got == (pytest.approx(value, rel=1e-7) if key == "t.float32" else value), key
    assert ours.get("a.strings") == ARRAYS["a.strings"][0]
    assert [a.tolist() for a in ours.get("a.nested")] == [[1, 2], [3]]
    assert ours.get("missing", 42) == 42


def test_empty_arrays_read_as_gguf_reader_reads_them(tmp_path: Path) -> None:
    """GGUFWriter refuses to write an empty array, but the format allows it: written by hand."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    def empty_array(key: str, item: Any) -> bytes:
        return string(key) + struct.pack("<IIQ", V.ARRAY, item, 0)

    path = tmp_path / "empty.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 3) + empty_array("a.empty", V.INT32)
                     + empty_array("a.empty.strings", V.STRING)
                     + string("after") + struct.pack("<I", V.STRING) + string("ok"))
    ours = assert_same_as_gguf_reader(path)
    assert ours.get("a.empty").shape == (0,)
    assert ours.get("a.empty.strings") == []
    assert ours.get("after") == "ok"


def test_tensor_data_are_views_of_the_file(tmp_path: Path) -> None:
    ours = GGUFMetadata.open(write_every_type(tmp_path / "all.gguf"))
    data = ours.tensor_data(ours.tensors[0])
    assert not data.flags.owndata and not data.flags.writeable


@pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"the default model is not at {SMOLLM2}")
def test_default_model_file_reads_as_gguf_reader_reads_it() -> None:
    ours = assert_same_as_gguf_reader(SMOLLM2)
    assert len(ours.get("tokenizer.ggml.tokens")) == 49152
    assert ours.get("general.architecture") == "llama"


def test_every_truncation_is_refused(tmp_path: Path) -> None:
    """Cut anywhere before the last tensor's last byte: GGUFError; cut after it (only alignment
    padding lost): the same metadata. Every cut in the metadata, one in 13 in the tensor data,
    and the cuts next to each tensor's end."""
    data = write_every_type(tmp_path / "all.gguf").read_bytes()
    full = GGUFMetadata.open(tmp_path / "all.gguf")
    end = max(t.data_offset + t.n_bytes for t in full.tensors)
    ends = {t.data_offset + t.n_bytes + d for t in full.tensors for d in (-1, 0, 1)}
    sizes = set(range(full.data_offset + 1)) | set(range(full.data_offset, len(data), 13)) | ends
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data)
    for size in sorted((n for n in sizes if n < len(data)), reverse=True):
        os.truncate(cut, size)
        if size < end:
            with pytest.raises(GGUFError, match="truncated or corrupt"):
                GGUFMetadata.open(cut)
        else:
            assert GGUFMetadata.open(cut).tensors == full.tensors


def test_not_a_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFMetadata.open(path)
    with pytest.raises(FileNotFoundError):
        GGUFMetadata.open(tmp_path / "missing.gguf")


@settings(max_examples=200, deadline=None, derandomize=True)
@example(edits=[(7715, 128)])  # a string's length past sys.maxsize: OverflowError from the slice
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                      max_size=4))
def test_corrupt_bytes_give_gguf_error_or_a_parse(tmp_path_factory: pytest.TempPathFactory,
                                                  edits: list[tuple[int, int]]) -> None:
    """Bytes overwritten in the metadata (lengths, counts, types, offsets) never escape as
    anything but GGUFError."""
    folder = tmp_path_factory.mktemp("corrupt")
    data = bytearray(write_every_type(folder / "all.gguf", tensors=False).read_bytes())
    for at, byte in edits:
        data[at % len(data)] = byte
    path = folder / "edited.gguf"
    path.write_bytes(bytes(data))
    try:
        GGUFMetadata.open(path)
    except GGUFError as exc:
        assert "truncated or corrupt" in str(exc)
    try:
        assert 0 < metadata_end(path) <= len(data)
    except GGUFError as exc:
        assert "truncated or corrupt" in str(exc) or "past the end" in str(exc) or "starts with" in str(exc)


def _kv_end(path: Path) -> int:
    """Where GGUFReader's last key/value ends."""
    last = list(gguf.GGUFReader(str(path)).fields.values())[-1]
    return last.offset + sum(int(part.nbytes) for part in last.parts)


def test_metadata_end_is_where_gguf_reader_s_key_values_end(tmp_path: Path) -> None:
    """What the tokenizer cache hashes: every value type, nested and empty arrays."""
    for path in (write_every_type(tmp_path / "all.gguf"), write_every_type(tmp_path / "kv.gguf", False)):
        assert metadata_end(path) == _kv_end(path)
    test_empty_arrays_read_as_gguf_reader_reads_them(tmp_path)
    assert metadata_end(tmp_path / "empty.gguf") == (tmp_path / "empty.gguf").stat().st_size


def test_metadata_end_refuses_a_cut_in_the_metadata(tmp_path: Path) -> None:
    data = write_every_type(tmp_path / "all.gguf", tensors=False).read_bytes()
    end = metadata_end(tmp_path / "all.gguf")
    cut = tmp_path / "cut.gguf"
    for size in range(0, end, 7):
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFError):
            metadata_end(cut)


def test_a_string_array_is_decoded_when_read_and_bad_utf8_says_so(tmp_path: Path) -> None:
    """The worker never reads the vocabulary: its strings are decoded on first use, and bytes
    that are not UTF-8 give GGUFError then (not at open)."""
    path = write_every_type(tmp_path / "all.gguf", tensors=False)
    data = bytearray(path.read_bytes())
    at = data.index("日本語".encode())
    data[at] = 0xFF  # no longer UTF-8
    path.write_bytes(bytes(data))
    strings = GGUFMetadata.open(path).get("a.strings")
    assert len(strings) == len(ARRAYS["a.strings"][0])
    with pytest.raises(GGUFError, match="not UTF-8"):
        list(strings)
