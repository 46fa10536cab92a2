"""What ``serve()`` adds to hypercorn 0.18: a fix of its keep-alive timeout under quart-trio, and
a cap on concurrent connections, which hypercorn lacks.

After a response, hypercorn's HTTP/1.1 protocol ends the request (``_maybe_recycle``): it first
sends the app ``http.disconnect``, then restarts the connection's idle timer
(``TCPServer.protocol_send(Updated(idle=True))`` -> ``TrioSingleTask.restart`` ->
``nursery.start``). Both run inside the app's own task (the ASGI ``send`` of the last body
chunk). quart-trio answers the ``http.disconnect`` by cancelling the request's nursery, which
cancels that ``nursery.start`` half-way: the new timer task is cancelled as it starts. So an idle
keep-alive connection was never closed by the server after its first response, and a client
could hold any number of connections open by sending one request on each.

The fix shields the idle-timer restart from the app's cancellation: the timer then runs in the
connection's task group, as hypercorn intends. And after a ``Connection: close`` response the
timer is started too (hypercorn started none: the socket stayed open as long as the client
kept it). ``tests/runtime/test_connection_limits.py``
proves it against a real server (and fails without it).

The cap (:class:`ConnectionCap`, set on the hypercorn config by ``serve()``) counts the
connections being served; one past the cap gets a 503 in the OpenAI envelope with
``Connection: close`` and is closed at once, before hypercorn reads from it: accepting and
closing is how a flood is refused fast, where leaving connections in the listen backlog would let
them pile up until file descriptors run out.
"""

from __future__ import annotations

from typing import Any

import trio

_APPLIED = False

# What a connection past the cap reads: a whole HTTP/1.1 response, then the close.
_REFUSAL_BODY = (
    b'{"error":{"message":"too many open connections to this server; retry later",'
    b'"type":"service_unavailable","param":null,"code":"too_many_connections"}}'
)
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
    + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY
)


class ConnectionCap:
    """How many client connections one server may hold open; set as ``config.connection_cap``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0


async def _refuse(stream: Any) -> None:
    with trio.move_on_after(1):  # a client that does not read gets the close without it
        try:
            await stream.send_all(REFUSAL)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await trio.aclose_forcefully(stream)


def patch_keep_alive() -> bool:
    """Install the fix (idempotent). Returns False, changing nothing, if hypercorn is not the
    0.18 layout it was written for."""
    global _APPLIED
    if _APPLIED:
        return True
    try:
        import h11
        import hypercorn.trio.run as run_module
        from hypercorn.events import Updated
        from hypercorn.protocol.h11 import H11Protocol
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:
        return False
    if getattr(run_module, "TCPServer", None) is not TCPServer or not hasattr(TCPServer, "protocol_send") \
            or not hasattr(H11Protocol, "_maybe_recycle"):
        return False

    class KeepAliveTCPServer(TCPServer):
        async def run(self) -> None:
            cap: ConnectionCap | None = getattr(self.config, "connection_cap", None)
            if cap is None:
                return await super().run()
            if cap.open >= cap.limit:
                return await _refuse(self.stream)
            cap.open += 1
            try:
                await super().run()
            finally:
                cap.open -= 1

        async def protocol_send(self, event: Any) -> None:
            if isinstance(event, Updated) and event.idle:
                with trio.CancelScope(shield=True):  # restarting the timer takes no time
                    await super().protocol_send(event)
            else:
                await super().protocol_send(event)

    run_module.TCPServer = KeepAliveTCPServer  # type: ignore[misc]

    # A response that says "Connection: close" (ours does when it is sent before the request's
    # body was read: 408, 413, 431) leaves h11 in MUST_CLOSE, and hypercorn then neither closes
    # the socket nor starts the idle timer: a client that kept sending, or just kept the socket,
    # held the connection for good. Start the idle timer there too: the connection is closed
    # keep_alive_timeout after such a response, which leaves the client that long to read it.
    recycle = H11Protocol._maybe_recycle

    async def _maybe_recycle(self: Any) -> None:
        # This runs in the app's task, which quart-trio cancels on the http.disconnect that
        # recycle() sends first: shield it (bookkeeping, no waiting; bounded all the same).
        with trio.CancelScope(shield=True, deadline=trio.current_time() + 1):
            await recycle(self)
            if self.connection.our_state is h11.MUST_CLOSE and not self.context.terminated.is_set():
                await self.send(Updated(idle=True))

    H11Protocol._maybe_recycle = _maybe_recycle  # type: ignore[method-assign]
    _APPLIED = True
    return True
