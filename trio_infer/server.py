"""The HTTP server of ``python -m trio_infer serve``: hypercorn as shipped, configured through its
public :class:`hypercorn.config.Config` and run with :func:`hypercorn.trio.serve`.

The app changes nothing of hypercorn's (or of any other package's); what it needs of the HTTP
server is asked for here, in configuration, each option next to its reason. What hypercorn
cannot be asked for is said in the README ("Connection limits") and docs/deploy.md.
"""

from __future__ import annotations

import logging

from hypercorn.config import Config

from trio_infer.settings import Settings, Wiring

# The listen backlog of the listening socket: uvicorn's default (the kernel caps it at
# net.core.somaxconn). hypercorn's default (100) drops the SYNs of a burst of new connections,
# which clients retry only after a second: 256 clients arriving at once waited 1-2 s for a first
# token. The bare ``hypercorn`` command takes it as ``--backlog 2048``.
BACKLOG = 2048

# Our own drain has ended every request by the time hypercorn is told to stop; this only bounds
# the wait for connections to close.
GRACEFUL_TIMEOUT_S = 2.0


def hypercorn_config(settings: Settings, wiring: Wiring = Wiring()) -> Config:
    """The configuration ``serve`` runs hypercorn with."""
    config = Config()
    # serve --api-workers: the supervisor hands each front end the listening socket it bound.
    if wiring.listen_fd is not None:
        config.bind = [f"fd://{wiring.listen_fd}"]
    else:
        config.bind = [f"{settings.host}:{settings.port}"]
    config.graceful_timeout = GRACEFUL_TIMEOUT_S
    config.backlog = BACKLOG
    # Connection limits (README, "Connection limits"). keep_alive_timeout also bounds the time to
    # send a request's headers (hypercorn counts a connection idle until its headers are in).
    # hypercorn's read_timeout is left unset: it is a per-read idle timeout on the socket, which
    # would also cut any request the client waits on longer than it without sending anything.
    config.keep_alive_timeout = settings.keep_alive_timeout_s
    config.h11_max_incomplete_size = settings.max_header_bytes
    config.h2_max_header_list_size = settings.max_header_bytes
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # through our logging setup, once
    return config
