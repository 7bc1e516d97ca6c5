"""Per-app server state: the engine client, settings, limits, admission and draining."""

from __future__ import annotations

import itertools
import uuid

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.errors import APIError
from kvserve.server.logprobs import TokenText
from kvserve.server.metrics import ServerMetrics
from kvserve.server.prompts import Limits
from kvserve.server.settings import ServerSettings


class ServerState:
    def __init__(self, engine: AsyncLLMEngine, settings: ServerSettings, tokenizer) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = tokenizer  # the front end's own instance; event loop only
        self.text = TokenText(tokenizer)
        self.metrics = ServerMetrics(engine.snapshot)
        mc = engine.model_config
        self.limits = Limits(vocab_size=mc.vocab_size, max_model_len=mc.max_model_len,
                             capacity_tokens=engine.capacity_tokens)
        self.max_inflight = engine.engine_args.max_num_seqs + settings.max_queue
        self.inflight = 0  # admitted generation requests not yet fully answered
        self.draining = False
        self._ids = itertools.count()
        self._salt = uuid.uuid4().hex[:8]

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{self._salt}{next(self._ids):x}"

    def admit(self) -> None:
        """Count one generation request in, or refuse it (503 draining, 429 queue full)."""
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise APIError(503, "the server is shutting down", type="server_error",
                           code="shutting_down")
        if not self.engine.is_alive():
            self.metrics.rejected.labels("engine_dead").inc()
            raise APIError(503, "the engine is not running", type="server_error",
                           code="engine_dead")
        if self.inflight >= self.max_inflight:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, f"the server queue is full ({self.max_inflight} requests in "
                           "flight); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
