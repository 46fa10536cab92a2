"""Server-sent events exactly as the OpenAI API sends them: ``data: {json}\\n\\n`` ... ``data: [DONE]``.

Several events may be joined into one string: the server writes each engine step's output for a
request with a single send (an ASGI send through hypercorn costs far more of the front end's CPU
than joining strings: docs/benchmarks.md, ``frontend``).
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any, Iterable

from trio_infer.api.errors import APIError

DONE = "data: [DONE]\n\n"
HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies: do not buffer the stream
}


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))

# A str as a JSON string literal: exactly what ``dumps`` writes for it (the C encoder that
# ``json.dumps(..., ensure_ascii=False)`` uses), without building an encoder per call.
encode_str = encode_basestring


def dumps(obj: Any) -> str:
    """Compact JSON, non-ASCII characters as themselves (as the OpenAI API writes them)."""
    return _ENCODER.encode(obj)


def event(obj: Any) -> str:
    return "data: " + _ENCODER.encode(obj) + "\n\n"


def events(objs: Iterable[Any]) -> str:
    return "".join(event(o) for o in objs)


def error_event(err: APIError) -> str:
    """An error after the stream started (the status line is gone): an event, then ``[DONE]``."""
    return event(err.body()) + DONE
