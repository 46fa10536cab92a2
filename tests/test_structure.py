"""The import structure: no circles, and layers that import downward only.

    api/  ->  runtime/ (the front end)  ->  wire.py  <-  the worker (engine/, models/, kernels/)

Every import counts, wherever it is written: at module level, in a function, under
``if TYPE_CHECKING``. A circle hidden in a function body is still a circle (the two modules
cannot be understood, or moved, apart), so none is allowed anywhere.

``runtime/`` holds both sides of the wire, by process rather than by folder: the modules below
run in the batching worker (the worker's main loop, model loading, tensor-parallel ranks, the
in-process worker of tests and embedding programs), the tokenizer's modules in both processes,
and the rest in the front end.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"trio_infer": ROOT / "trio_infer", "trio_infer_kernels": ROOT / "kernels"}

WORKER_SIDE_RUNTIME = {f"trio_infer.runtime.{m}" for m in
                       ("worker", "loading", "tp_group", "tp_rank", "in_process")}
# Both processes load the served model's tokenizer: the front end to encode and render, the
# worker for its grammars.
TOKENIZER = {f"trio_infer.runtime.{m}" for m in
             ("tokenizer", "tokenizer_cache", "thin_tokenizer", "chat_template")}
# Torch-free code that finds and reads a checkpoint's files, which the tokenizer needs too.
MODEL_FILES = {f"trio_infer.models.{m}" for m in ("paths", "default_model", "gguf_header", "embedded")}
# Where the tokenizer and the model files reach the worker's code, once per machine, in a
# function, then never again: the fake model's tokenizer is trained, and the tiny model built, by
# the code that builds synthetic checkpoints (models/synthetic.py), and a GGUF file's tokenizer is
# converted by the model loader's code (which imports torch) at its first start, then read from
# the cache (runtime/tokenizer_cache.py says why).
FIRST_USE = {
    ("trio_infer.runtime.tokenizer", "trio_infer.models.synthetic"),
    ("trio_infer.models.embedded", "trio_infer.models.synthetic"),
    ("trio_infer.runtime.tokenizer_cache", "trio_infer.models.gguf_loader"),
}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, from every import statement in its file."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                           for alias in node.names]
            for target in targets:
                found = resolve(target)
                if found is not None and found != mod:
                    graph[mod].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def side(mod: str) -> str:
    if mod.startswith("trio_infer.api"):
        return "api"
    if mod in TOKENIZER:
        return "tokenizer"
    if mod in MODEL_FILES:
        return "model files"
    if mod in WORKER_SIDE_RUNTIME or mod.startswith(
            ("trio_infer.engine", "trio_infer.models", "trio_infer_kernels")):
        return "worker"
    if mod.startswith("trio_infer.runtime"):
        return "front end"
    if mod == "trio_infer.wire":
        return "wire"
    return "other"  # settings, metrics, and the entry points (app, __main__, bench, supervisor)


# What each side may import, besides "other" modules (settings, metrics) and itself.
ALLOWED = {
    "wire": set(),
    "model files": {"model files"},
    "tokenizer": {"model files"},
    "front end": {"wire", "tokenizer", "model files"},
    "worker": {"wire", "tokenizer", "model files"},
    "api": {"front end", "wire", "tokenizer", "model files"},
}


def test_there_are_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the walk found the project
    assert circles(graph) == []


def test_layers_import_downward_only() -> None:
    graph = import_graph()
    wrong = []
    for mod, deps in sorted(graph.items()):
        here = side(mod)
        if here == "other":
            continue
        for dep in sorted(deps):
            there = side(dep)
            if there in (here, "other") and not (here == "wire" and there == "other"):
                continue
            if there in ALLOWED[here] or (mod, dep) in FIRST_USE:
                continue
            wrong.append(f"{mod} ({here}) imports {dep} ({there})")
    assert wrong == []


def test_the_wire_and_the_settings_import_nothing_above_them() -> None:
    graph = import_graph()
    assert graph["trio_infer.wire"] == set()
    assert {side(d) for d in graph["trio_infer.settings"]} <= {"worker"}  # the engine's defaults
    assert graph["trio_infer.settings"] <= {"trio_infer.engine.config"}


def test_the_checker_finds_a_circle_and_a_wrong_layer() -> None:
    """The checks above can fail: a circle through a function-level import is found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert side("trio_infer.runtime.session") == "front end"
    assert "worker" not in ALLOWED[side("trio_infer.runtime.client")]
