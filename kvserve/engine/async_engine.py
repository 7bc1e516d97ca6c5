"""``AsyncLLMEngine``: drives the synchronous ``LLMEngine`` from one dedicated thread.

The engine is not thread-safe, so exactly one thread (the *engine thread*) ever touches it after
``start()``. Everyone else talks to it through a thread-safe command queue (``add`` / ``abort`` /
``stop``) that the engine thread drains between steps, so an abort frees its blocks before the
next step runs. Outputs travel back to the caller's asyncio loop with
``loop.call_soon_threadsafe`` (one call per loop per step) into a per-request ``asyncio.Queue``
(the *sink*); several requests may share one sink. Model steps run in the engine thread while the
event loop keeps serving HTTP: torch and the C kernels release the GIL while they compute.

A step's unfinished outputs are handed over when the *next* step's forward is about to start
(``LLMEngine.step``'s ``before_forward``), not as soon as they exist: waking the loop wakes a
second Python thread that holds the GIL while it writes a chunk per request, and the engine
thread, which needs the GIL between its kernels, then waited for it (up to the 5 ms switch
interval at a time) before it could schedule and start the next forward. Handed over at the
forward, the loop's work overlaps the kernels instead. Finished outputs (and failures) still go
at once, so a finished request's room goes to the next one before the next step is scheduled;
nothing is held once the engine has no work left. ``output_handoff="step"`` (`kvserve serve
--output-handoff step`) hands every output over as soon as the step made it instead, in one
wake-up per loop: the loop's writing then shares the GIL with the engine's scheduling, and
the client reads on the core the OpenMP workers leave idle meanwhile (an A/B for the host).

Every item a sink receives is either a ``RequestOutput`` (as ``SamplingParams.output_kind`` asks)
or a ``RequestFailure`` naming the request and why it ended early (the engine thread died, or
the engine is shutting down). After a request's finished output or its failure nothing more
arrives for it. Deadlines are the caller's: it aborts what it no longer waits for (the
server's request timeout: kvserve/server/generation.py).

``from_engine_args`` builds the ``LLMEngine`` on the engine thread itself (model load, decode
graph capture), and that thread runs its steps: the only thread of the process that runs
OpenMP regions. libgomp keeps one worker pool per thread that starts parallel regions; with the
engine built on the main thread and stepped on another, the process has two pools, more OpenMP
threads than cores on a small CPU, and libgomp then throttles its workers' spin between
parallel regions to ~100 loops (``gomp_throttled_spin_count_var``): every kernel call of a step
wakes its workers from a futex. On the 2-core AMX Xeon that made a 16-row bf16 decode step 38
ms instead of 26 (docs/cpu.md, "Served path").

The engine thread also publishes an ``EngineSnapshot`` (scheduler, block pool and counter
figures) after every iteration, so metrics never read the live engine from another thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.engine.stats import EngineStats
from kvserve.outputs import RequestOutput
from kvserve.request import LoRARequest
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.async")

_IDLE_WAIT_S = 0.25


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; no request can make progress."""


class EngineShutdown(RuntimeError):
    """The engine was stopped while the request was still running."""


@dataclass(frozen=True, slots=True)
class RequestFailure:
    request_id: str
    error: Exception


# What the engine thread publishes after every iteration (metrics read it).
EngineSnapshot = EngineStats


@dataclass(slots=True)
class _Live:
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    cache_salt: str | None
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    ack: asyncio.Future
    # disaggregation: kv_export / kv_transfer + first_token (LLMEngine.add_request)
    disagg_args: dict
    lora: LoRARequest | None = None  # the request's LoRA adapter (None: the base model)


@dataclass(slots=True)
class _Call:
    """Run ``fn(engine)`` on the engine thread (LoRA adapter loads / unloads); its result or
    its ValueError resolves ``ack``."""

    fn: Callable[[LLMEngine], object]
    loop: asyncio.AbstractEventLoop
    ack: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


class _Stop:
    pass


_Batches = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]]


def _resolve(fut: asyncio.Future, value: object, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(value)
    else:
        fut.set_exception(error)


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)


class AsyncLLMEngine:
    """Thread-hosted ``LLMEngine`` with an asyncio front door."""

    def __init__(self, engine: LLMEngine, *, step_delay_s: float = 0.0,
                 output_handoff: str = "forward") -> None:
        if step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s}")
        if output_handoff not in ("forward", "step"):
            raise ValueError(f"output_handoff must be 'forward' or 'step', got "
                             f"{output_handoff!r}")
        self._engine = engine
        self.step_delay_s = step_delay_s
        self.output_handoff = output_handoff
        # Immutable facts the front end may read from any thread.
        self.model_config = engine.model_config
        self.capacity_tokens = engine.capacity_tokens
        self.engine_args: EngineArgs = engine.args
        self.kv_events = engine.kv_events  # KVEventPublisher (its bound endpoints) or None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._held: _Batches = {}  # unfinished outputs of the last step, for its next forward
        self._thread: threading.Thread | None = None
        # from_engine_args: the thread that built the engine, parked until start() (its
        # queue gets this object to run, or None to end)
        self._host: tuple[threading.Thread, queue.SimpleQueue] | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._closed = False  # set by the engine thread as it exits
        self._lock = threading.Lock()
        self._snapshot = EngineSnapshot()
        self._publish_snapshot()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLMEngine:
        """Build the engine on its own thread (the module docstring says why), which then
        waits for ``start()`` to run the steps; an error building it is raised here."""
        built: queue.SimpleQueue = queue.SimpleQueue()
        go: queue.SimpleQueue = queue.SimpleQueue()  # the started AsyncLLMEngine, or None

        def host() -> None:
            try:
                engine = LLMEngine(args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                built.put(e)
                return
            built.put(engine)
            owner = go.get()
            if owner is not None:
                owner._run()

        thread = threading.Thread(target=host, name="kvserve-engine", daemon=True)
        thread.start()
        engine = built.get()
        if isinstance(engine, BaseException):
            thread.join()
            raise engine
        try:
            self = cls(engine, **kwargs)
        except BaseException:
            go.put(None)
            raise
        self._host = (thread, go)
        return self

    # ---- lifecycle (any thread) -----------------------------------------------------------
    def start(self) -> AsyncLLMEngine:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        if self._host is not None:  # the thread that built the engine runs it
            self._thread, go = self._host
            self._host = None
            go.put(self)
            return self
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; running requests fail with ``EngineShutdown``."""
        if self._host is not None:  # built, never started: the parked thread ends
            thread, go = self._host
            self._host = None
            go.put(None)
            thread.join(timeout)
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._commands.put(_Stop())
        self._thread.join(timeout)
        if not self._thread.is_alive():  # never while the thread may be inside a collective
            self._engine.shutdown()  # tensor parallel: stop (or, after a failure, kill) workers

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # ---- requests (event-loop side) -------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                          sink: asyncio.Queue, priority: int = 0, cache_salt: str | None = None,
                          disagg_args: dict | None = None,
                          lora_request: LoRARequest | None = None) -> None:
        """Queue a request; returns once the engine accepted it.

        Raises ``ValueError`` (from ``LLMEngine.add_request``) when the engine rejects it, and
        ``EngineDeadError`` / ``EngineShutdown`` when no engine thread will serve it.
        ``disagg_args``: a disaggregation leg's ``kv_export`` / ``kv_transfer`` +
        ``first_token`` (``LLMEngine.add_request``'s arguments).
        """
        loop = asyncio.get_running_loop()
        ack = loop.create_future()
        with self._lock:  # the engine thread closes under this lock: no add gets lost
            self._check_serving()
            self._commands.put(_Add(request_id, prompt, params, priority, cache_salt, sink,
                                    loop, ack, disagg_args or {}, lora_request))
        await ack

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """``fn(engine)`` run on the engine thread between steps (its ValueError re-raised
        here): what changes the engine's own state, e.g. ``LLMEngine.add_lora``."""
        loop = asyncio.get_running_loop()
        ack = loop.create_future()
        with self._lock:
            self._check_serving()
            self._commands.put(_Call(fn, loop, ack))
        return await ack

    def list_loras(self) -> list[tuple[str, int]]:
        """The adapters the engine had at start (read before its thread runs)."""
        return self._engine.list_loras()

    def compile_grammar(self, params) -> None:
        """Compile a ``StructuredOutputsParams`` into the engine's grammar cache (any thread:
        the cache is thread-safe); ``ValueError`` when it does not compile."""
        self._engine.grammars.compile(params)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort from any thread; takes effect before the engine's next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids:
            self._commands.put(_Abort(ids))

    def _check_serving(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine thread died: {self._dead!r}")
        if self._thread is None:
            raise RuntimeError("AsyncLLMEngine.start() was not called")
        if self._stopping or self._closed:
            raise EngineShutdown("the engine is shutting down")

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not self._apply_commands(block=not busy):
                    break
                if not busy:
                    engine.check_health()  # a dead tensor-parallel worker kills us when idle too
                at_forward = self.output_handoff == "forward"
                outputs = (engine.step(before_forward=self._flush if at_forward else None)
                           if engine.has_unfinished_requests() else None)
                # Publish first: whoever gets an item also sees the engine state after it.
                self._publish_snapshot()
                self._flush()  # what no forward ran to send (nothing was scheduled)
                if outputs is not None:
                    finished, running = self._route(outputs)
                    if not at_forward:  # everything at once, one wake-up per loop
                        for loop, items in finished.items():
                            running[loop].extend(items)
                        finished = {}
                    self._send(finished)
                    self._held = running
                    if (not at_forward or self.step_delay_s
                            or not engine.has_unfinished_requests()):
                        self._flush()
                    if self.step_delay_s:
                        time.sleep(self.step_delay_s)
        except BaseException as e:  # noqa: BLE001 - report any failure to every waiter
            logger.exception("engine thread died")
            self._dead = e
            self._close(EngineDeadError(f"the engine thread died: {e!r}"))
            return
        self._close(EngineShutdown("the engine is shutting down"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; wait for one first when idle. False: stop."""
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._apply_add(cmd)
            elif isinstance(cmd, _Call):
                try:
                    self._call(cmd.loop, _resolve, cmd.ack, cmd.fn(self._engine), None)
                except ValueError as e:
                    self._call(cmd.loop, _resolve, cmd.ack, None, e)
            elif isinstance(cmd, _Abort):
                self._engine.abort_request(cmd.request_ids)
                for rid in cmd.request_ids:
                    self._live.pop(rid, None)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply_add(self, cmd: _Add) -> None:
        """The engine checks the request (a request id in use among them: the engine's
        unfinished requests are exactly the live ones here)."""
        error: BaseException | None = None
        try:
            self._engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                     priority=cmd.priority, cache_salt=cmd.cache_salt,
                                     lora_request=cmd.lora, **cmd.disagg_args)
        except ValueError as e:
            error = e
        if error is None:
            self._live[cmd.request_id] = _Live(cmd.sink, cmd.loop)
        self._call(cmd.loop, _resolve, cmd.ack, None, error)

    def _route(self, outputs: list[RequestOutput]) -> tuple[_Batches, _Batches]:
        """(the finished outputs, the others) by event loop."""
        finished: _Batches = defaultdict(list)
        running: _Batches = defaultdict(list)
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue  # aborted meanwhile
            if out.metrics is not None:  # the live object keeps changing in this thread
                out.metrics = dataclasses.replace(out.metrics)
            (finished if out.finished else running)[live.loop].append((live.sink, out))
            if out.finished:
                del self._live[out.request_id]
        return finished, running

    def _flush(self) -> None:
        """Hand the held outputs over (a request's items stay in order: whatever is sent for
        it later goes after them)."""
        held, self._held = self._held, {}
        for loop, items in held.items():
            self._call(loop, _deliver, items)

    def _send(self, batches: _Batches) -> None:
        """One ``call_soon_threadsafe`` per event loop for everything it should receive, after
        what is held."""
        self._flush()
        for loop, items in batches.items():
            self._call(loop, _deliver, items)

    def _close(self, error: Exception) -> None:
        """Thread exit: refuse new adds, free what is left, fail every waiter with ``error``."""
        with self._lock:
            self._closed = True
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        live, self._live = self._live, {}
        try:
            self._engine.abort_request(list(live))
            self._publish_snapshot()
        except Exception:  # noqa: BLE001 - the engine may be broken; nothing more to free
            logger.debug("cleanup after the engine loop failed", exc_info=True)
        batches: _Batches = defaultdict(list)
        for rid, entry in live.items():
            batches[entry.loop].append((entry.sink, RequestFailure(rid, error)))
        self._send(batches)
        for cmd in pending:  # adds that will never be applied
            if isinstance(cmd, (_Add, _Call)):
                self._call(cmd.loop, _resolve, cmd.ack, None, error)

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
            loop.call_soon_threadsafe(fn, *args)

    def _publish_snapshot(self) -> None:
        self._snapshot = self._engine.stats()
