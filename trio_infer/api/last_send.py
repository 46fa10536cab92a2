"""A response's last ASGI message is sent under a shield.

hypercorn ends an HTTP/1.1 request inside the app's last ``send`` of its response: it tells the
app ``http.disconnect``, then restarts the connection's keep-alive timer (or, for a response that
says ``Connection: close``, shuts the socket down). The app's side answers that
``http.disconnect`` by cancelling the request's task group (quart-trio does; so does
``direct.py``'s disconnect watcher), and that task group holds the task still inside ``send``:
the cancellation would land in hypercorn's bookkeeping half-way and leave the connection open
with no timer, an idle keep-alive connection never closed. Under the shield hypercorn finishes
its part. The write itself hypercorn shields already, so this waits for nothing a cancellation
could have cut short. ``tests/runtime/test_connection_limits.py`` fails without it.
"""

from __future__ import annotations

from typing import Any

import trio


async def send_last(send: Any, message: dict[str, Any]) -> None:
    """Send ``message``, the response's last (``more_body`` false), under a shield."""
    with trio.CancelScope(shield=True):
        await send(message)


def shield_last_send(send: Any) -> Any:
    """``send`` with the response's last message sent as :func:`send_last` sends it: for
    responses whose sends are not the app's own (quart's)."""

    async def shielded(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True):
                await send(message)
        else:
            await send(message)

    return shielded
