"""Fixtures of the chat page's browser tests: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``make test`` installs with apt-get when it can) driven by selenium, and
real servers started as subprocesses (``python -m trio_infer serve``).

Without a browser the tests skip and say so; everything else about them must work."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.runtime.test_worker_process import children, free_port, health, wait_for

NO_BROWSER = (
    "no headless Chromium here: install Debian's chromium and chromium-driver "
    "(`make test` does it with apt-get when it runs as root) to run the chat page's browser tests"
)


def chromium_paths() -> tuple[str, str] | None:
    """(browser binary, chromedriver) or None."""
    binary = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
    )
    driver = shutil.which("chromedriver") or (
        "/usr/lib/chromium/chromedriver" if os.path.exists("/usr/lib/chromium/chromedriver") else None
    )
    return (binary, driver) if binary and driver else None


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    paths = chromium_paths()
    if paths is None:
        pytest.skip(NO_BROWSER)
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (it is in the test extra: make venv)"
    )
    binary, driver_path = paths
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--force-device-scale-factor=1",
                "--disable-extensions", "--no-first-run", "--disable-background-networking"):
        options.add_argument(arg)
    service = webdriver.ChromeService(executable_path=driver_path)
    try:
        driver = webdriver.Chrome(options=options, service=service)
    except Exception as exc:  # noqa: BLE001 - a browser that cannot start here is a skip, with why
        pytest.skip(f"{NO_BROWSER} (starting {binary} failed: {str(exc).splitlines()[0]})")
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    key: str | None
    model: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=10)

    def post(self, path: str, body: dict) -> httpx.Response:  # type: ignore[type-arg]
        return httpx.post(self.url + path, json=body, headers=self.headers(), timeout=60)


def start_server(cache_dir: Path, *args: str, key: str | None = None) -> Server:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "trio_infer", "serve", "--port", str(port), "--cache-dir",
           str(cache_dir), "--log-level", "warning", *args]
    if key:
        cmd += ["--api-key", key]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"},
    )
    try:
        wait_for(lambda: health(url) == 200 or proc.poll() is not None, 180, "the server")
    except BaseException:
        proc.kill()
        raise
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    server = Server(proc, url, key, "")
    server.model = server.get("/v1/models").json()["data"][0]["id"]
    return server


def stop_server(server: Server) -> None:
    """SIGKILL the server and its batching worker (at once, even one still starting after a
    restart: a graceful stop would wait for it)."""
    workers = children(server.proc.pid)
    server.proc.kill()
    server.proc.communicate()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


KEY = "browser-test-key"
# Served as the model id: markup in a string the server hands the page (GET /v1/models, then the
# reply's label) must show as text.
MARKUP_MODEL = 'fake<script>window.injected = 1</script><img src=x onerror="window.injected = 2">'


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The fake model at 20 ms a step (about 50 tokens/s: streaming is visible), with an API key
    and a served model name full of markup."""
    server = start_server(
        tmp_path_factory.mktemp("fake-cache"),
        "--model", "fake", "--fake-step-ms", "20", "--served-model-name", MARKUP_MODEL,
        "--worker-restart-delay-s", "0.1", "--shutdown-grace-s", "0",
        key=KEY,
    )
    try:
        yield server
    finally:
        stop_server(server)
