"""Huge prompts must not stall the event loop (issue 15, item 1), on the demo model's server.

While two 4.08 MB prompts (``"hello world " x 340000``, under the 4 MiB body limit) and a batch
of 64 prompts just under the character bound are processed, ``/health`` is polled and a
stream keeps running; the worst ``/health`` latency and the worst gap between stream chunks
are printed (``-s``) and recorded as test properties. Before the fix each 4 MB prompt was
tokenized on the event loop for about 5 s, and ``/health`` waited that long.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, wait_idle

# slow: 4 MB prompts through a server
pytestmark = pytest.mark.slow

HUGE = json.dumps({"model": MODEL_NAME, "prompt": "hello world " * 340000,
                   "max_tokens": 1}).encode()
NEAR_BOUND = json.dumps({"model": MODEL_NAME, "prompt": ["hello world " * 5000] * 64,
                         "max_tokens": 1}).encode()  # 60,000 characters each


async def _probe_health(c: httpx.AsyncClient, stop: asyncio.Event, latencies: list) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await c.get("/health")
        latencies.append(time.perf_counter() - t0)
        assert r.status_code == 200
        await asyncio.sleep(0.01)


async def _stream_gaps(c: httpx.AsyncClient, started: asyncio.Event, gaps: list) -> None:
    body = {"model": MODEL_NAME, "prompt": "The dict", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            started.set()


def test_health_and_streams_stay_responsive_during_4mb_prompts(demo_server, record_property):
    assert len(HUGE) < 4 * 2**20 and len(HUGE) > 4_000_000
    headers = {"Content-Type": "application/json"}

    async def main():
        latencies: list[float] = []
        gaps: list[float] = []
        stop, started = asyncio.Event(), asyncio.Event()
        async with httpx.AsyncClient(base_url=demo_server.url, timeout=120) as c:
            stream = asyncio.create_task(_stream_gaps(c, started, gaps))
            await asyncio.wait_for(started.wait(), 60)
            probe = asyncio.create_task(_probe_health(c, stop, latencies))
            await asyncio.sleep(0.1)
            t0 = time.perf_counter()
            answers = await asyncio.gather(
                c.post("/v1/completions", content=HUGE, headers=headers),
                c.post("/v1/completions", content=HUGE, headers=headers),
                c.post("/v1/completions", content=NEAR_BOUND, headers=headers))
            elapsed = time.perf_counter() - t0
            await asyncio.sleep(0.1)
            stop.set()
            await probe
            await stream
        return answers, latencies, gaps, elapsed

    answers, latencies, gaps, elapsed = asyncio.run(main())
    for r in answers:
        assert r.status_code == 400, r.text[:500]
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded", err
        assert err["param"] in ("prompt", "prompt[0]"), err
    worst_health, worst_gap = max(latencies), max(gaps)
    print(f"\n3 huge requests answered in {elapsed:.3f} s; /health: {len(latencies)} probes, "
          f"worst {worst_health * 1000:.1f} ms; worst stream chunk gap "
          f"{worst_gap * 1000:.1f} ms")
    record_property("health_worst_ms", round(worst_health * 1000, 1))
    record_property("stream_worst_gap_ms", round(worst_gap * 1000, 1))
    assert len(latencies) >= 3
    assert worst_health < 1.0, latencies
    assert worst_gap < 1.0, gaps
    wait_idle(lambda: httpx.get(demo_server.url + "/metrics").text)
