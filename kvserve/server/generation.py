"""One HTTP generation request's life: admitted -> queued -> its prompts dispatched to the engine
-> outputs consumed -> closed.

``Generation`` owns one sink queue shared by its engine requests (one per prompt), the request
deadline (the one home of ``--request-timeout``: at the deadline it withdraws the prompts still
queued and aborts the dispatched ones; the engine has no clock of its own), a client-disconnect
watcher and the admission ticket. Its prompts reach the engine
through the server's ``FairQueue`` (one prompt per turn); the sink tells the queue as soon as an
engine request has finished, so its room goes to the next turn. ``close()`` is idempotent and
always runs (handler ``finally`` or the streaming response's ``finally``): it withdraws what
was never dispatched, aborts whatever is unfinished (freeing its KV blocks before the engine's
next step), records finish reasons and latency, and gives the admission ticket back.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.types import Receive

from kvserve.engine.async_engine import EngineDeadError, EngineShutdown, RequestFailure
from kvserve.http.errors import APIError, bad_request
from kvserve.http.protocol import SamplingRequest
from kvserve.outputs import CompletionOutput, Logprobs, RequestMetrics, RequestOutput
from kvserve.request import LoRARequest
from kvserve.sampling_params import SamplingParams
from kvserve.server.admission import Ticket
from kvserve.server.disagg import kv_leg, prefill_result
from kvserve.server.prompts import Prompt
from kvserve.server.state import ServerState
from kvserve.server.structured import Constraint, compile_constraint

if TYPE_CHECKING:  # imported only when tracing is on
    from kvserve.http.tracing import RequestTrace

_DISCONNECTED = object()
_FORCE_END = object()


class ClientDisconnected(Exception):
    pass


class DeadlineExceeded(Exception):
    """The request's deadline passed: its prompts were withdrawn or aborted (their blocks
    freed before the engine's next step)."""


class _Choice:
    """One choice's output so far, accumulated from the engine's deltas (O(new) per step)."""

    __slots__ = ("index", "text", "token_ids", "logprobs", "cumulative_logprob",
                 "finish_reason", "stop_reason")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[Logprobs] | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        if delta.text:
            self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def output(self) -> CompletionOutput:
        return CompletionOutput(self.index, "".join(self.text), self.token_ids,
                                self.cumulative_logprob, self.logprobs, self.finish_reason,
                                self.stop_reason)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error",
                    code="shutting_down")


def engine_error(error: Exception) -> APIError:
    if isinstance(error, EngineShutdown):
        return shutting_down()
    if isinstance(error, EngineDeadError):
        return APIError(500, "the engine stopped on an internal error", type="server_error",
                        code="engine_dead")
    return APIError(500, "internal error", type="server_error")


class _Sink(asyncio.Queue):
    """The engine's delivery queue; reports each engine request's end the moment it arrives
    (not when the consumer gets to it), so its room in the engine is handed on at once."""

    def __init__(self, on_end: Callable[[str], None]) -> None:
        super().__init__()
        self._on_end = on_end

    def put_nowait(self, item) -> None:
        super().put_nowait(item)
        if isinstance(item, RequestFailure) or (isinstance(item, RequestOutput)
                                                and item.finished):
            self._on_end(item.request_id)


class Generation:
    def __init__(self, state: ServerState, request_id: str, prompts: list[Prompt],
                 params: SamplingParams, ticket: Ticket, *, priority: int = 0,
                 cache_salt: str | None = None, disagg_args: dict | None = None,
                 prefill_cached_tokens: int | None = None,
                 lora: LoRARequest | None = None) -> None:
        self.state = state
        self.lora = lora  # the LoRA adapter the request's model names (None: the base)
        # disaggregation leg: LLMEngine.add_request's kv_export / kv_transfer / first_token
        self.disagg_args = disagg_args or {}
        self.kv_result: dict | None = None  # a prefill leg's handle + first token
        # a decode leg: the prefill replica's cached prompt tokens (its usage reports them)
        self.prefill_cached_tokens = prefill_cached_tokens
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._index = {rid: i for i, rid in enumerate(self.engine_ids)}
        # per prompt: its choices so far, and its prompt logprobs (from its first output)
        self.choices: list[dict[int, _Choice]] = [{} for _ in prompts]
        self.prompt_logprobs: list[list[Logprobs | None] | None] = [None] * len(prompts)
        self.cached_tokens = [0] * len(prompts)  # per prompt: RequestOutput.num_cached_tokens
        self._num_generated = 0
        self.done = [False] * len(prompts)
        self.timed_out = False
        self.aborted = False  # ended by a forced shutdown
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self._ticket = ticket
        self._sink = _Sink(self._engine_request_ended)
        self._pending: deque[int] = deque(range(len(prompts)))  # prompts not yet dispatched
        self._charged: dict[str, int] = {}  # dispatched, unfinished -> sequences charged
        self._adds: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task | None = None
        self._started = False
        self._closed = False
        self._expired = False  # the deadline passed: nothing more is added to the engine
        self._last_token_time: float | None = None
        self._seen_tokens = 0  # choice 0 of prompt 0: tokens seen by the latency metrics
        # tracing on: kvserve.http.tracing.RequestTrace, and each prompt's engine metrics
        self.trace: RequestTrace | None = None
        self.engine_metrics: list[RequestMetrics | None] = [None] * len(prompts)

    # ---- start ----------------------------------------------------------------------------
    async def start(self, receive: Receive | None = None) -> None:
        """Queue every prompt for the engine. Engine rejections and failures arrive through
        ``next()``."""
        if self.state.force_ended:
            raise shutting_down()
        self._started = True
        self.state.generations.add(self)
        if receive is not None:
            self._watcher = asyncio.create_task(self._watch(receive))
        timeout = self.state.settings.request_timeout
        if timeout is not None:
            # loop.time() is time.monotonic()
            self._timer = asyncio.get_running_loop().call_at(self.arrival + timeout,
                                                             self._expire)
        self.state.queue.submit(self)

    # ---- FairQueue side ------------------------------------------------------------------
    @property
    def sequences_per_prompt(self) -> int:
        return self.params.n

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def dispatch_next(self, charge: int) -> None:
        i = self._pending.popleft()
        rid, prompt = self.engine_ids[i], self.prompts[i]
        self._charged[rid] = charge
        task = asyncio.ensure_future(self._add(i, rid, prompt))
        self._adds.add(task)
        task.add_done_callback(self._adds.discard)

    async def _add(self, i: int, rid: str, prompt: Prompt) -> None:
        if self._closed or self._expired or self.done[i]:
            return  # closed or expired (its abort already sent) before this task ran: never add
        try:
            await self.state.engine.add_request(
                rid, {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text},
                self.params, sink=self._sink, priority=self.priority,
                cache_salt=self.cache_salt, disagg_args=self.disagg_args,
                lora_request=self.lora)
        except Exception as e:  # noqa: BLE001 - every failure is reported through the sink
            self._sink.put_nowait(RequestFailure(rid, e))

    def _engine_request_ended(self, rid: str) -> None:
        charge = self._charged.pop(rid, 0)
        if charge:
            self.state.queue.release(charge)

    def _expire(self) -> None:
        """The deadline passed: the prompts still queued are withdrawn, the dispatched ones
        aborted (before the engine's next step), and each ends with ``DeadlineExceeded``."""
        self._timer = None
        self._expired = True
        self.state.queue.withdraw(self)
        queued = [self.engine_ids[i] for i in self._pending]
        self._pending.clear()
        dispatched = list(self._charged)  # unfinished: a finished one has left _charged
        self.state.engine.abort(dispatched)
        for rid in queued + dispatched:
            self._sink.put_nowait(RequestFailure(rid, DeadlineExceeded(
                f"request {rid} passed its deadline")))

    def force_end(self) -> None:
        self._sink.put_nowait(_FORCE_END)

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
        """The next (prompt index, output delta: what is new since that prompt's previous
        output); None once every prompt is done. ``choices`` accumulates the deltas.

        Raises ``ClientDisconnected`` or ``APIError`` (engine failure)."""
        while not all(self.done):
            item = await self._sink.get()
            if item is _DISCONNECTED:
                raise ClientDisconnected()
            if item is _FORCE_END:
                self.aborted = True
                self._stop_all()
                return None
            if isinstance(item, RequestFailure):
                i = self._index.get(item.request_id)
                if i is None or self.done[i]:  # (an add the engine refused after the deadline)
                    continue
                self.done[i] = True
                if isinstance(item.error, DeadlineExceeded):
                    self.timed_out = True
                    continue
                if isinstance(item.error, ValueError):  # the engine refused the prompt
                    raise bad_request(str(item.error), "prompt",
                                      getattr(item.error, "code", None))
                raise engine_error(item.error)
            if not isinstance(item, RequestOutput):
                continue
            i = self._index.get(item.request_id)
            if i is None or self.done[i]:
                continue
            self._accumulate(i, item)
            self.done[i] = item.finished
            if i == 0:
                self._observe_tokens(item)
            return i, item
        return None

    async def drain(self) -> None:
        while await self.next() is not None:
            pass

    def _accumulate(self, i: int, out: RequestOutput) -> None:
        if out.metrics is not None:  # its first sequence's timings: metrics and tracing
            self.engine_metrics[i] = out.metrics
        if out.kv_transfer is not None:
            self.kv_result = prefill_result(out)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[i] = out.prompt_logprobs
        self.cached_tokens[i] = out.num_cached_tokens
        choices = self.choices[i]
        for delta in out.outputs:
            choice = choices.get(delta.index)
            if choice is None:
                choice = choices[delta.index] = _Choice(delta.index)
            choice.add(delta)
            self._num_generated += len(delta.token_ids)

    def _observe_tokens(self, out: RequestOutput) -> None:
        m, record = out.metrics, self.state.metrics.record
        first = self.choices[0].get(0)
        n = len(first.token_ids) if first is not None else 0
        if m is None or n <= self._seen_tokens or m.last_token_time is None:
            return
        if self._last_token_time is None and m.first_token_time is not None:
            record.first_token(m.first_token_time - self.arrival)
            self._seen_tokens = 1
            self._last_token_time = m.first_token_time
        new = n - self._seen_tokens
        if new > 0 and self._last_token_time is not None:
            record.inter_token((m.last_token_time - self._last_token_time) / new, new)
        self._seen_tokens = n
        self._last_token_time = m.last_token_time

    # ---- results --------------------------------------------------------------------------
    def completion(self, prompt_index: int, choice: int) -> CompletionOutput | None:
        """The choice's whole output so far (for a non-streamed response)."""
        c = self.choices[prompt_index].get(choice)
        return c.output() if c is not None else None

    def finish_reason(self, comp: CompletionOutput | None) -> str | None:
        """OpenAI's reason: a deadline cut is "length"; a forced shutdown's cut is "abort"; a
        structured output's grammar that allowed no next token is "grammar_dead_end"."""
        reason = comp.finish_reason if comp is not None else None
        if reason in ("stop", "length", "grammar_dead_end"):
            return reason
        if self.aborted:
            return "abort"
        return "length" if self.timed_out else None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from a prefix cache: the engine's count summed over the
        prompts; a decode leg reports the prefill replica's (what it received by transfer is
        not a cache hit)."""
        if self.prefill_cached_tokens is not None:
            return self.prefill_cached_tokens
        return sum(self.cached_tokens)

    @property
    def num_generated_tokens(self) -> int:
        return self._num_generated

    def check_timeout_before_output(self) -> None:
        if self.aborted and self.num_generated_tokens == 0:
            raise shutting_down()
        if self.timed_out and self.num_generated_tokens == 0:
            raise APIError(503, f"the request did not start within the server's "
                           f"{self.state.settings.request_timeout:g} s request timeout",
                           type="timeout_error", code="request_timeout",
                           headers={"Retry-After": "1"})

    # ---- close ----------------------------------------------------------------------------
    def _stop_all(self) -> None:
        """Withdraw what was never dispatched, abort the rest, hand back its engine room."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.state.queue.withdraw(self)
        self._pending.clear()
        unfinished = [rid for rid, d in zip(self.engine_ids, self.done, strict=True) if not d]
        self.state.engine.abort(unfinished)  # before any add the queue makes next: in order
        self.done = [True] * len(self.prompts)
        charged, self._charged = sum(self._charged.values()), {}
        if charged:
            self.state.queue.release(charged)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_watching()
        finished = list(self.done)
        self._stop_all()
        self.done = finished
        self._ticket.release()
        self.state.generations.discard(self)
        if self._started:
            self._record_finish()
        elif self.trace is not None:
            self.trace.fail(shutting_down())

    def _record_finish(self) -> None:
        record = self.state.metrics.record
        reasons = []
        for i, prompt in enumerate(self.prompts):
            tokens = []
            for c in range(self.params.n):
                choice = self.choices[i].get(c)
                reason = choice.finish_reason if choice is not None else None
                if reason not in ("stop", "length", "grammar_dead_end"):
                    reason = "timeout" if self.timed_out else "abort"
                reasons.append(reason)
                tokens.append(len(choice.token_ids) if choice is not None else 0)
            m = self.engine_metrics[i]
            if m is not None and m.first_token_time is not None:
                record.prompt_done(self.arrival, m, len(prompt.token_ids), tokens,
                                   self.params.n, self.params.max_tokens)
        record.request_done(time.monotonic() - self.arrival if any(self.choices) else None,
                            reasons)
        if self.trace is not None:
            self.trace.finish(self.request_id, self.arrival, self.engine_metrics,
                              self.num_prompt_tokens, self.num_generated_tokens, reasons)


async def new_generation(
        state: ServerState, req: SamplingRequest, id_prefix: str, num_prompts: int,
        constraint: Constraint | None,
        prepare: Callable[[], Awaitable[tuple[list[Prompt], SamplingParams]]]) -> Generation:
    """Admit a request of ``num_prompts`` prompts x ``req.n`` choices, compile its output
    constraint, then build it: ``prepare`` tokenizes and checks the prompts and makes the
    sampling parameters (the constraint and the disaggregation leg are added here). Whatever
    raises (a 400 among them) gives the admission ticket back."""
    ticket = state.admit(num_prompts, req.n)
    try:
        await compile_constraint(state.engine, constraint)
        prompts, params = await prepare()
        if constraint is not None and params.structured_outputs is None:
            # (prepare may have set it: the same grammar with a reasoning gate)
            params = params.clone(structured_outputs=constraint.params)
        params, disagg_args = kv_leg(req.kv_transfer, len(prompts), params,
                                     state.settings.role)
        leg = req.kv_transfer
        return Generation(state, state.new_id(id_prefix), prompts, params, ticket,
                          priority=req.priority, cache_salt=req.cache_salt,
                          disagg_args=disagg_args,
                          prefill_cached_tokens=leg.cached_tokens if leg is not None
                          and leg.role == "decode" else None,
                          lora=state.loras.request_for(req.model))
    except BaseException:
        ticket.release()
        raise


async def run_to_first(gen: Generation, receive: Receive) -> tuple[int, RequestOutput] | None:
    """Start ``gen`` and wait for its first output (so errors can still be HTTP statuses)."""
    await gen.start(receive)
    first = await gen.next()
    gen.check_timeout_before_output()
    return first


