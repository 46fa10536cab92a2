"""The benchmark tool's pure helpers: ranges, workloads, percentiles, CPU accounting."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest

from trio_infer.bench import procstat, stats
from trio_infer.bench.frontend import _interp
from trio_infer.bench.offline import (
    add_arguments,
    resolve_checkpoint,
    speculative_overrides,
    token_range,
)
from trio_infer.bench.workload import (
    LengthRange,
    make_text_workload,
    make_workload,
    parse_range,
)


def test_parse_range() -> None:
    assert parse_range("32:512") == LengthRange(32, 512)
    assert parse_range("7") == LengthRange(7, 7)
    for bad in ("0:4", "5:4", "a:b", "1:2:3", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_range(bad)


def test_workload_is_seeded_and_in_range() -> None:
    a = make_workload(20, LengthRange(4, 9), LengthRange(1, 3), 100, seed=5)
    b = make_workload(20, LengthRange(4, 9), LengthRange(1, 3), 100, seed=5)
    c = make_workload(20, LengthRange(4, 9), LengthRange(1, 3), 100, seed=6)
    assert a == b and a != c
    for r in a:
        assert 4 <= r.prompt_len <= 9 and 1 <= r.output_len <= 3
        assert all(3 <= t < 100 for t in r.prompt_ids)


def test_shared_prefix() -> None:
    w = make_workload(5, LengthRange(2, 4), LengthRange(1, 1), 50, shared_prefix_len=8)
    prefix = w[0].prompt_ids[:8]
    assert all(r.prompt_ids[:8] == prefix for r in w)
    assert all(10 <= r.prompt_len <= 12 for r in w)
    texts = make_text_workload(3, LengthRange(2, 2), LengthRange(4, 4), shared_prefix_len=5)
    assert len({t.split()[:5].__repr__() for t, _ in texts}) == 1
    assert all(n == 4 for _, n in texts)


def test_percentile_and_summary() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert stats.percentile(xs, 50) == pytest.approx(50.5)
    assert stats.percentile(xs, 99) == pytest.approx(99.01)
    assert math.isnan(stats.percentile([], 50))
    s = stats.summarize([0.001, 0.003], scale=1000)
    assert s["p50"] == pytest.approx(2.0) and s["max"] == pytest.approx(3.0)


def test_json_has_no_nan(tmp_path) -> None:
    stats.write_json(tmp_path / "x.json", {"a": math.nan, "b": [math.inf, 1.0]})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": None, "b": [None, 1.0]}


def test_interp() -> None:
    series = [(0.0, 0), (1.0, 100), (2.0, 300)]
    assert _interp(series, 0.5) == pytest.approx(50)
    assert _interp(series, 1.5) == pytest.approx(200)
    assert _interp(series, -1) == 0 and _interp(series, 5) == 300


@pytest.mark.skipif(not procstat.available(), reason="needs Linux /proc schedstat")
def test_cpu_meter_counts_own_work() -> None:
    meter = procstat.CpuMeter(os.getpid())
    x = 0
    for i in range(300_000):
        x += i * i
    assert meter.sample() > 1_000_000  # more than 1 ms of CPU, counted in ns
    assert procstat.process_cpu_seconds(os.getpid()) > 0


def _sse(delta: dict, finish: str | None = None) -> bytes:
    obj = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_client_counts_reads_and_text_events() -> None:
    """A chat stream without usage whose role chunk, three token events (three HTTP chunks) and
    closing chunk all arrive in ONE socket write: three token events, counted as three tokens,
    one read (so no zero gaps), three HTTP chunks; the role-only and closing chunks are not
    tokens."""
    import trio

    from trio_infer.bench.client import Endpoint, stream_sse

    events = [_sse({"role": "assistant", "content": ""}), _sse({"content": "a"}),
              _sse({"content": "b"}), _sse({"content": "c"}), _sse({}, "length"),
              b"data: [DONE]\n\n"]
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]

        async def serve_one() -> None:
            stream = await listeners[0].accept()
            async with stream:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await stream.receive_some(65536)
                await trio.sleep(0.05)  # the request body too
                await stream.send_all(head + body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_one)
            res = await stream_sse(Endpoint("127.0.0.1", port, "/v1"), "/chat/completions",
                                   {"stream": True})
            nursery.cancel_scope.cancel()
        assert res.ok, res.error
        assert len(res.event_times) == 3 and res.output_tokens == 3
        assert res.completion_tokens is None
        assert res.http_chunks == 3
        # One read, unless the kernel split the 1 KB write (then still no more reads than chunks).
        assert 1 <= len(res.chunk_times) <= 3 and len(set(res.chunk_times)) == len(res.chunk_times)

    trio.run(main)


def test_token_range_skips_special_ids() -> None:
    # SmolLM2: 17 control tokens at the start of its 49152 ids
    assert token_range(49152, set(range(17))) == (17, 49152)
    # Qwen: special ids after the ordinary ones, embedding rows beyond the tokenizer
    assert token_range(151936, set(range(151643, 151669))) == (0, 151643)
    # the synthetic shapes (and no tokenizer at all): ids 3.. as the workloads always had
    assert token_range(1024, {0, 1, 2}) == (3, 1024)
    assert token_range(1024, None) == (3, 1024)
    # the longest run wins; ids at or above the vocabulary do not count
    assert token_range(100, {0, 10, 90, 500}) == (11, 90)
    with pytest.raises(SystemExit):
        token_range(3, {0, 1, 2})


def test_default_model_alias_without_the_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRIO_INFER_CACHE_DIR", str(tmp_path))
    args = argparse.Namespace(model="smollm2", shape=None, cache_dir=None)
    with pytest.raises(SystemExit, match="make venv"):
        resolve_checkpoint(args)


def test_model_path_of_a_gguf_folder(tmp_path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"")
    args = argparse.Namespace(model=str(tmp_path), shape=None, cache_dir=None)
    assert resolve_checkpoint(args) == tmp_path / "m.gguf"
    with pytest.raises(SystemExit, match="neither"):
        resolve_checkpoint(argparse.Namespace(model=str(tmp_path / "nope"), shape=None,
                                              cache_dir=None))


def test_a_llama_cpp_built_with_amx_is_refused_with_the_rebuild_command() -> None:
    from trio_infer.bench import llamacpp

    with pytest.raises(SystemExit, match="mno-amx-int8"):
        llamacpp.refuse_amx("CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |")
    llamacpp.refuse_amx("CPU : SSE3 = 1 | AVX512 = 1 | OPENMP = 1 |")  # no AMX: nothing said


def test_speculative_options_reach_the_engine_settings() -> None:
    """Each ``--speculative-*`` option given becomes the engine setting of its name; one not
    given leaves the server's default (absent from the overrides)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plain = parser.parse_args(["--speculative", "ngram"])
    assert speculative_overrides(plain) == {"speculative": "ngram"}
    given = parser.parse_args(["--speculative", "ngram", "--speculative-tokens", "6",
                               "--speculative-ngram", "4", "--speculative-ngram-min", "1",
                               "--speculative-max-batch", "2", "--no-speculative-payoff"])
    assert speculative_overrides(given) == {
        "speculative": "ngram", "speculative_tokens": 6, "speculative_ngram": 4,
        "speculative_ngram_min": 1, "speculative_max_batch": 2, "speculative_payoff": False}
