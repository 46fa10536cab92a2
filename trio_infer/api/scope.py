"""The request scope: a per-HTTP-request exit stack that is always closed.

A streaming response is produced in two halves: the handler (which must enter the generation
session *before* returning, so that a full queue is still a 503 and not an error event) and the
body generator (which ends the session when the stream ends). Between the two, Quart awaits the
``http.response.start`` send; a client that disconnects right then cancels the request before
the body generator ever starts, and a generator that never started never runs its ``finally``.

So the session is entered into an exit stack owned by an ASGI middleware wrapped around the
whole request. The middleware closes the stack when the request's ASGI call returns, for every
reason: normal end, disconnect, cancellation, crash. The body generator closes it earlier on the
normal path (closing twice is harmless). Session exit is synchronous in effect, so the shielded
``aclose`` cannot block shutdown.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from contextvars import ContextVar
from typing import Any

import trio

_current: ContextVar[AsyncExitStack | None] = ContextVar("trio_infer_request_scope", default=None)


def request_exit_stack() -> AsyncExitStack:
    """The exit stack of the current HTTP request (set by :class:`RequestScopeMiddleware`)."""
    stack = _current.get()
    if stack is None:
        raise RuntimeError("no request scope: wrap the app's asgi_app in RequestScopeMiddleware")
    return stack


async def close_quietly(stack: AsyncExitStack) -> None:
    """Close ``stack`` even inside a cancelled scope (trap 4: an unshielded await in a
    ``finally`` raises Cancelled at once)."""
    with trio.CancelScope(shield=True):
        await stack.aclose()


class RequestScopeMiddleware:
    """ASGI middleware: gives each HTTP request an exit stack and closes it when the request's
    ASGI call returns (child tasks of the request inherit the context, hence the stack)."""

    def __init__(self, asgi_app: Any) -> None:
        self.asgi_app = asgi_app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.asgi_app(scope, receive, send)
            return
        stack = AsyncExitStack()
        token = _current.set(stack)
        try:
            await self.asgi_app(scope, receive, send)
        finally:
            _current.reset(token)
            await close_quietly(stack)
