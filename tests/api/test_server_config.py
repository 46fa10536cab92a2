"""The HTTP server as shipped: ``serve`` configures hypercorn through its public ``Config`` only,
and the app changes no attribute of hypercorn, h11, trio, quart, quart-trio or werkzeug, at
import or at startup, nor does any project module assign to another package's."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from hypercorn.config import Config

from trio_infer import server
from trio_infer.settings import Settings, Wiring

ROOT = Path(__file__).resolve().parents[2]
# Imported objects that exist to be assigned to: quart's per-request ``g``; and the
# interpreter's documented hook for a program's uncaught exceptions (app.py: a failed load under
# bare hypercorn is not printed again as a traceback).
MEANT_FOR_ASSIGNMENT = {"g"}
HOOKS_MEANT_FOR_ASSIGNMENT = {"sys.excepthook"}


def test_the_config_comes_from_the_settings_and_the_wiring() -> None:
    settings = Settings(host="0.0.0.0", port=8123, keep_alive_timeout_s=3.5, max_header_bytes=4096)
    config = server.hypercorn_config(settings)
    assert type(config) is Config and config.bind == ["0.0.0.0:8123"]
    assert config.keep_alive_timeout == 3.5 and config.backlog == server.BACKLOG == 2048
    assert config.h11_max_incomplete_size == config.h2_max_header_list_size == 4096
    assert config.graceful_timeout == server.GRACEFUL_TIMEOUT_S and config.accesslog is None
    # a front end of --api-workers serves on the socket its supervisor bound
    assert server.hypercorn_config(settings, Wiring(listen_fd=9)).bind == ["fd://9"]


def test_the_bare_hypercorn_command_runs_hypercorn_as_shipped(tmp_path: Path) -> None:
    """``tests/api/as_shipped.py`` in a fresh interpreter: every attribute of the servers'
    packages snapshotted before ``trio_infer`` is imported, the app served as the bare command
    serves it (a stream and a quart route answered), then compared: nothing changed, added or
    removed."""
    env = {**os.environ, "TRIO_INFER_MODEL": "fake", "TRIO_INFER_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "api" / "as_shipped.py")],
                          capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["answers"] == [200, 200]
    assert result["changed"] == [] and result["removed"] == [] and result["added"] == []


def _assignments_to_other_packages(path: Path) -> list[str]:
    """``name.attr = ...``, ``name.attr += ...``, ``del name.attr`` and ``setattr(name, ...)``
    in ``path`` where ``name`` is bound by an import of a module outside the project."""
    tree = ast.parse(path.read_text(), str(path))
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("trio_infer"):
                    foreign.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                not node.module.startswith("trio_infer"):
            foreign.update(alias.asname or alias.name for alias in node.names)

    def root(target: ast.AST) -> str | None:
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            target = target.value
        return target.id if isinstance(target, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("setattr", "delattr") and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            name = root(target)
            if isinstance(target, ast.Attribute) and name in foreign - MEANT_FOR_ASSIGNMENT \
                    and ast.unparse(target) not in HOOKS_MEANT_FOR_ASSIGNMENT:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_no_project_module_assigns_to_another_packages_attributes() -> None:
    files = sorted((ROOT / "trio_infer").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    assert files
    found = [hit for path in files for hit in _assignments_to_other_packages(path)]
    assert found == []
