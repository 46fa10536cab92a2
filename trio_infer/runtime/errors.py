"""The errors a request can end with instead of a finish (the API maps each to a status)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the errors a request can end with instead of a finish."""


class EngineUnavailable(EngineError):
    """The engine has died, is restarting or is shutting down: retry later (503)."""


class EngineOverloaded(EngineError):
    """Refused for overload, always before the worker saw the request or before its prefill
    started (429 with ``Retry-After``). ``reason`` names which limit refused it (the label of
    ``trio_infer_requests_refused_total``): ``queue_full`` (``max_waiting`` sequences),
    ``queue_tokens`` (``max_waiting_tokens`` prompt tokens) or ``queue_time``
    (``max_queue_time_s``). ``retry_after_s``: when the queue ahead of a new request should
    have drained, from the measured drain rate (``Router.retry_after``)."""

    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class RequestTimeout(EngineError):
    """The request's deadline (``timeout``, ``X-Request-Timeout`` or ``request_timeout_s``)
    passed: it was aborted (504 before the first byte, an error event after)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request's deadline of {timeout_s:g} s passed (timeout)")
        self.timeout_s = timeout_s


class RequestFailed(EngineError):
    """The engine step that carried this request raised (500)."""


class RequestStalled(EngineError):
    """The reader did not take output for ``stall_timeout_s``; the request was aborted."""
