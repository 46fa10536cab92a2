"""Structured output: ``response_format``, vLLM's ``guided_*`` / ``structured_outputs`` (a JSON
schema, a regular expression, a choice of strings, a Lark grammar) and the tool-call forms of
``api/tools.py``, as llguidance grammars, validated here, once, before anything runs. For a
reasoning model, :func:`after_thinking` lets the thinking through unconstrained.

What goes to the engine is the grammar's *source* (llguidance's JSON text, in
``SamplingParams.grammar``): the worker compiles it against its tokenizer, with a cache keyed by
the source (``engine/grammar.py``). The front end validates the same source without a tokenizer,
so a schema that cannot be compiled, or uses a feature llguidance does not implement, is a 400
naming the field before the response starts, and the worker never sees it.

JSON is generated compact (no free whitespace between tokens): a weak or random model can then
not pad a document with whitespace forever, and every document the grammar accepts is short.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from trio_infer.api.errors import APIError
from trio_infer.api.protocol import ResponseFormat

# JSON options of every schema we compile: compact JSON (see above); a schema's own
# "x-guidance" options, if any, come after these.
JSON_OPTIONS = {"whitespace_flexible": False}


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA = ("items", "not", "if", "then", "else", "contains", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema(schema: Any, top: bool = True) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing of
    ``additionalProperties`` closed to them (``additionalProperties: false``), at every depth.

    JSON Schema allows unnamed properties by default; a tool's arguments and a strict
    ``response_format`` do not (OpenAI's strict mode, xgrammar's in vLLM and SGLang): a model
    that may write keys the schema never named writes them, and a forced call then never ends
    as a call. An object that lists no ``properties`` (``{"type": "object"}``: any object) stays
    open, and so do the members of an ``allOf``, whose properties are named across several of
    them (each is closed inside, not at its top)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if top and isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_schema(sub, top=False) for sub in out["allOf"]]
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_schema(out["additionalProperties"])
    return out


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


def check_grammar(source: str, param: str, code: str = "invalid_json_schema") -> None:
    error = llguidance.LLMatcher.validate_grammar(source)
    if error:
        what = "grammar" if code == "invalid_grammar" else "schema"
        raise APIError(
            400,
            f"The {what} cannot be used for constrained decoding: {error.strip()}",
            param=param,
            code=code,
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
    # OpenAI: no schema means any JSON value is accepted. Strict: only the properties named.
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
    if fmt.json_schema.strict:
        schema = closed_schema(schema)
    return json_schema_grammar(schema, "response_format.json_schema.schema")


def _choice_lark(choices: list[str]) -> str:
    """A Lark grammar whose sentences are exactly ``choices`` (JSON string literals are Lark's)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _one(source: str, param: str) -> str:
    check_grammar(source, param, code="invalid_grammar")
    return source


def extension_grammar(req: Any) -> str | None:
    """The grammar of vLLM's structured-output fields of a request, or None when it sends none:
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (a Lark grammar,
    as llguidance reads it) or ``structured_outputs`` with one of ``json``, ``regex``,
    ``choice``, ``grammar``, ``json_object``. At most one may be set."""
    asked: list[tuple[str, Any]] = [
        (name, getattr(req, name)) for name in ("guided_json", "guided_regex", "guided_choice",
                                                 "guided_grammar") if getattr(req, name, None) is not None
    ]
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        asked += [(f"structured_outputs.{name}", value) for name, value in (
            ("json", so.json_), ("regex", so.regex), ("choice", so.choice),
            ("grammar", so.grammar), ("json_object", so.json_object or None),
        ) if value is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"Send one structured-output constraint, not {len(asked)} "
                       f"({', '.join(name for name, _ in asked)}).", param=asked[1][0])
    param, value = asked[0]
    kind = param.rsplit(".", 1)[-1].removeprefix("guided_")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise APIError(400, f"The JSON schema is not valid JSON: {exc}", param=param,
                               code="invalid_json_schema") from None
        return json_schema_grammar(value, param)
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, param)
    if kind == "regex":
        return _one(llguidance.LLMatcher.grammar_from_regex(value), param)
    if kind == "choice":
        if any(c == "" for c in value):
            raise APIError(400, "A choice must not be empty.", param=param)
        return _one(lark_source(_choice_lark(value)), param)
    return _one(lark_source(value), param)


def after_thinking(source: str, thinking: bool, open_tag: str = "<think>", close_tag: str = "</think>") -> str:
    """``source`` constraining a reasoning model's answer only, after its thinking: the output
    may first think freely (``<think>`` any text ``</think>``, then the template's blank line),
    or, when the prompt left the model ``thinking``, starts inside the thinking and must close
    it. The tags are named as the tokens they are (llguidance's ``<name>`` syntax for special
    tokens); the answer is the grammar ``source`` unchanged, as a sub-grammar."""
    if source.lstrip().startswith("{"):
        whole = json.loads(source)
    else:  # a Lark grammar's text
        whole = {"grammars": [{"lark_grammar": source}]}
    grammars = whole["grammars"]
    answer = grammars[0].get("name") or "answer"
    grammars[0]["name"] = answer
    think = f'/(.|\\n)*/ {close_tag} "\\n\\n"?'
    lark = f"start: {think} @{answer}" if thinking else f"start: ({open_tag} {think})? @{answer}"
    whole["grammars"] = [{"name": "after_thinking", "lark_grammar": lark}, *grammars]
    return json.dumps(whole, ensure_ascii=False, separators=(",", ":"))
