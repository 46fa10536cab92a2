"""The errors a request can end with instead of a finish (the API maps each to a status)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the errors a request can end with instead of a finish."""


class EngineUnavailable(EngineError):
    """The engine has died, is restarting or is shutting down: retry later (503)."""


class EngineOverloaded(EngineError):
    """The waiting queue is at its cap (503 with Retry-After)."""


class RequestFailed(EngineError):
    """The engine step that carried this request raised (500)."""


class RequestStalled(EngineError):
    """The reader did not take output for ``stall_timeout_s``; the request was aborted."""
