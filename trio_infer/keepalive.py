"""A fix for hypercorn 0.18's keep-alive timeout under quart-trio, applied by ``serve()``.

After a response, hypercorn's HTTP/1.1 protocol ends the request (``_maybe_recycle``): it first
sends the app ``http.disconnect``, then restarts the connection's idle timer
(``TCPServer.protocol_send(Updated(idle=True))`` -> ``TrioSingleTask.restart`` ->
``nursery.start``). Both run inside the app's own task (the ASGI ``send`` of the last body
chunk). quart-trio answers the ``http.disconnect`` by cancelling the request's nursery, which
cancels that ``nursery.start`` half-way: the new timer task is cancelled as it starts. So an idle
keep-alive connection was never closed by the server after its first response, and a client
could hold any number of connections open by sending one request on each.

The fix shields the idle-timer restart from the app's cancellation: the timer then runs in the
connection's task group, as hypercorn intends. ``tests/runtime/test_connection_limits.py``
proves it against a real server (and fails without it).
"""

from __future__ import annotations

from typing import Any

import trio

_APPLIED = False


def patch_keep_alive() -> bool:
    """Install the fix (idempotent). Returns False, changing nothing, if hypercorn is not the
    0.18 layout it was written for."""
    global _APPLIED
    if _APPLIED:
        return True
    try:
        import hypercorn.trio.run as run_module
        from hypercorn.events import Updated
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:
        return False
    if getattr(run_module, "TCPServer", None) is not TCPServer or not hasattr(TCPServer, "protocol_send"):
        return False

    class KeepAliveTCPServer(TCPServer):
        async def protocol_send(self, event: Any) -> None:
            if isinstance(event, Updated) and event.idle:
                with trio.CancelScope(shield=True):  # restarting the timer takes no time
                    await super().protocol_send(event)
            else:
                await super().protocol_send(event)

    run_module.TCPServer = KeepAliveTCPServer  # type: ignore[misc]
    _APPLIED = True
    return True
