"""Queue limit (429 + Retry-After) and the per-request deadline, on in-process apps."""

from __future__ import annotations

import asyncio
import json

from tests.server.conftest import MODEL_NAME

LONG = {"model": MODEL_NAME, "prompt": "w1 w2 w3", "max_tokens": 200, "ignore_eos": True}
SHORT = {"model": MODEL_NAME, "prompt": "w4 w5", "max_tokens": 2}


def test_full_queue_is_429_with_retry_after(inprocess):
    srv = inprocess(step_delay_s=0.01, engine_kw={"max_num_seqs": 1}, max_queue=1)
    assert srv.state.max_sequences == 2

    async def main():
        async with srv.client() as c:
            busy = dict(LONG, max_tokens=60)
            first = [asyncio.create_task(c.post("/v1/completions", json=busy))
                     for _ in range(2)]
            while srv.state.inflight < 2:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/completions", json=SHORT)
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "w1"}], "stream": True})
            assert r.status_code == 429
            done = await asyncio.gather(*first)
            assert [d.status_code for d in done] == [200, 200]
            r = await c.post("/v1/completions", json=SHORT)  # room again
            assert r.status_code == 200, r.text
            metrics = (await c.get("/metrics")).text
            assert 'kvserve_http_errors_total{status="429"} 2.0' in metrics
            assert 'kvserve_requests_rejected_total{reason="queue_full"} 2.0' in metrics

    srv.run(main())
    assert srv.state.inflight == 0


def test_deadline_cuts_generation_with_finish_reason_length(inprocess):
    srv = inprocess(step_delay_s=0.01, request_timeout=0.4)

    async def main():
        async with srv.client() as c:
            r = await c.post("/v1/completions", json=LONG)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["finish_reason"] == "length"
            assert 0 < body["usage"]["completion_tokens"] < 200
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "w1"}], "max_tokens": 200,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
            assert reasons[-1] == "length"
            assert 0 < events[-1]["usage"]["completion_tokens"] < 200
            assert r.text.rstrip().endswith("data: [DONE]")
            r = await c.post("/v1/completions", json=SHORT)
            assert r.status_code == 200, r.text
            metrics = (await c.get("/metrics")).text
            assert 'kvserve_requests_finished_total{finish_reason="timeout"} 2.0' in metrics

    srv.run(main())
    snap = srv.engine.snapshot()
    assert snap.num_blocks_used == 0 and snap.num_unfinished_requests == 0


def test_deadline_before_first_token_is_503(inprocess):
    # Steps 1 s apart: both deadlines pass while the engine sleeps after the running
    # request's first token, so the queued request never gets a step.
    srv = inprocess(step_delay_s=1.0, engine_kw={"max_num_seqs": 1}, request_timeout=0.3)

    async def main():
        async with srv.client() as c:
            running = asyncio.create_task(c.post("/v1/completions", json=LONG))
            while srv.engine.snapshot().num_running < 1:
                await asyncio.sleep(0.005)
            queued = await c.post("/v1/completions", json=SHORT)  # never gets a slot in time
            assert queued.status_code == 503, queued.text
            assert queued.json()["error"]["code"] == "request_timeout"
            assert queued.headers["retry-after"] == "1"
            assert (await running).json()["choices"][0]["finish_reason"] == "length"
            # both answered at their deadlines, while the engine still sleeps out its step;
            # the aborts take effect before its next one
            while srv.engine.snapshot().num_unfinished_requests:
                await asyncio.sleep(0.005)
            r = await c.post("/v1/completions", json=SHORT)
            assert r.status_code == 200, r.text

    srv.run(main())
