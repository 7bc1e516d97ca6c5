"""The router's proxy against fake replicas (httpx MockTransport, no processes): full replicas
(429) and draining ones (503) are tried in turn and the last answer goes back with its
Retry-After; a replica that cannot be reached is left for another; no replica -> an
OpenAI-shaped 503; a stream cut after it started ends with an error event and [DONE]."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvserve.router.app import RouterState, build_router_app
from kvserve.router.settings import RouterSettings

URLS = ("http://replica-a", "http://replica-b")


def _router(handler, routing: str = "least-loaded") -> tuple[httpx.AsyncClient, RouterState]:
    state = RouterState(RouterSettings(replicas=URLS, routing=routing), "k", None)
    state.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    for r in state.pool.replicas.values():
        r.healthy = True
        r.down = asyncio.Event()
        state.ring.add(r.name)
    app = build_router_app(state, api_key="k", access_log=False)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                               headers={"Authorization": "Bearer k"})
    return client, state


BODY = {"prompt": "hi", "max_tokens": 2}


def test_every_replica_full_gives_back_429_with_retry_after() -> None:
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.host)
        assert req.headers["authorization"] == "Bearer k"  # the router's key goes on
        return httpx.Response(429, headers={"Retry-After": "3"}, json={"error": {
            "message": "full", "type": "rate_limit_error", "param": None,
            "code": "queue_full"}})

    async def go():
        client, _ = _router(handler)
        return await client.post("/v1/completions", json=BODY)

    r = asyncio.run(go())
    assert sorted(seen) == ["replica-a", "replica-b"]  # both tried
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "queue_full"


def test_unreachable_replica_is_left_for_another() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "replica-a":
            raise httpx.ConnectError("refused", request=req)
        return httpx.Response(200, json={"ok": req.url.host})

    async def go():
        client, state = _router(handler)
        out = [await client.post("/v1/completions", json=BODY) for _ in range(3)]
        return out, state

    out, state = asyncio.run(go())
    assert all(r.status_code == 200 and r.json() == {"ok": "replica-b"} for r in out)
    assert all(r.headers["x-kvserve-replica"] == "r1" for r in out)
    assert not state.pool.replicas["r0"].healthy  # failed requests count as failed checks
    assert all(r.inflight == 0 for r in state.pool.replicas.values())


def test_no_replica_is_an_openai_shaped_503() -> None:
    async def go():
        client, state = _router(lambda req: httpx.Response(200))
        for r in state.pool.replicas.values():
            r.healthy = False
        return await client.post("/v1/chat/completions", json=BODY)

    r = asyncio.run(go())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "no_replica_available" and err["type"] == "server_error"


def test_a_stream_cut_after_it_started_ends_with_an_error_event_and_done() -> None:
    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi'
            raise httpx.ReadError("connection reset")

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Cut())

    async def go():
        client, state = _router(handler)
        r = await client.post("/v1/completions", json={**BODY, "stream": True})
        return r, state

    r, state = asyncio.run(go())
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] == 'data: {"choices": [{"text": "a"}]}'  # whole events only
    err = json.loads(events[1].removeprefix("data: "))["error"]
    assert err["code"] == "replica_failed"
    assert events[2] == "data: [DONE]" and len(events) == 3
    assert all(x.inflight == 0 for x in state.pool.replicas.values())
