"""The client matrix's server: one real server process (hypercorn, the batching worker) on the tiny
random checkpoint for all of tests/clients, with a 1024-token context (long enough for the tool
prompts of the generic fallback, short enough that filling it takes a second), and helpers to run
a client's own command line in a subprocess, offline.

Each client is the real package from PyPI (the ``clients`` extra); a file whose package is not
installed skips, saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from api.test_server import Server, start_server

CONTEXT = 1024


@pytest.fixture(scope="package")
def checkpoint(tiny_checkpoint_factory) -> Path:  # type: ignore[no-untyped-def]
    """The tiny Qwen3 checkpoint with a short context; its folder holds the tokenizer the
    clients load for themselves (guidellm's synthetic prompts, lm-eval's loglikelihoods)."""
    return tiny_checkpoint_factory(max_position_embeddings=CONTEXT)


@pytest.fixture(scope="package")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from start_server(checkpoint, tmp_path_factory)


@pytest.fixture
def idle(server: Server) -> Iterator[Server]:
    """The server, checked to hold nothing once the test is done (lifecycle invariant 1)."""
    yield server
    server.wait_idle()


def offline_env(home: Path) -> dict[str, str]:
    """The environment of a client's command: no hub (there is no network, and nothing may be
    fetched from one: every file a client needs is local), its caches in ``home``."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(home / "hf"),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def run_client(args: list[str], cwd: Path, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python args...`` (this interpreter, so this venv's package) in ``cwd``, offline, with
    ``env`` added; fails the test with its output when it exits non-zero."""
    done = subprocess.run([sys.executable, *args], cwd=cwd, env={**offline_env(cwd), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"{args[:3]} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done
