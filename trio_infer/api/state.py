"""What the request handlers share: settings, metrics, and, once loaded, the engine and tokenizer
(until then, how far the load got)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from quart import Quart

from trio_infer.api.errors import LOADING_RETRY_AFTER_S, SERVER_ERROR, APIError
from trio_infer.api.plans import ModelLimits
from trio_infer.api.background import BackgroundRuns
from trio_infer.api.render import TokenText
from trio_infer.api.response_store import ResponseStore
from trio_infer.metrics import Metrics
from trio_infer.runtime.client import AsyncEngine
from trio_infer.runtime.data_parallel import DataParallelEngine
from trio_infer.settings import Settings, Wiring
from trio_infer.wire import Loading

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics
    engine: AsyncEngine | DataParallelEngine | None = None
    tokenizer: Any = None
    limits: ModelLimits | None = None
    texts: TokenText | None = None
    loading: Loading | None = None  # the load's latest progress (a worker's restart too)
    wiring: Wiring = field(default_factory=Wiring)  # a front end of serve --api-workers: its worker
    started_at: int = field(default_factory=lambda: int(time.time()))
    store: ResponseStore | None = None  # the Responses API's (None: --responses-store off)
    background: BackgroundRuns = field(default_factory=BackgroundRuns)  # background responses

    def serve(self, engine: AsyncEngine | DataParallelEngine, tokenizer: Any) -> None:
        """The model is loaded: requests are served from now on."""
        self.tokenizer = tokenizer
        self.texts = TokenText(tokenizer)
        info = engine.info
        assert info is not None
        self.limits = ModelLimits(
            name=self.settings.served_model_name or info.name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            max_n=self.settings.max_n,
            max_batch_sequences=self.settings.max_waiting,
        )
        self.metrics.set_cache_config(self.settings.engine_config().page_size, info.num_pages,
                                      info.kv_cache_dtype)
        self.loading = None
        self.engine = engine  # last: its presence is what "loaded" means
        log.info("serving %s (context %d tokens)", self.limits.name, self.limits.max_model_len)

    def ready(self) -> "ServerState":
        """Self, or a 503 (with ``Retry-After``) while the model is still loading."""
        if self.engine is None:
            raise APIError(
                503, "The model is still loading; retry shortly.", SERVER_ERROR,
                code="service_unavailable", headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
            )
        return self


def server_state(app: Quart) -> ServerState:
    return app.extensions["trio_infer"]
