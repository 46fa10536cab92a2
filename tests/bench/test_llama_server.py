"""``serve --baseline llama-server`` / ``--variant`` and ``startup``: their helpers, and smoke runs.

The llama-server binary is never built here (about 10 minutes on 2 cores): the tests that need it
skip unless ``python -m trio_infer.bench llama-server --build`` has cached it (or
``$TRIO_INFER_LLAMA_SERVER`` points at one). The other smoke runs use the fake model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trio_infer.bench import llamaserver, serve, startup, versus
from trio_infer.bench.__main__ import build_parser
from trio_infer.models.default_model import default_cache_dir, default_model_file

ENV = {**os.environ, "TRIO_INFER_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
SMOLLM2 = default_model_file(default_cache_dir())


def bench(*args: str, timeout: float = 180) -> str:
    proc = subprocess.run([sys.executable, "-m", "trio_infer.bench", *args], env=ENV,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# -- helpers -----------------------------------------------------------------------------------


def test_cache_layout_and_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(llamaserver.ENV_BINARY, raising=False)
    assert llamaserver.binary_path(tmp_path) == (
        tmp_path / "llama-server" / llamaserver.VERSION / "bin" / "llama-server")
    assert llamaserver.find_binary(tmp_path) is None
    fake = tmp_path / "llama-server-bin"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(llamaserver.ENV_BINARY, str(fake))
    assert llamaserver.find_binary(tmp_path) == fake
    cmd = llamaserver.command(fake, Path("m.gguf"), 8123, threads=2, slots=8, ctx_per_slot=512)
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-np") + 1] == "8"
    assert cmd[cmd.index("-c") + 1] == "4096" and cmd[cmd.index("--port") + 1] == "8123"


def test_a_binary_built_with_other_flags_is_not_found(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(llamaserver.ENV_BINARY, raising=False)
    binary = llamaserver.binary_path(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert llamaserver.find_binary(tmp_path) is None  # no stamp: an older build, with AMX
    stamp = binary.with_name("build-flags")
    stamp.write_text("-DGGML_NATIVE=ON\n")
    assert llamaserver.find_binary(tmp_path) is None
    stamp.write_text("\n".join(llamaserver.CMAKE_FLAGS) + "\n")
    assert llamaserver.find_binary(tmp_path) == binary
    assert any("-mno-amx-int8" in flag for flag in llamaserver.CMAKE_FLAGS)


def test_build_without_tools_says_what_is_missing(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamaserver.shutil, "which", lambda name: None)
    for var in ("CC", "CXX", llamaserver.ENV_BINARY):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(llamaserver.BuildError, match="cmake, ninja, a C compiler"):
        llamaserver.build(tmp_path)
    with pytest.raises(SystemExit, match="needs cmake"):
        llamaserver.require(tmp_path)


def test_serve_modes_and_defaults() -> None:
    parser = build_parser()
    plain = serve.resolve_defaults(parser.parse_args(["serve", "--concurrency", "4"]))
    assert plain.concurrency == 4 and plain.num_prompts == 64 and plain.endpoint == "completions"
    assert str(plain.input_len) == "32:512" and not plain.ignore_eos
    with pytest.raises(SystemExit, match="several --concurrency"):
        serve.resolve_defaults(parser.parse_args(["serve", "--concurrency", "1,8"]))
    cmp = serve.resolve_defaults(parser.parse_args(
        ["serve", "--baseline", "llama-server", "--variant", "t2=--torch-threads 2"]))
    assert cmp.levels == [1, 8, 32] and cmp.endpoint == "chat" and cmp.ignore_eos
    assert str(cmp.input_len) == "128:128" and str(cmp.output_len) == "128:128"
    assert cmp.variant == [("t2", ["--torch-threads", "2"])]
    assert versus.ctx_per_slot(cmp) == 512  # 128 words * 1.5 + 64 + 128, rounded up to 256
    assert versus.prompts_for(cmp, 1) == 8 and versus.prompts_for(cmp, 32) == 96
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--variant", "ours=--torch-threads 2"])


def test_medians_and_ratios() -> None:
    def run(system: str, r: int, tok_s: float, itl: float) -> dict:
        return {"system": system, "round": r, "concurrency": 8, "output_tok_s": tok_s,
                "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0, "itl_p50_ms": itl, "itl_p99_ms": 2 * itl,
                "tpot_p50_ms": itl, "e2e_p50_ms": 1.0, "server_cores": 1.0,
                "server_cores_leader": 0.2, "server_cores_children": 0.8, "errors": 0,
                "output_tok_s_per_core": tok_s,
                "output_tokens": 1024, "expected_output_tokens": 1024}

    runs = [run("ours", 0, 90, 10), run("ours", 1, 110, 12), run("ours", 2, 100, 11),
            run("llama-server", 0, 50, 22), run("llama-server", 1, 40, 20),
            run("llama-server", 2, 60, 24)]
    med = versus.medians(runs, ["ours", "llama-server"], [8])
    assert med["ours"]["8"]["output_tok_s"] == 100 and med["llama-server"]["8"]["itl_p50_ms"] == 22
    r = versus.ratios(med, "ours", "llama-server")["8"]
    assert r["output_tok_s"] == pytest.approx(2.0)  # ours / theirs
    assert r["itl_p50_ms"] == pytest.approx(2.0)  # theirs / ours: > 1, ours faster
    assert r["output_tok_s_per_core"] == pytest.approx(2.0)


def test_startup_summary() -> None:
    runs = [{"system": "serve", "first_answer_s": f, "healthy_s": h}
            for f, h in ((1.0, 10.0), (2.0, 12.0), (1.5, 11.0))]
    runs += [{"system": "llama-server", "first_answer_s": 0.5, "healthy_s": h}
             for h in (0.5, 0.6, 0.55)]
    med, rat = startup.summarize(runs, ["serve", "llama-server"])
    assert med["serve"]["healthy_s"] == 11.0 and rat["reference"] == "llama-server"
    assert rat["ratios"]["serve"]["healthy_s"] == pytest.approx(20.0)
    with pytest.raises(argparse.ArgumentTypeError):
        startup.systems_spec("serve,vllm")


# -- smoke runs --------------------------------------------------------------------------------


def test_startup_smoke(tmp_path: Path) -> None:
    """``startup`` on the fake model, one round of the bare hypercorn command (the model given
    through ``TRIO_INFER_MODEL``; ``serve`` is started by the variant smoke test below)."""
    out = tmp_path / "startup.json"
    text = bench("startup", "--model", "fake", "--systems", "hypercorn", "--rounds", "1",
                 "--output-json", str(out))
    assert "healthy s" in text
    data = json.loads(out.read_text())
    assert [r["system"] for r in data["runs"]] == ["hypercorn"]
    for r in data["runs"]:
        assert 0 < r["first_answer_s"] <= r["healthy_s"]
    assert data["config"]["systems"]["hypercorn"].startswith(
        "TRIO_INFER_MODEL=fake python -m hypercorn trio_infer.app:app --worker-class trio")


def test_variant_smoke(tmp_path: Path) -> None:
    """The comparison machinery without llama-server: ours and a variant on the fake model, two
    levels, one round; every request makes exactly the tokens asked for."""
    out = tmp_path / "versus.json"
    text = bench("serve", "--model-file", "fake", "--variant", "si2=--stream-interval 2",
                 "--concurrency", "1,2", "--rounds", "1", "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "6", "--output-json", str(out))
    assert "si2 vs ours" in text
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 4
    for r in data["runs"]:
        assert r["errors"] == 0 and r["output_tokens"] == r["expected_output_tokens"] == 12
    assert set(data["ratios"]["si2 vs ours"]) == {"1", "2"}


@pytest.mark.skipif(llamaserver.find_binary() is None,
                    reason="llama-server is not built (python -m trio_infer.bench llama-server "
                    "--build, about 10 minutes on 2 cores; never built by the tests)")
@pytest.mark.skipif(not SMOLLM2.is_file(), reason="the default model is not fetched (make venv)")
def test_llama_server_baseline_smoke(tmp_path: Path) -> None:
    """Ours and llama-server on the default model, the same requests (ignore_eos honoured by
    both), one round, one level; then llama-server's startup alone."""
    out = tmp_path / "versus.json"
    text = bench("serve", "--baseline", "llama-server", "--concurrency", "2", "--rounds", "1",
                 "--num-prompts", "2", "--input-len", "16", "--output-len", "8",
                 "--output-json", str(out), timeout=300)
    assert "ours vs llama-server" in text
    data = json.loads(out.read_text())
    assert {r["system"] for r in data["runs"]} == {"ours", "llama-server"}
    for r in data["runs"]:
        assert r["errors"] == 0 and r["output_tokens"] == 16, r
    assert "-np 2" in next(r["command"] for r in data["runs"] if r["system"] == "llama-server")
    text = bench("startup", "--systems", "llama-server", "--rounds", "1", timeout=120)
    assert "llama-server" in text
