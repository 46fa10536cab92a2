"""The lifecycle invariants, as an OpenAI client sees them through the HTTP layer.

Every request ends exactly once with one of: a complete answer (JSON, or a stream of chunks with
one ``finish_reason`` per choice and ``[DONE]``), an OpenAI error with a status the scenario
explains (400 context too long, 503 draining or queue full, 500 engine fault), or an error event
then ``[DONE]`` inside a stream. Text is exactly what the fake model writes, cut at the stop
strings. A client that disconnects has its request ended by the server (its ASGI call returns)
within :data:`~.http_runner.DISCONNECT_NOTICE_S`, and nothing of it is left in the front end by
then. Once every client is done, the front end is idle at once and the worker once it has applied
the last aborts. Each request's session (logged by the tap around ``generate``) passes the same
per-uid bound and stall checks as in the engine suite.
"""

from __future__ import annotations

import json
from typing import Any

from .char_tokenizer import CharTokenizer
from trio_infer.runtime.errors import RequestStalled

from .http_runner import DISCONNECT_NOTICE_S, HttpRecord, HttpReport
from .invariants import check_engine_ends, check_pages_idle, check_session
from .runner import SessionLog, runtime_errors
from .scenario import HTTP_MODEL, ExpectedText, expected_text


def check_http_all(report: HttpReport) -> None:
    assert report.idle_error is None, f"with every client done: {report.idle_error}"
    assert report.live_asgi_calls == 0, f"{report.live_asgi_calls} ASGI call(s) still running"
    assert report.tasks_after == report.tasks_before, "tasks still alive after the app stopped"
    registered = sum(log.n for log in report.tap.sessions.values())
    check_engine_ends(report.engine, report.metrics, registered)
    check_pages_idle(report.engine)
    sc = report.scenario
    for log in report.tap.sessions.values():
        assert log.owner is not None, f"session {log.request_id} opened outside any test request"
        check_session(log, sc.channel_capacity, sc.stall_timeout_s, report.engine,
                      who=f"HTTP request #{log.owner}'s session {log.request_id}")
    for index, rec in enumerate(report.records):
        check_http_client(report, index, rec)
        check_http_deadline(report, index, rec)


def check_http_deadline(report: HttpReport, index: int, rec: HttpRecord) -> None:
    """A request with a ``timeout``: each of its sessions ended in the worker no later than the
    session's opening + the timeout (invariant 8 of the engine suite, through HTTP)."""
    timeout, e = rec.request.timeout, report.engine
    if timeout is None:
        return
    for log in sessions_of(report, index):
        t0 = log.entered.time
        late = {u: e.end_event[u].time for u in log.uids
                if u in e.end_event and e.end_event[u].time > t0 + timeout + 1e-6}
        assert not late, (f"HTTP request #{index}: timeout {timeout} from t={t0}, but its "
                          f"sequences ended in the worker at {late}")


def sessions_of(report: HttpReport, index: int) -> list[SessionLog]:
    return [log for log in report.tap.sessions.values() if log.owner == index]


def _expected(report: HttpReport, rec: HttpRecord) -> ExpectedText:
    req = rec.request
    return expected_text(list(req.prompt), req, report.scenario.engine.max_model_len,
                         lambda t: CharTokenizer.text_of(t, True))


def _too_long(report: HttpReport, rec: HttpRecord) -> bool:
    req, limit = rec.request, report.scenario.engine.max_model_len
    return len(req.prompt) >= limit or (
        req.max_tokens is not None and len(req.prompt) + req.max_tokens > limit
    )


def check_http_client(report: HttpReport, index: int, rec: HttpRecord) -> None:
    req = rec.request
    who = (f"HTTP request #{index} ({req.endpoint}, stream={req.stream}, n={req.n}, "
           f"prompt len {len(req.prompt)}, max_tokens={req.max_tokens}, stop={list(req.stop)}, "
           f"{req.client!r}, outcome {rec.outcome}, status {rec.status})")
    assert rec.outcome is not None, f"{who}: the client never finished"
    assert not rec.outlived, (
        f"{who}: {rec.outlived} still alive in the engine when the server's ASGI call returned"
    )
    if rec.outcome == "disconnected":
        assert rec.server_ended, (
            f"{who}: the server was still running the request {DISCONNECT_NOTICE_S} s after the "
            f"client disconnected"
        )
        if rec.status == 200 and req.stream:
            _check_stream(report, index, who, rec, complete=False)
        return

    assert rec.status is not None, f"{who}: no status"
    if _too_long(report, rec):
        assert rec.status == 400, f"{who}: a request too long for the context was not refused"
        assert _error(who, rec.body)["code"] == "context_length_exceeded", who
        return
    if rec.status != 200:
        _check_error_status(report, index, who, rec)
        return
    if req.stream:
        _check_stream(report, index, who, rec, complete=True)
    else:
        _check_json(report, who, rec)


def _error(who: str, body: bytes) -> dict[str, Any]:
    obj = json.loads(body)
    assert set(obj) == {"error"}, f"{who}: not an OpenAI error: {obj}"
    return obj["error"]


def _allowed_errors(report: HttpReport, rec: HttpRecord, index: int) -> set[str]:
    """The error codes the scenario can explain for this request."""
    sc = report.scenario
    allowed = set()
    if report.drain_started is not None and report.drain_started.seq < rec.end.seq:
        allowed.add("service_unavailable")
    if sc.max_waiting < 256:
        allowed.add("queue_full")
    if report.engine.stats.failed_steps:
        allowed.add("engine_error")
    if rec.request.timeout is not None:
        allowed.add("timeout")  # check_http_deadline checked when
    if sc.max_queue_time_s is not None:
        allowed.add("queue_time")
    # A stall is explained by the session's log: check_session verified it against the reads.
    if any(isinstance(log.error, RequestStalled) for log in sessions_of(report, index)):
        assert rec.max_gap >= sc.stall_timeout_s, (
            f"HTTP request #{index}: stalled, but its client never went {sc.stall_timeout_s} s "
            f"without reading (longest gap {rec.max_gap})"
        )
        allowed.add("stalled")
    return allowed


def _check_error_status(report: HttpReport, index: int, who: str, rec: HttpRecord) -> None:
    err = _error(who, rec.body)
    status = {"service_unavailable": 503, "queue_full": 429, "engine_error": 500, "timeout": 504,
              "queue_time": 429}
    allowed = _allowed_errors(report, rec, index)
    assert err["code"] in allowed and status.get(err["code"]) == rec.status, (
        f"{who}: answered {rec.status} {err} (allowed: {sorted(allowed)}; "
        f"the runtime's errors: {runtime_errors()})"
    )


def _check_text(who: str, exp: ExpectedText, text: str, finish: str | None) -> None:
    if finish is not None:
        assert (text, finish) == (exp.text, exp.finish_reason), (
            f"{who}: got {text!r} ({finish}), expected {exp.text!r} ({exp.finish_reason})"
        )
    else:
        assert exp.text.startswith(text), f"{who}: {text!r} is not a prefix of {exp.text!r}"


def _check_json(report: HttpReport, who: str, rec: HttpRecord) -> None:
    req = rec.request
    obj = json.loads(rec.body)
    assert obj["object"] == ("chat.completion" if req.endpoint == "chat" else "text_completion")
    assert obj["model"] == HTTP_MODEL
    assert [c["index"] for c in obj["choices"]] == list(range(req.n)), f"{who}: choice indexes"
    exp = _expected(report, rec)
    for c in obj["choices"]:
        text = c["message"]["content"] if req.endpoint == "chat" else c["text"]
        _check_text(f"{who} choice {c['index']}", exp, text, c["finish_reason"])
    assert obj["usage"] == {
        "prompt_tokens": len(req.prompt),
        "completion_tokens": req.n * exp.num_tokens,
        "total_tokens": len(req.prompt) + req.n * exp.num_tokens,
    }, f"{who}: usage {obj['usage']}"


def _events(who: str, body: bytes) -> list[Any]:
    text = body.decode()
    assert text == "" or text.endswith("\n\n"), f"{who}: a cut event: {text[-80:]!r}"
    events = []
    for raw in text.split("\n\n")[:-1]:
        assert raw.startswith("data: "), f"{who}: not an SSE data line: {raw!r}"
        data = raw[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _check_stream(report: HttpReport, index: int, who: str, rec: HttpRecord,
                  complete: bool) -> None:
    req = rec.request
    events = _events(who, rec.body)
    done = [i for i, e in enumerate(events) if e == "[DONE]"]
    if complete:
        assert done == [len(events) - 1], f"{who}: [DONE] at {done} of {len(events)} events"
    else:
        assert len(done) <= 1 and (not done or done[0] == len(events) - 1), who
    chunks = [e for e in events if e != "[DONE]"]
    errors = [i for i, e in enumerate(chunks) if "error" in e]
    if errors:
        assert errors == [len(chunks) - 1], f"{who}: an error event that is not the last one"
        code = chunks[-1]["error"]["code"]
        allowed = _allowed_errors(report, rec, index)
        assert code in allowed, (
            f"{who}: error event {chunks[-1]} (allowed: {sorted(allowed)}; the runtime's errors: "
            f"{runtime_errors()})"
        )
        chunks = chunks[:-1]
    exp = _expected(report, rec)
    texts = {i: "" for i in range(req.n)}
    finish: dict[int, str | None] = {i: None for i in range(req.n)}
    usage = None
    obj_name = "chat.completion.chunk" if req.endpoint == "chat" else "text_completion"
    for chunk in chunks:
        assert chunk["object"] == obj_name and chunk["model"] == HTTP_MODEL, f"{who}: {chunk}"
        if not chunk["choices"]:
            assert req.include_usage and usage is None and chunk["usage"], f"{who}: {chunk}"
            usage = chunk["usage"]
            continue
        if req.include_usage:
            assert chunk["usage"] is None, f"{who}: usage on a content chunk"
        assert usage is None, f"{who}: a chunk after the usage chunk"
        (c,) = chunk["choices"]
        i = c["index"]
        assert finish[i] is None, f"{who}: choice {i} has a chunk after its finish"
        if req.endpoint == "chat":
            delta = c["delta"]
            texts[i] += delta.get("content") or ""
        else:
            texts[i] += c["text"]
        finish[i] = c["finish_reason"]
    for i in range(req.n):
        _check_text(f"{who} choice {i}", exp, texts[i], finish[i])
    if complete and not errors:
        assert all(finish.values()), f"{who}: the stream ended with unfinished choices {finish}"
        if req.include_usage:
            assert usage == {
                "prompt_tokens": len(req.prompt),
                "completion_tokens": req.n * exp.num_tokens,
                "total_tokens": len(req.prompt) + req.n * exp.num_tokens,
            }, f"{who}: usage {usage}"
