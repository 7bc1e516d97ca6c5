"""Per-app server state: the engine client, settings, limits, admission, the fair queue, the
tokenizer pool, the live generations and the draining / forced-shutdown flags."""

from __future__ import annotations

import itertools
import uuid
from typing import Protocol

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.http.errors import APIError
from kvserve.http.tokenizer_pool import TokenizerPool
from kvserve.server.admission import Admission, FairQueue, Ticket
from kvserve.server.logprobs import TokenText
from kvserve.server.lora import ServedAdapters
from kvserve.server.metrics import ServerMetrics
from kvserve.server.prompts import Limits, max_prompt_chars
from kvserve.server.reasoning import ReasoningParser, get_reasoning_parser
from kvserve.server.response_store import ResponseStore
from kvserve.server.settings import ServerSettings


class LiveGeneration(Protocol):
    """What the state needs of a running generation (kvserve.server.generation.Generation,
    which imports this module)."""

    def force_end(self) -> None: ...


class ServerState:
    def __init__(self, engine: AsyncLLMEngine, settings: ServerSettings, tokenizer) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = tokenizer  # the front end's own instance; event loop only
        self.text = TokenText(tokenizer)
        self.pool = TokenizerPool(tokenizer, settings.tokenizer_workers)
        self.responses = ResponseStore(settings.responses_max_stored,
                                       settings.responses_max_bytes)
        self.reasoning: ReasoningParser | None = (
            get_reasoning_parser(settings.reasoning_parser, tokenizer)
            if settings.reasoning_parser else None)
        mc = engine.model_config
        self.metrics = ServerMetrics(engine.snapshot, settings.served_model_name,
                                     mc.max_model_len)
        self.limits = Limits(vocab_size=mc.vocab_size, max_model_len=mc.max_model_len,
                             capacity_tokens=engine.capacity_tokens,
                             max_prompt_chars=max_prompt_chars(tokenizer, mc.max_model_len))
        args = engine.engine_args
        self.admission = Admission(args.max_num_seqs + settings.max_queue)
        self.queue = FairQueue(2 * args.max_num_seqs,
                               by_priority=args.scheduling_policy == "priority")
        self.generations: set[LiveGeneration] = set()  # started, not closed
        self.loras = ServedAdapters(engine)  # LoRA adapters a request's model may name
        self.draining = False
        self.force_ended = False  # a forced shutdown ended every generation
        self._ids = itertools.count()
        self._salt = uuid.uuid4().hex[:8]
        self.tracing = None  # kvserve.http.tracing.Tracing, only when tracing is on
        if settings.otlp_traces_endpoint is not None:
            from kvserve.http.tracing import Tracing

            self.tracing = Tracing(settings.otlp_traces_endpoint, settings.otlp_traces_protocol,
                                   "kvserve", {"kvserve.role": settings.role,
                                               "kvserve.model": settings.served_model_name})

    @property
    def max_sequences(self) -> int:
        return self.admission.max_sequences

    @property
    def inflight(self) -> int:
        """Admitted generation requests not yet fully answered."""
        return self.admission.requests

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{self._salt}{next(self._ids):x}"

    def admit(self, prompts: int, n: int) -> Ticket:
        """Count a generation request's sequences in, or refuse it (503 draining or engine
        dead, 400 never fits, 429 queue full)."""
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise APIError(503, "the server is shutting down", type="server_error",
                           code="shutting_down")
        if not self.engine.is_alive():
            self.metrics.rejected.labels("engine_dead").inc()
            raise APIError(503, "the engine is not running", type="server_error",
                           code="engine_dead")
        try:
            return self.admission.admit(prompts, n)
        except APIError as e:
            if e.status == 429:
                self.metrics.rejected.labels("queue_full").inc()
            raise

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine died (None while it serves): the drain stops the server on it."""
        return self.engine.dead_error

    def end_all(self) -> None:
        """Forced shutdown: every live generation ends now (streams with ``finish_reason
        "abort"`` and ``[DONE]``); requests still being prepared get 503."""
        self.force_ended = True
        for gen in list(self.generations):
            gen.force_end()

    def close(self) -> None:
        self.pool.close()
        if self.tracing is not None:
            self.tracing.shutdown()
