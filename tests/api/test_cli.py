"""``python -m trio_infer generate`` and ``serve`` (graceful SIGTERM/SIGINT), as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from trio_infer.__main__ import _settings, build_parser
from trio_infer.models.fake import expected_next_token
from trio_infer.models.synthetic import IM_END
from trio_infer.settings import Settings

from .test_server import free_port


def test_every_setting_is_a_flag() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "fake", "--max-running", "4", "--stall-timeout-s", "2.5", "--port", "9"]
    )
    s = _settings(args, list(Settings.model_fields))
    assert (s.model, s.max_running, s.stall_timeout_s, s.port) == ("fake", 4, 2.5, 9)
    flags = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in flags
    with pytest.raises(SystemExit):
        _settings(build_parser().parse_args(["serve", "--max-running", "zero"]), ["max_running"])


def test_generate_prints_the_completion_as_json(tmp_path: Path, tokenizer: Any) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "trio_infer", "generate", "--model", "fake", "--prompt", "hello world",
         "--max-tokens", "6", "--temperature", "0", "--json", "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    seq = tokenizer.encode("hello world")
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    want = []
    for _ in range(6):
        want.append(expected_next_token(seq + want, len(tokenizer), eos))
    assert result == {"text": tokenizer.decode(want), "token_ids": want, "finish_reason": "length"}


def _wait_health(url: str, proc: subprocess.Popen, want: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == want:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"/health never answered {want}"
        time.sleep(0.05)


def test_serve_shuts_down_gracefully_on_signals(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """First signal (SIGTERM): /health and new requests 503, running streams continue (grace
    period). Second signal (SIGINT, as a second Ctrl-C would be): the running stream ends with an
    error event and [DONE], a complete body; the process exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_infer", "serve", "--model", str(tiny_checkpoint), "--port", str(port),
         "--torch-threads", "1", "--shutdown-grace-s", "600", "--cache-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        _wait_health(url, proc, 200)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as http, httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line)
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            _wait_health(url, proc, 503, timeout=30)
            refused = http.post("/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503
            assert next(lines).startswith("data: ")  # the running stream goes on in the grace period
            proc.send_signal(signal.SIGINT)  # impatient: end it now
            rest = list(lines)  # a clean end of body, not a broken chunked read
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][len("data: "):])["error"]
        assert err["message"] == "the server is shutting down" and err["type"] == "server_error"
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
