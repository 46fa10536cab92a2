"""What the request handlers share: settings, metrics, and, once loaded, the engine and tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from quart import Quart

from trio_infer.api.errors import SERVER_ERROR, APIError
from trio_infer.api.plans import ModelLimits
from trio_infer.api.render import TokenText
from trio_infer.metrics import Metrics
from trio_infer.runtime.client import AsyncEngine
from trio_infer.settings import Settings


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics
    engine: AsyncEngine | None = None
    tokenizer: Any = None
    limits: ModelLimits | None = None
    texts: TokenText | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))

    def ready(self) -> "ServerState":
        """Self, or a 503 while the model is still loading."""
        if self.engine is None:
            raise APIError(503, "The model is still loading.", SERVER_ERROR, code="service_unavailable")
        return self


def server_state(app: Quart) -> ServerState:
    return app.extensions["trio_infer"]
