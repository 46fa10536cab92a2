"""A bound on how deeply a request body's JSON may nest, checked before it is parsed.

``json.loads`` recurses once per level of ``[``/``{`` (its C scanner calls
``Py_EnterRecursiveCall``), so a 2 KB body of ~1,000 nested brackets raised ``RecursionError``
inside it ("maximum recursion depth exceeded while decoding a JSON array from a unicode string")
and the request ended as a 500. Where exactly it failed depended on how deep the stack already
was. This module measures the depth without recursing (strings removed by a regular expression,
then a running sum over the brackets), so any body nested deeper than :data:`MAX_JSON_DEPTH` gets
the same 400 whatever the stack, and nothing downstream (pydantic, the error message's
``json.dumps``, comparisons in ``check_fields``) ever sees a deep value.
"""

from __future__ import annotations

import re
from itertools import accumulate

# The deepest request of the API nests 4 levels (messages -> a message -> content parts -> a part);
# 64 leaves room for any extra field a client sends and is far below the interpreter's limit.
MAX_JSON_DEPTH = 64

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DELTA = [0] * 256
_DELTA[ord("[")] = _DELTA[ord("{")] = 1
_DELTA[ord("]")] = _DELTA[ord("}")] = -1


def json_depth(text: str, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of the JSON document ``text`` (brackets inside strings do not count).

    Exact for valid JSON; for invalid JSON a number the parser will reject anyway. Returns 0 at
    once when the text holds no more than ``limit`` opening brackets in all (every usual request):
    it cannot nest deeper than that. Linear time, no recursion (4 MB of brackets: ~0.3 s).
    """
    if text.count("[") + text.count("{") <= limit:
        return 0
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_DELTA.__getitem__, brackets.encode("ascii"))), default=0)
