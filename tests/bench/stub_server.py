"""A minimal stand-in for a compared server in the ``frontend --compare`` smoke test.

Standard library only, like the anchor it stands in for: ``GET /health``, ``GET /v1/models`` (one
model, "stub") and a streaming ``POST /v1/chat/completions`` that sends, as FastAPI servers over a
batch engine do, a role-only first chunk, then one chunk per token ("tok ") every
``NULL_ENGINE_STEP_MS`` milliseconds, a text-less final chunk with ``finish_reason`` and
``data: [DONE]``, and **no usage chunk**, so the load generator has to count the text-carrying
events. With ``--spawn-child`` it also keeps an idle child process, to check that the bench
finds a server's whole process tree (and stops it with the server).

    python stub_server.py --port 8123 [--spawn-child [--child-pid-file PATH]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STEP_S = float(os.environ.get("NULL_ENGINE_STEP_MS", "0")) / 1000.0


def _chunk(delta: dict, finish: str | None) -> bytes:
    obj = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, obj: object, status: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json({"status": "ok"})
        elif self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": "stub", "object": "model"}]})
        else:
            self._json({"detail": "Not Found"}, 404)

    def do_POST(self) -> None:
        if self.path != "/v1/chat/completions":
            self._json({"detail": "Not Found"}, 404)
            return
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        n = int(req.get("max_tokens") or 16)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(_chunk({"role": "assistant", "content": ""}, None))
        for _ in range(n):
            time.sleep(STEP_S)
            self.wfile.write(_chunk({"content": "tok "}, None))
            self.wfile.flush()
        self.wfile.write(_chunk({}, "length"))
        self.wfile.write(b"data: [DONE]\n\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--spawn-child", action="store_true")
    ap.add_argument("--child-pid-file", default=None, help="write the child's pid here")
    args = ap.parse_args()
    if args.spawn_child:
        # An idle child for as long as the server lives; it dies with the process group.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        if args.child_pid_file:
            with open(args.child_pid_file, "w") as f:
                f.write(str(child.pid))
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
