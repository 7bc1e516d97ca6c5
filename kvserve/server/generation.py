"""One HTTP generation request's life: admit -> submit its prompts -> consume outputs -> close.

``Generation`` owns one sink queue shared by its engine requests (one per prompt), the request
deadline, a client-disconnect watcher, and the admission slot. ``close()`` is idempotent and
always runs (handler ``finally`` or the streaming response's ``finally``): it aborts whatever is
unfinished (freeing its KV blocks before the engine's next step), records finish reasons and
latency, and gives the admission slot back.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import Receive

from kvserve.engine.async_engine import (
    DeadlineExceeded,
    EngineDeadError,
    EngineShutdown,
    RequestFailure,
)
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError, bad_request
from kvserve.server.prompts import Prompt
from kvserve.server.state import ServerState

_DISCONNECTED = object()


class ClientDisconnected(Exception):
    pass


def engine_error(error: Exception) -> APIError:
    if isinstance(error, EngineShutdown):
        return APIError(503, "the server is shutting down", type="server_error",
                        code="shutting_down")
    if isinstance(error, EngineDeadError):
        return APIError(500, "the engine stopped on an internal error", type="server_error",
                        code="engine_dead")
    return APIError(500, "internal error", type="server_error")


class Generation:
    def __init__(self, state: ServerState, request_id: str, prompts: list[Prompt],
                 params: SamplingParams, *, priority: int = 0,
                 cache_salt: str | None = None) -> None:
        self.state = state
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._index = {rid: i for i, rid in enumerate(self.engine_ids)}
        self.latest: list[RequestOutput | None] = [None] * len(prompts)
        self.done = [False] * len(prompts)
        self.timed_out = False
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self._sink: asyncio.Queue = asyncio.Queue()
        self._watcher: asyncio.Task | None = None
        self._admitted = False
        self._submitted = False  # every prompt accepted by the engine
        self._closed = False
        self._last_token_time: float | None = None
        self._seen_tokens = 0

    # ---- start ----------------------------------------------------------------------------
    async def start(self, receive: Receive | None = None) -> None:
        """Admit and submit every prompt. Raises ``APIError`` (429/503/400)."""
        self.state.admit()
        self._admitted = True
        if receive is not None:
            self._watcher = asyncio.create_task(self._watch(receive))
        timeout = self.state.settings.request_timeout
        deadline = self.arrival + timeout if timeout is not None else None
        engine = self.state.engine
        results = await asyncio.gather(*(
            engine.add_request(rid, {"prompt_token_ids": p.token_ids, "prompt": p.text},
                               self.params, sink=self._sink, priority=self.priority,
                               cache_salt=self.cache_salt, deadline=deadline)
            for rid, p in zip(self.engine_ids, self.prompts, strict=True)
        ), return_exceptions=True)
        for res in results:
            if isinstance(res, ValueError):
                raise bad_request(str(res), "prompt")
            if isinstance(res, Exception):
                raise engine_error(res)
            if isinstance(res, BaseException):
                raise res
        self._submitted = True

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._sink.put_nowait(_DISCONNECTED)
                return

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    # ---- consume --------------------------------------------------------------------------
    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next (prompt index, cumulative output); None once every prompt is done.

        Raises ``ClientDisconnected`` or ``APIError`` (engine failure)."""
        while not all(self.done):
            item = await self._sink.get()
            if item is _DISCONNECTED:
                raise ClientDisconnected()
            if isinstance(item, RequestFailure):
                i = self._index.get(item.request_id)
                if i is None:
                    continue
                self.done[i] = True
                if isinstance(item.error, DeadlineExceeded):
                    self.timed_out = True
                    continue
                raise engine_error(item.error)
            if not isinstance(item, RequestOutput):
                continue
            i = self._index.get(item.request_id)
            if i is None or self.done[i]:
                continue
            self.latest[i] = item
            self.done[i] = item.finished
            if i == 0:
                self._observe_tokens(item)
            return i, item
        return None

    async def drain(self) -> None:
        while await self.next() is not None:
            pass

    def _observe_tokens(self, out: RequestOutput) -> None:
        m, metrics = out.metrics, self.state.metrics
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        if m is None or n <= self._seen_tokens or m.last_token_time is None:
            return
        if self._last_token_time is None and m.first_token_time is not None:
            metrics.ttft.observe(max(0.0, m.first_token_time - self.arrival))
            self._seen_tokens = 1
            self._last_token_time = m.first_token_time
        new = n - self._seen_tokens
        if new > 0 and self._last_token_time is not None:
            gap = max(0.0, m.last_token_time - self._last_token_time) / new
            for _ in range(new):
                metrics.itl.observe(gap)
        self._seen_tokens = n
        self._last_token_time = m.last_token_time

    # ---- results --------------------------------------------------------------------------
    def completion(self, prompt_index: int, choice: int) -> CompletionOutput | None:
        out = self.latest[prompt_index]
        return out.outputs[choice] if out is not None and choice < len(out.outputs) else None

    def finish_reason(self, comp: CompletionOutput | None) -> str | None:
        """OpenAI's reason: a deadline cut (or anything unfinished at the end) is "length"."""
        reason = comp.finish_reason if comp is not None else None
        if reason in ("stop", "length"):
            return reason
        return "length" if self.timed_out else None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for out in self.latest if out is not None
                   for c in out.outputs)

    def check_timeout_before_output(self) -> None:
        if self.timed_out and self.num_generated_tokens == 0:
            raise APIError(503, f"the request did not start within the server's "
                           f"{self.state.settings.request_timeout:g} s request timeout",
                           type="timeout_error", code="request_timeout",
                           headers={"Retry-After": "1"})

    # ---- close ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_watching()
        unfinished = [rid for rid, d in zip(self.engine_ids, self.done, strict=True) if not d]
        self.state.engine.abort(unfinished)
        if self._admitted:
            self.state.release()
        if self._submitted:
            self._record_finish()

    def _record_finish(self) -> None:
        metrics = self.state.metrics
        for i in range(len(self.prompts)):
            for c in range(self.params.n):
                comp = self.completion(i, c)
                reason = comp.finish_reason if comp is not None else None
                if reason not in ("stop", "length"):
                    reason = "timeout" if self.timed_out else "abort"
                metrics.finished.labels(reason).inc()
        if any(out is not None for out in self.latest):
            metrics.e2e.observe(time.monotonic() - self.arrival)


async def run_to_first(gen: Generation, receive: Receive) -> tuple[int, RequestOutput] | None:
    """Start ``gen`` and wait for its first output (so errors can still be HTTP statuses)."""
    await gen.start(receive)
    first = await gen.next()
    gen.check_timeout_before_output()
    return first


