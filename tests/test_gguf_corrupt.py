"""A broken GGUF file is one clear error: truncated anywhere, or its bytes overwritten anywhere in
its header (magic, version, counts, metadata keys and values, tensor infos), the loaders either
load it (a byte of the weights themselves is just a different weight) or raise
:class:`~trio_infer.models.paths.GGUFError` naming the file; never another exception, never a
hang. The entry points turn that error into one line (tests/test_generate_cli.py and
tests/runtime/test_background_load.py cover generate, serve and bare hypercorn)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_infer.models.loader import load_model, load_tokenizer
from trio_infer.models.paths import GGUFError

from tests.test_gguf import write_gguf


@pytest.fixture(scope="module")
def good_file(tiny_checkpoint_factory, tmp_path_factory) -> bytes:  # type: ignore[no-untyped-def]
    checkpoint = tiny_checkpoint_factory("Qwen3ForCausalLM")
    path = write_gguf(checkpoint, tmp_path_factory.mktemp("gguf") / "good.gguf", "Q8_0")
    return path.read_bytes()


def header_size(data: bytes) -> int:
    """Where the tensor data starts (the header, metadata and tensor infos before it)."""
    import gguf

    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        return int(gguf.GGUFReader(f.name).data_offset)


def _load(path: Path) -> None:
    load_tokenizer(path)
    load_model(path)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_truncated_or_overwritten_file_is_a_gguf_error_naming_it(good_file: bytes, tmp_path: Path,
                                                                   data: st.DataObject) -> None:
    end = header_size(good_file)
    kind = data.draw(st.sampled_from(["truncate", "overwrite"]))
    if kind == "truncate":
        cut = data.draw(st.integers(0, len(good_file) - 1))
        broken = good_file[:cut]
    else:
        at = data.draw(st.integers(0, end - 1))
        junk = data.draw(st.binary(min_size=1, max_size=8))
        broken = good_file[:at] + junk + good_file[at + len(junk):]
    path = tmp_path / "broken.gguf"
    path.write_bytes(broken)
    try:
        _load(path)
    except GGUFError as exc:
        assert str(path) in str(exc) or path.name in str(exc), str(exc)
        assert "\n" not in str(exc)
