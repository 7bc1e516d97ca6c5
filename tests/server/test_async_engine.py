"""``AsyncLLMEngine``: one engine thread, command queue, per-request sinks."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineShutdown,
    RequestFailure,
)
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=300, ignore_eos=True)


@pytest.fixture
def make_engine(tiny_llama):
    made = []

    def make(step_delay_s: float = 0.0, **kw) -> AsyncLLMEngine:
        args = EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", progress=False)
        eng = AsyncLLMEngine.from_engine_args(args, step_delay_s=step_delay_s, **kw).start()
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()
        assert not eng.is_alive()


async def _wait(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def test_streams_cumulative_outputs_until_finished(make_engine):
    eng = make_engine()

    async def main():
        sink: asyncio.Queue = asyncio.Queue()
        await eng.add_request("a", "w1 w2", SamplingParams(max_tokens=5, ignore_eos=True),
                              sink=sink)
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(await sink.get())
        assert all(isinstance(o, RequestOutput) for o in outs)
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
        assert outs[-1].outputs[0].finish_reason == "length"

    asyncio.run(main())
    assert eng.snapshot().num_blocks_used == 0


def test_rejected_request_raises_value_error_and_engine_keeps_going(make_engine):
    eng = make_engine()

    async def main():
        sink: asyncio.Queue = asyncio.Queue()
        with pytest.raises(ValueError, match="vocabulary"):
            await eng.add_request("bad", [1, 99999], SamplingParams(), sink=sink)
        await eng.add_request("dup", "w1", SamplingParams(max_tokens=50), sink=sink)
        with pytest.raises(ValueError, match="already in use"):
            await eng.add_request("dup", "w1", SamplingParams(), sink=sink)
        eng.abort("dup")
        await eng.add_request("ok", "w1", SamplingParams(max_tokens=2), sink=sink)
        while True:
            out = await sink.get()
            if out.request_id == "ok" and out.finished:
                break

    asyncio.run(main())


def test_abort_frees_blocks_within_one_step(make_engine):
    eng = make_engine(step_delay_s=0.02)

    async def main():
        sink: asyncio.Queue = asyncio.Queue()
        await eng.add_request("a", "w1 w2 w3", LONG, sink=sink)
        for _ in range(3):
            await sink.get()
        assert eng.snapshot().num_blocks_used > 0
        steps_at_abort = eng.snapshot().counters["steps"]
        eng.abort("a")
        await _wait(lambda: eng.snapshot().num_unfinished_requests == 0)
        snap = eng.snapshot()
        assert snap.num_blocks_used == 0 and snap.num_running == 0
        # at most the step already in flight ran after the abort
        assert snap.counters["steps"] <= steps_at_abort + 1

    asyncio.run(main())


def test_engine_error_fails_every_request_and_health(make_engine):
    eng = make_engine()

    def boom():
        raise RuntimeError("kaboom")

    async def main():
        sink: asyncio.Queue = asyncio.Queue()
        eng._engine.step = boom  # noqa: SLF001 - simulate a crash inside the engine thread
        await eng.add_request("a", "w1", LONG, sink=sink)
        item = await asyncio.wait_for(sink.get(), 10)
        assert isinstance(item, RequestFailure) and isinstance(item.error, EngineDeadError)
        await _wait(lambda: not eng.is_alive())
        with pytest.raises(EngineDeadError):
            await eng.add_request("b", "w1", LONG, sink=sink)

    asyncio.run(main())


def test_shutdown_fails_running_requests(make_engine):
    eng = make_engine(step_delay_s=0.01)

    async def main():
        sink: asyncio.Queue = asyncio.Queue()
        await eng.add_request("a", "w1", LONG, sink=sink)
        await sink.get()
        await asyncio.to_thread(eng.shutdown)
        while True:
            item = await sink.get()
            if isinstance(item, RequestFailure):
                break
        assert isinstance(item.error, EngineShutdown)
        with pytest.raises(EngineShutdown):
            await eng.add_request("b", "w1", LONG, sink=sink)

    asyncio.run(main())
    assert eng.snapshot().num_blocks_used == 0


def _handoff_log(eng: AsyncLLMEngine) -> list[str]:
    """What the engine thread does, in order, for one request of 4 tokens: schedule, forward,
    and each hand-over to the loop ("deliver"; "finished" when it holds the finished output)."""
    inner = eng._engine
    log: list[str] = []
    schedule, execute, call = inner.scheduler.schedule, inner.runner.execute_model, eng._call

    def logged_schedule():
        out = schedule()
        if not out.is_empty:
            log.append("schedule")
        return out

    def logged_execute(sched):
        log.append("forward")
        return execute(sched)

    def logged_call(loop, fn, *args):
        if fn.__name__ == "_deliver":
            log.append("finished" if any(getattr(o, "finished", False) for _, o in args[0])
                       else "deliver")
        call(loop, fn, *args)

    inner.scheduler.schedule, inner.runner.execute_model = logged_schedule, logged_execute
    eng._call = logged_call

    async def main():
        sink: asyncio.Queue = asyncio.Queue()
        await eng.add_request("a", "w1 w2", SamplingParams(max_tokens=4, ignore_eos=True),
                              sink=sink)
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(await sink.get())
        return outs

    outs = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4]
    return log


def test_outputs_go_to_the_loop_when_the_next_forward_starts(make_engine):
    """A step's unfinished outputs are handed to the event loop once the next step is
    scheduled, right before its forward (so the loop writes them while the kernels run);
    the finished one goes at once."""
    log = _handoff_log(make_engine())
    assert log == ["schedule", "forward"] + ["schedule", "deliver", "forward"] * 3 + [
        "finished"]


def test_output_handoff_step_hands_each_step_over_at_once(make_engine):
    """``output_handoff="step"``: every step's outputs go to the loop as soon as the step made
    them, in one hand-over, before the next step is scheduled."""
    log = _handoff_log(make_engine(output_handoff="step"))
    assert log == ["schedule", "forward", "deliver"] * 3 + ["schedule", "forward", "finished"]
    with pytest.raises(ValueError, match="output_handoff"):
        AsyncLLMEngine(None, output_handoff="soon")  # type: ignore[arg-type]


def test_streams_on_uvloop(make_engine):
    """The server's loop (uvloop): the engine thread's hand-overs reach it in order."""
    import uvloop

    eng = make_engine()

    async def main():
        sink: asyncio.Queue = asyncio.Queue()
        await eng.add_request("a", "w1 w2", SamplingParams(max_tokens=5, ignore_eos=True),
                              sink=sink)
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(await sink.get())
        return outs

    outs = uvloop.run(main())
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]


def test_a_request_added_during_a_step_joins_the_next_schedule(make_engine):
    """No extra loop iteration between a request's arrival and its admission: one queued
    while a step's forward runs is in the very next schedule(), next to the running ones."""
    import threading

    eng = make_engine()
    inner = eng._engine
    schedule, execute = inner.scheduler.schedule, inner.runner.execute_model
    queued = threading.Event()
    scheduled: list[set[str]] = []
    forwards = 0

    def logged_schedule():
        out = schedule()
        if not out.is_empty:
            scheduled.append({s.req.request_id for s in out.scheduled})
        return out

    def gated_execute(sched):
        nonlocal forwards
        forwards += 1
        if forwards == 2:  # "a"'s second step: "b" arrives while it runs
            assert queued.wait(10)
        return execute(sched)

    inner.scheduler.schedule, inner.runner.execute_model = logged_schedule, gated_execute

    async def main():
        sink_a, sink_b = asyncio.Queue(), asyncio.Queue()
        await eng.add_request("a", "w1 w2", LONG, sink=sink_a)
        await _wait(lambda: forwards >= 2)
        add_b = asyncio.ensure_future(
            eng.add_request("b", "w3", SamplingParams(max_tokens=2, ignore_eos=True),
                            sink=sink_b))
        await asyncio.sleep(0)  # add_request has put its command on the queue
        assert eng._commands.qsize() == 1
        queued.set()
        await add_b
        while not (await sink_b.get()).finished:
            pass
        eng.abort("a")

    asyncio.run(main())
    assert scheduled[:2] == [{"a"}, {"a"}]
    assert scheduled[2] == {"a", "b"}  # the step right after the one "b" arrived during


def test_the_thread_that_builds_the_engine_steps_it(tiny_llama, monkeypatch):
    """``from_engine_args`` loads the model on the engine thread, and that same thread runs
    every step (one OpenMP pool in the process); the caller's thread does neither."""
    import threading

    from kvserve.engine.llm_engine import LLMEngine

    seen: dict[str, set[int]] = {"init": set(), "step": set()}
    init, step = LLMEngine.__init__, LLMEngine.step

    def logged_init(self, *a, **kw):
        seen["init"].add(threading.get_ident())
        init(self, *a, **kw)

    def logged_step(self, *a, **kw):
        seen["step"].add(threading.get_ident())
        return step(self, *a, **kw)

    monkeypatch.setattr(LLMEngine, "__init__", logged_init)
    monkeypatch.setattr(LLMEngine, "step", logged_step)
    args = EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", progress=False)
    eng = AsyncLLMEngine.from_engine_args(args).start()
    try:
        async def main():
            sink: asyncio.Queue = asyncio.Queue()
            await eng.add_request("a", "w1 w2", SamplingParams(max_tokens=3, ignore_eos=True),
                                  sink=sink)
            while not (await sink.get()).finished:
                pass

        asyncio.run(main())
    finally:
        eng.shutdown()
    assert len(seen["init"]) == 1 and seen["step"] == seen["init"]
    assert threading.get_ident() not in seen["init"]


def test_a_build_error_is_raised_to_the_caller_and_an_unstarted_engine_shuts_down(tiny_llama):
    with pytest.raises(ValueError, match="max_num_seqs"):
        AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB",
                                                   progress=False, max_num_seqs=0))
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB",
                                                     progress=False))
    thread = eng._host[0]  # noqa: SLF001 - the parked engine thread
    assert thread.is_alive()
    eng.shutdown()
    assert not thread.is_alive() and not eng.is_alive()
