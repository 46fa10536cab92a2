"""Serve the app as the bare ``hypercorn trio_infer.app:app --worker-class trio`` command does,
and print (one JSON line) every attribute of hypercorn, h11, trio, quart, quart-trio and
werkzeug that differs after the app started, served requests and shut down.

A script, run in a fresh interpreter by ``test_server_config.py``: the snapshot must be taken
before anything of ``trio_infer`` is imported, which a test process has long done.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import socket
import sys
import types

PACKAGES = ("hypercorn", "h11", "trio", "quart", "quart_trio", "werkzeug")
# Submodules for another event loop or platform, and test helpers: never loaded by the command.
SKIP = ("hypercorn.asyncio", "hypercorn.__main__", "trio._tests", "trio.testing._", "trio._windows",
        "trio._wait_for_object", "trio._core._windows", "trio._core._io_kqueue", "trio._core._tests",
        "trio._tools", "werkzeug.debug", "quart.testing", "quart_trio.testing", "trio._repl",
        "trio.__main__", "quart.__main__")


def load_everything() -> None:
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if not info.name.startswith(SKIP):
                try:
                    importlib.import_module(info.name)
                except ImportError:
                    pass  # an optional dependency of theirs that is not installed


def snapshot() -> dict[str, int]:
    """``module.name`` and ``module.Class.name`` -> id of the value, for every loaded module of
    :data:`PACKAGES` and every class defined in one."""
    seen: dict[str, int] = {}
    for modname, module in list(sys.modules.items()):
        if not modname.split(".")[0] in PACKAGES or not isinstance(module, types.ModuleType):
            continue
        for name, value in list(vars(module).items()):
            seen[f"{modname}.{name}"] = id(value)
            if isinstance(value, type) and getattr(value, "__module__", "") == modname:
                for attr, member in list(vars(value).items()):
                    seen[f"{modname}.{name}.{attr}"] = id(member)
    return seen


def main() -> None:
    load_everything()
    before = snapshot()
    keep = list(sys.modules.values())  # the modules stay alive, so their values' ids stay unique

    import httpx
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    app = importlib.import_module("trio_infer.app").app  # the command's "trio_infer.app:app"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = config.errorlog = None
    answers: list[int] = []

    async def run() -> None:
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve(  # type: ignore[misc]
                app, config, shutdown_trigger=shutdown.wait, task_status=task_status))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                with trio.fail_after(120):
                    while (await client.get("/health")).status_code != 200:
                        await trio.sleep(0.05)  # the model loads in the background
                r = await client.post("/v1/chat/completions", json={
                    "model": "fake", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "stream": True})
                answers.append(r.status_code)
                r = await client.get("/v1/models")  # a route quart serves
                answers.append(r.status_code)
            shutdown.set()

    trio.run(run)
    after = snapshot()
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    removed = sorted(before.keys() - after.keys())
    # A name added to a module or class that existed before (a new module's names are its own).
    added = sorted(k for k in after.keys() - before.keys() if k.rsplit(".", 1)[0] in before)
    print(json.dumps({"answers": answers, "changed": changed, "removed": removed,
                      "added": added, "modules": len(keep)}))


if __name__ == "__main__":
    main()
