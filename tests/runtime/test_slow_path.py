"""No silent slow path: a server whose CPU kernels cannot be built still serves, says so once at
startup naming what is missing and what it costs, and /v1/status says which path serves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.runtime.test_worker_process import free_port, health, wait_for


def test_a_failed_kernel_build_is_logged_and_served_on_the_reference_path(
        tiny_checkpoint: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A compiler that always fails, and a cache with no library built by an earlier run.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CC": "/bin/false",
           "TRIO_INFER_CACHE_DIR": str(tmp_path)}
    env.pop("TRIO_INFER_KERNELS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_infer", "serve", "--model", str(tiny_checkpoint),
         "--port", str(port), "--cache-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        wait_for(lambda: health(url) == 200 or proc.poll() is not None, 180, "the server")
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        status = httpx.get(url + "/v1/status", timeout=5).json()
        assert status["compute"]["kernels"] == "torch-reference"
        assert "/bin/false failed" in status["compute"]["problem"]
        assert status["compute"]["kv_cache_dtype"] == "float16"
        reply = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": status["model"], "prompt": "hello", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
    slow = [line for line in log.splitlines() if "slow path:" in line]
    assert len(slow) == 1, log[-3000:]
    assert "/bin/false failed" in slow[0] and "dequantized to fp32" in slow[0]
