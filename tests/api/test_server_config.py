"""``trio_infer/server.py``: the hypercorn configuration ``serve`` runs, and the refusal of a
connection past the cap (its behaviour against a real server: tests/runtime/test_connection_limits.py)."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from hypercorn.config import Config

from trio_infer import server
from trio_infer.api.errors import error_body
from trio_infer.settings import Settings, Wiring


def test_the_config_comes_from_the_settings_and_the_wiring() -> None:
    settings = Settings(host="0.0.0.0", port=8123, max_connections=7, keep_alive_timeout_s=3.5,
                        max_header_bytes=4096)
    config = server.hypercorn_config(settings)
    assert isinstance(config, Config) and config.bind == ["0.0.0.0:8123"]
    assert config.max_connections == 7 and config.open_connections == 0
    assert config.keep_alive_timeout == 3.5 and config.backlog == 2048
    assert config.h11_max_incomplete_size == config.h2_max_header_list_size == 4096
    # a front end of --api-workers serves on the socket its supervisor bound
    assert server.hypercorn_config(settings, Wiring(listen_fd=9)).bind == ["fd://9"]


def test_the_refusal_is_the_503_envelope_of_every_other_503() -> None:
    head, _, body = server.REFUSAL.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"connection: close" in head and b"retry-after: 1" in head
    assert f"content-length: {len(body)}".encode() in head
    assert json.loads(body) == error_body(
        "too many open connections to this server; retry later", "server_error",
        code="too_many_connections",
    )


def test_install_is_idempotent_and_leaves_other_configs_alone() -> None:
    import hypercorn.trio.run as run_module
    from hypercorn.protocol.h11 import H11Protocol

    assert server.install() and server.install()
    patched = run_module.TCPServer
    assert patched.__name__ == "CappedTCPServer" and H11Protocol._maybe_recycle.__name__ == "_maybe_recycle"
    # The changes test for a ServerConfig; a plain hypercorn Config is served as hypercorn does.
    assert not isinstance(Config(), server.ServerConfig)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO and /proc/self/fd")
def test_widen_backlogs_raises_a_short_listen_backlog_and_never_lowers_one() -> None:
    # The bare hypercorn command listens with hypercorn's 100 before the app starts; the app's
    # startup raises it, so a burst's SYNs are not dropped (server.widen_backlogs).
    with socket.create_server(("127.0.0.1", 0), backlog=100) as short, \
            socket.create_server(("127.0.0.1", 0), backlog=server.BACKLOG + 1000) as long_, \
            socket.socket() as unbound:
        assert server._listen_backlog(short) == 100
        raised = server.widen_backlogs()
        assert short.fileno() in raised and long_.fileno() not in raised
        assert unbound.fileno() not in raised
        assert server._listen_backlog(short) == server.BACKLOG
        assert server._listen_backlog(long_) == server.BACKLOG + 1000
        # the descriptors are still their owners': the sockets still accept
        with socket.create_connection(short.getsockname()):
            conn, _ = short.accept()
            conn.close()
        assert server.widen_backlogs() == []
