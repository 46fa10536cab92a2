"""Neither process of a server on the default model imports torch: after startup and a streamed
chat request the front end holds neither torch nor transformers in its ``sys.modules``, and the
batching worker, which serves the GGUF file on the CPU kernels' numpy model
(``models/cpu_llama.py``), has not loaded torch's library.

The process boundary is a module boundary (``trio_infer/wire.py``): what crosses it is plain
msgspec structs, and the tokenizer is the thin one (``runtime/thin_tokenizer.py``: the
``tokenizers`` library and jinja2), loaded from the GGUF tokenizer cache. The
front end's RSS is reported (not asserted: it depends on the allocator and the machine);
docs/architecture.md gives the measured figure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from trio_infer.models.default_model import default_cache_dir, default_model_file

SMOLLM2 = default_model_file(default_cache_dir())

# Runs ``python -m trio_infer serve ...`` and, at exit, writes what the process imported and its
# memory to the file named by argv[1].
_WRAPPER = """
import atexit, json, re, runpy, sys
out = sys.argv[1]
def report():
    status = open("/proc/self/status").read()
    with open(out, "w") as f:
        json.dump({"modules": sorted(sys.modules),
                   "peak_rss_kb": int(re.search(r"VmHWM:\\s+(\\d+)", status).group(1)),
                   "rss_kb": int(re.search(r"VmRSS:\\s+(\\d+)", status).group(1))}, f)
atexit.register(report)
sys.argv = ["trio_infer"] + sys.argv[2:]
runpy.run_module("trio_infer", run_name="__main__")
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    """The process's direct children (Linux: /proc/<pid>/task/*/children)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


@pytest.mark.skipif(not SMOLLM2.exists(), reason=f"{SMOLLM2} is absent (`make venv` fetches it)")
def test_neither_process_imports_torch_and_the_front_end_no_transformers_models(tmp_path: Path) -> None:
    from trio_infer.runtime.tokenizer import load_gguf_tokenizer_cached

    # The first start of a machine converts the GGUF tokenizer once (that imports torch and
    # transformers); the claim is about every start after it.
    load_gguf_tokenizer_cached(SMOLLM2, default_cache_dir())
    report = tmp_path / "front-end.json"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRAPPER, str(report), "serve", "--port", str(port),
         "--torch-threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 300  # a real process on the other side: real time
        while proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 2,
        }) as response:
            assert response.status_code == 200
            body = "".join(response.iter_text())
        assert body.rstrip().endswith("data: [DONE]") and '"logprobs"' in body
        serving_rss_kb = _rss_kb(proc.pid)
        # The batching worker: torch's import maps libtorch_cpu.so, the first thing it loads.
        workers = _children(proc.pid)
        assert len(workers) == 1, f"expected one worker process, found {workers}"
        worker_maps = Path(f"/proc/{workers[0]}/maps").read_text()
        worker_peak_kb = _rss_kb(workers[0], "VmHWM")
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output[-3000:]
    got = json.loads(report.read_text())
    modules = set(got["modules"])
    assert "trio_infer.wire" in modules and "trio_infer.runtime.client" in modules
    assert "torch" not in modules, "the front end imported torch"
    # The engine's configuration (a plain dataclass: settings.py derives it) is the one engine
    # module a front end may hold.
    light = {"trio_infer.engine", "trio_infer.engine.config"}
    heavy = sorted(m for m in modules - light
                   if m.startswith(("transformers.models.", "transformers.modeling",
                                    "trio_infer.engine", "trio_infer.models.loader")))
    assert not heavy, f"the front end imported model code: {heavy[:10]}"
    transformers = sorted(m for m in modules if m == "transformers" or m.startswith("transformers."))
    assert not transformers, f"the front end imported transformers: {transformers[:10]}"
    assert "libtorch" not in worker_maps, "the batching worker imported torch"
    print(f"front end RSS: {serving_rss_kb / 1024:.0f} MB while serving, "
          f"{got['rss_kb'] / 1024:.0f} MB at exit, peak {got['peak_rss_kb'] / 1024:.0f} MB; "
          f"worker peak {worker_peak_kb / 1024:.0f} MB")
