"""The model loads in the background: the server listens at once, answers 503 (``loading``) while
the batching worker loads, then serves; a shutdown mid-load reaps the worker, and a load that
fails stops the server with its reason in the log.

Real server processes on the tiny checkpoint. The worker's test-only knob
``TRIO_INFER_TEST_LOAD_DELAY_S`` makes its load slow; the tests poll ``/health`` against
deadlines (there is no event to wait on across processes).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from trio_infer.runtime.loading import build_engine
from trio_infer.runtime.worker import TEST_LOAD_DELAY_ENV
from trio_infer.settings import Settings

from tests.api.test_server import server_cache

from .test_worker_process import alive, children, free_port, wait_for

API_ROUTES = [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/completions", {"prompt": "hi"}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/v1/models", None),
]
LOAD_PHASES = {"tokenizer", "worker", "weights", "engine"}


def test_the_load_reports_the_tensors_it_reads(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """What the worker sends the front end while it loads: ``weights`` with the loaders' own
    count of tensors read, then ``engine``; the loaders' progress bar is theirs again after."""
    from trio_infer.models import loader

    reports: list[tuple[str, int | None, int | None]] = []
    bar = loader.tqdm
    build_engine(Settings(model=str(tiny_checkpoint), cache_dir=tmp_path, torch_threads=1),
                 lambda *report: reports.append(report))
    assert loader.tqdm is bar
    weights = [r for r in reports if r[0] == "weights"]
    total = weights[0][2]
    assert total and weights[0][1] == 0 and weights[-1][1] == total
    assert [r[1] for r in weights] == list(range(total + 1)) and {r[2] for r in weights} == {total}
    assert reports[len(weights):] == [("engine", None, None)]


def status_code(url: str) -> int:
    """/health's status, or 0 while nothing listens."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


def start(command: str, model: Path | str, tmp_path: Path, delay_s: float = 0,
          workers: str | None = None, cache: Path | None = None) -> tuple[subprocess.Popen, str, Path]:
    """``serve`` or bare ``hypercorn`` on ``model``, its output in a log file. Under hypercorn,
    a config file sets ``startup_timeout`` to 1 s: a lifespan startup that waited for the load
    (``delay_s`` longer) would fail. ``cache``: its cache folder (default: a fresh one, whose
    C kernels are compiled at load)."""
    port = free_port()
    log = tmp_path / f"{command}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRIO_INFER_MODEL": str(model),
           "TRIO_INFER_CACHE_DIR": str(cache or tmp_path / "cache"), "TRIO_INFER_TORCH_THREADS": "1"}
    if delay_s:
        env[TEST_LOAD_DELAY_ENV] = str(delay_s)
    if command == "serve":
        args = [sys.executable, "-m", "trio_infer", "serve", "--port", str(port)]
    else:
        config = tmp_path / "hypercorn.toml"
        config.write_text("startup_timeout = 1\n")
        args = [sys.executable, "-m", "hypercorn", "trio_infer.app:app", "--worker-class", "trio",
                "--bind", f"127.0.0.1:{port}", "--config", str(config)]
        if workers is not None:
            args += ["--workers", workers]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    """Servers a test started: killed at the end if still running."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assert_loading_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) > 0
    error = r.json()["error"]
    assert error["type"] == "server_error"


@pytest.mark.parametrize("command", ["serve", "hypercorn"])
def test_listens_at_once_answers_503_while_loading_then_serves(
    command: str, tiny_checkpoint: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
    processes: list[subprocess.Popen],
) -> None:
    # The session's shared cache: the load's delay is the knob's, not a compile of the kernels.
    proc, url, log = start(command, tiny_checkpoint, tmp_path, delay_s=6,
                           cache=server_cache(tmp_path_factory))
    processes.append(proc)
    wait_for(lambda: status_code(url) != 0 or proc.poll() is not None, 60, "the server to listen")
    assert proc.poll() is None, log.read_text()[-3000:]

    health = httpx.get(url + "/health")
    assert_loading_503(health)
    assert health.json()["error"]["message"] == "loading"
    status = httpx.get(url + "/v1/status")
    assert status.status_code == 200
    body = status.json()
    assert body["healthy"] is False and body["problem"] == "loading" and body["model"] is None
    assert body["loading"]["phase"] in LOAD_PHASES, body
    for method, path, payload in API_ROUTES:
        r = httpx.request(method, url + path, json=payload)
        assert_loading_503(r)
        assert "loading" in r.json()["error"]["message"], (path, r.text)
    assert status_code(url) == 503, "the load ended during the checks: make the delay longer"

    wait_for(lambda: status_code(url) == 200 or proc.poll() is not None, 120, "the model to load")
    assert proc.poll() is None, log.read_text()[-3000:]
    body = httpx.get(url + "/v1/status").json()
    assert body["healthy"] is True and body["problem"] is None and body["loading"] is None
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    text = log.read_text()
    assert "Traceback" not in text and "LifespanTimeoutError" not in text, text[-3000:]


def loading_worker(url: str, proc: subprocess.Popen, log: Path) -> int:
    """Once the server answers 503 ``loading`` and its batching worker is in its (delayed) load,
    past its imports: the worker's pid."""
    wait_for(lambda: status_code(url) == 503, 60, "/health to say loading")
    wait_for(lambda: TEST_LOAD_DELAY_ENV in log.read_text(), 60, "the worker to start its load")
    [worker] = children(proc.pid)
    assert httpx.get(url + "/v1/status").json()["loading"]["phase"] == "worker"
    return worker


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_shutdown_mid_load_reaps_the_worker_at_once(
    signum: int, tiny_checkpoint: Path, tmp_path: Path, processes: list[subprocess.Popen]
) -> None:
    proc, url, log = start("serve", tiny_checkpoint, tmp_path, delay_s=600)
    processes.append(proc)
    worker = loading_worker(url, proc, log)
    t0 = time.monotonic()
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    took = time.monotonic() - t0
    assert not alive(worker), "the loading worker outlived its server"
    text = log.read_text()
    # It left on its own as its pipe closed, not killed after the 5 s the front end allows.
    assert "did not exit; killing it" not in text, text[-3000:]
    assert took < 5, (took, text[-3000:])
    assert "Traceback" not in text, text[-3000:]


def test_a_loading_worker_exits_when_its_front_end_is_killed(
    tiny_checkpoint: Path, tmp_path: Path, processes: list[subprocess.Popen]
) -> None:
    proc, url, log = start("serve", tiny_checkpoint, tmp_path, delay_s=600)
    processes.append(proc)
    worker = loading_worker(url, proc, log)
    proc.kill()  # no cleanup at all on the front end's side
    proc.wait()
    wait_for(lambda: not alive(worker), 10, "the orphaned loading worker to exit")


@pytest.fixture
def broken_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint with its weights cut short: the front end loads the tokenizer, the
    worker fails to load the model."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    [weights] = broken.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    return broken


@pytest.mark.parametrize("command, workers", [("serve", None), ("hypercorn", "0"), ("hypercorn", None)])
def test_a_failing_load_stops_the_server_with_its_reason(
    command: str, workers: str | None, broken_checkpoint: Path, tmp_path: Path,
    processes: list[subprocess.Popen],
) -> None:
    proc, url, log = start(command, broken_checkpoint, tmp_path, workers=workers)
    processes.append(proc)
    code = proc.wait(timeout=120)
    text = log.read_text()
    assert "the model could not be loaded: could not load the model:" in text, text[-3000:]
    if command == "hypercorn" and workers is None:
        # hypercorn 0.18's master loses the status of a worker process that failed
        # (hypercorn/run.py: the second _join_exited finds no process left and returns 0), so
        # the server stops but exits 0; `--workers 0` runs the app in the master itself.
        assert code == 0
    else:
        assert code == 1, text[-3000:]


@pytest.mark.parametrize("command, workers", [("serve", None), ("hypercorn", "0")])
def test_a_broken_gguf_file_is_one_line_naming_it(
    command: str, workers: str | None, tiny_checkpoint: Path, tmp_path: Path,
    processes: list[subprocess.Popen],
) -> None:
    """A truncated GGUF file: the server stops with one error line that names the file and the
    tensor, and no traceback (that is for --log-level debug)."""
    from tests.test_gguf import write_gguf

    good = write_gguf(tiny_checkpoint, tmp_path / "good.gguf", "Q8_0")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    proc, url, log = start(command, broken, tmp_path, workers=workers)
    processes.append(proc)
    assert proc.wait(timeout=120) == 1
    text = log.read_text()
    errors = [line for line in text.splitlines() if "could not" in line or " ERROR " in line]
    assert len(errors) == 1, text[-3000:]
    assert "the model could not be loaded" in errors[0] and str(broken) in errors[0]
    assert "truncated or corrupt" in errors[0] and "tensor '" in errors[0]
    assert "Traceback" not in text, text[-3000:]


def test_a_missing_model_stops_the_server_without_a_traceback(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "trio_infer", "serve", "--model", str(tmp_path / "missing"),
         "--port", str(free_port()), "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1
    assert f"the model could not be loaded: model '{tmp_path / 'missing'}'" in out.stderr
    assert "Traceback" not in out.stderr


# Run as ``python -c``: ``serve`` with spawn_worker replaced by a probe that records which of trio
# and the front end's web modules were imported when the worker was started, then stops the process.
_SPAWN_PROBE = """
import sys
from trio_infer import __main__ as cli
from trio_infer.runtime import spawn

def probe(settings, **kwargs):
    heavy = ("trio", "hypercorn", "quart", "quart_trio", "trio_infer.app")
    print(sorted(m for m in heavy if m in sys.modules))
    sys.stdout.flush()
    raise SystemExit(0)

spawn.spawn_worker = probe
cli.main(["serve", "--port", sys.argv[1]])
"""


def test_serve_starts_its_worker_before_it_imports_trio_and_the_web_stack(tmp_path: Path) -> None:
    """The worker's imports (torch: about a second) run on the other core while the front end
    imports trio, hypercorn, quart and the app: started after them, the server would be healthy
    that much later (docs/architecture.md, "Startup")."""
    out = subprocess.run([sys.executable, "-c", _SPAWN_PROBE, str(free_port())],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TRIO_INFER_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_a_port_in_use_stops_serve_in_one_line_and_reaps_its_worker(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    import re
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "trio_infer", "serve", "--model", str(tiny_checkpoint),
             "--port", str(port), "--cache-dir", str(tmp_path), "--torch-threads", "1"],
            capture_output=True, text=True, timeout=120,
        )
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"cannot listen on 127.0.0.1 port {port}: [Errno 98] Address already in use" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    [pid] = re.findall(r"batching worker started \(pid (\d+)\)", out.stderr)
    assert f"batching worker {pid} exited" in out.stderr and not alive(int(pid))


async def test_the_worker_reports_a_missing_model_in_the_words_of_the_tokenizers_load(
    tmp_path: Path,
) -> None:
    """Which of the two loads finds a missing model first is a race; the worker's report (when it
    is first, the only one) is the path's own one-line reason, word for word what the tokenizer's
    load raises, so the server says the same thing either way."""
    from trio_infer.app import _innermost
    from trio_infer.models.paths import resolve_model_path
    from trio_infer.runtime.client import open_engine

    settings = Settings(model=str(tmp_path / "missing"), cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError) as direct:
        resolve_model_path(settings.model, settings.cache_dir)
    with pytest.raises(BaseException) as reported:
        async with open_engine(settings):
            pass
    assert _innermost(reported.value) == str(direct.value)


def test_a_cause_reported_by_both_loads_is_said_once() -> None:
    """The tokenizer's load and the worker's fail together for one missing model (which one
    fails first is a race): the worker's message wraps the tokenizer's, and the reason logged
    is the cause, once. Different causes are both said."""
    from trio_infer.app import _innermost
    from trio_infer.runtime.worker_link import WorkerStartError

    cause = "model '/m' is neither a folder nor a hub id"
    both = ExceptionGroup("loads", [WorkerStartError(f"could not load the model: {cause}"),
                                    ExceptionGroup("inner", [ValueError(cause)])])
    assert _innermost(both) == cause
    assert _innermost(ExceptionGroup("one", [ValueError(cause)])) == cause
    two = ExceptionGroup("loads", [ValueError("a"), OSError("b")])
    assert _innermost(two) == "a; b"
