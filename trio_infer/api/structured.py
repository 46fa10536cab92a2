"""Structured output: ``response_format`` (and the tool-call forms of ``api/tools.py``) as
llguidance grammars, validated here, once, before anything runs.

What goes to the engine is the grammar's *source* (llguidance's JSON text, in
``SamplingParams.grammar``): the worker compiles it against its tokenizer, with a cache keyed by
the source (``engine/grammar.py``). The front end validates the same source without a tokenizer,
so a schema that cannot be compiled, or uses a feature llguidance does not implement, is a 400
naming the field before the response starts, and the worker never sees it.

JSON is generated compact (no free whitespace between tokens): a weak or random model can then
not pad a document with whitespace forever, and every document the grammar accepts is short.
"""

from __future__ import annotations

from typing import Any

import llguidance

from trio_infer.api.errors import APIError
from trio_infer.api.protocol import ResponseFormat

# JSON options of every schema we compile: compact JSON (see above); a schema's own
# "x-guidance" options, if any, come after these.
JSON_OPTIONS = {"whitespace_flexible": False}


def json_schema_grammar(schema: Any, param: str) -> str:
    """The grammar source for documents valid against ``schema``; a 400 naming ``param`` if it
    is not a schema llguidance can compile."""
    if not isinstance(schema, dict):
        raise APIError(400, "The JSON schema must be an object.", param=param, code="invalid_json_schema")
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise APIError(400, f"Invalid JSON schema: {exc}", param=param, code="invalid_json_schema") from None
    check_grammar(source, param)
    return source


def lark_source(lark: str) -> str:
    """The grammar source of a Lark grammar (which may embed JSON schemas with ``%json``), not
    validated: see :func:`check_grammar`."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check_grammar(source: str, param: str) -> None:
    error = llguidance.LLMatcher.validate_grammar(source)
    if error:
        raise APIError(
            400,
            f"The schema cannot be used for constrained decoding: {error.strip()}",
            param=param,
            code="invalid_json_schema",
        )


def response_format_grammar(fmt: ResponseFormat | None) -> str | None:
    """``response_format`` -> the grammar source, or None for plain text."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise APIError(400, "'json_schema' is only allowed with type 'json_schema'.",
                           param="response_format.json_schema")
        return None
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise APIError(400, "'json_schema' is only allowed with type 'json_schema'.",
                           param="response_format.json_schema")
        return json_schema_grammar({"type": "object"}, "response_format")
    if fmt.json_schema is None:
        raise APIError(400, "Missing required parameter: 'response_format.json_schema'.",
                       param="response_format.json_schema")
    # OpenAI: no schema means any JSON value is accepted.
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
    return json_schema_grammar(schema, "response_format.json_schema.schema")
