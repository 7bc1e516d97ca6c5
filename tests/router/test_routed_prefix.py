"""The router learns from the prompts it routes (fake replicas, httpx MockTransport, no
processes, no KV events): a second request sharing a long prefix follows the first one to its
replica; a request re-routed after a 503 is recorded only where it ran; the prefill leg of a
disaggregated request is recorded in the prefill index; ``routed_prefix_ttl=0`` routes as
before (by load)."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from kvserve.config_cli import add_cli_args, from_cli_args
from kvserve.router.app import RouterState, build_router_app
from kvserve.router.settings import RouterSettings
from tests.server.conftest import metric

BLOCK = 4
DOC = "The shared system prompt of every request here, long enough for many blocks. "
Q1, Q2 = "First question?", "Second question?"
# hand-worked, one token per character: DOC is 77 tokens, so 19 whole blocks are shared (the
# 20th mixes DOC's last character with the question); the prompts of 92 and 93 tokens have
# 91 // 4 = 22 and 92 // 4 = 23 blocks an engine could hit: 22 + 23 - 19 = 26 distinct keys
assert len(DOC) == 77 and len(DOC + Q1) == 92 and len(DOC + Q2) == 93
ROUTED = 26


class Chars:
    """A tokenizer of one token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


class Events(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'data: {"choices": []}\n\ndata: [DONE]\n\n'


async def _router(handler, **settings) -> tuple[httpx.AsyncClient, RouterState]:
    """Both pools' replicas joined as the health checks join them: their ``GET /kv_events``
    tells the block size, and no KV event ever arrives."""
    state = RouterState(RouterSettings(**settings), "k", Chars())
    transport = httpx.MockTransport(handler)
    state.client = httpx.AsyncClient(transport=transport)

    for pool in (state.pool, state.prefill_pool):
        if pool is not None:
            pool._client = httpx.AsyncClient(transport=transport)
            for r in pool.replicas.values():
                await pool._join(r)
    app = build_router_app(state, api_key="k", access_log=False)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                               headers={"Authorization": "Bearer k"})
    return client, state


def _replica_info(req: httpx.Request) -> httpx.Response | None:
    if req.url.path == "/kv_events":
        return httpx.Response(200, json={"endpoint": None, "replay_endpoint": None,
                                         "block_size": BLOCK})
    if req.url.path == "/openapi.json":
        return httpx.Response(200, json={"info": {}})
    return None


def _colocated(ttl: float, fail_first: str | None = None) -> tuple[list[str], RouterState]:
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if (info := _replica_info(req)) is not None:
            return info
        seen.append(req.url.host)
        if req.url.host == fail_first and seen.count(fail_first) == 1:
            return httpx.Response(503, json={"error": {"message": "draining"}})
        if b'"stream": true' in req.content or b'"stream":true' in req.content:
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=Events())
        return httpx.Response(200, json={"ok": req.url.host})

    async def go() -> RouterState:
        client, state = await _router(handler, replicas=("http://replica-a", "http://replica-b"),
                                routed_prefix_ttl=ttl)
        async with client:
            r = await client.post("/v1/completions", json={
                "prompt": DOC + Q1, "max_tokens": 2, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            r = await client.post("/v1/completions",
                                  json={"prompt": DOC + Q2, "max_tokens": 2})
            assert r.status_code == 200
        return state

    state = asyncio.run(go())
    assert state.index.block_size == BLOCK and state.index.num_blocks("r0") == 0
    return seen, state


def test_a_shared_prefix_follows_the_replica_it_was_routed_to() -> None:
    seen, state = _colocated(ttl=60.0)
    # both idle: the first goes by load (the rotation's first turn, r0), the second by prefix
    assert seen == ["replica-a", "replica-a"]
    assert state.index.num_routed("r0") == ROUTED
    assert state.index.match(Chars().encode(DOC + "Third?")) == {"r0": 19 * BLOCK}
    assert state.index.num_routed("r1") == 0


def test_without_routed_prefixes_both_go_by_load() -> None:
    seen, state = _colocated(ttl=0.0)
    assert seen == ["replica-a", "replica-b"]  # the idle rotation: no prefix known
    assert state.index.num_routed("r0") == state.index.num_routed("r1") == 0


def test_a_rerouted_request_is_recorded_only_where_it_ran() -> None:
    seen, state = _colocated(ttl=60.0, fail_first="replica-a")
    # the first: r0 answers 503, r1 runs it; the second follows it to r1
    assert seen == ["replica-a", "replica-b", "replica-b"]
    assert state.index.num_routed("r0") == 0 and state.index.num_routed("r1") > 0


def test_the_prefill_leg_is_recorded_in_the_prefill_index() -> None:
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if (info := _replica_info(req)) is not None:
            return info
        seen.append(req.url.host)
        if req.url.host.startswith("prefill"):
            if req.url.host == "prefill-a" and seen.count("prefill-a") == 1:
                return httpx.Response(503, json={"error": {"message": "draining"}})
            return httpx.Response(200, json={"kv_transfer": {"handle": "h", "token": 1}})
        assert b'"role": "decode"' in req.content  # the split's decode leg
        return httpx.Response(200, json={"ok": req.url.host})

    async def go() -> tuple[RouterState, str]:
        client, state = await _router(handler, prefill=("http://prefill-a", "http://prefill-b"),
                                decode=("http://decode-a",), routed_prefix_ttl=60.0)
        async with client:
            for q in (Q1, Q2):
                r = await client.post("/v1/completions",
                                      json={"prompt": DOC + q, "max_tokens": 4})
                assert r.status_code == 200
            text = (await client.get("/metrics")).text
        return state, text

    state, text = asyncio.run(go())
    # the first prompt: p0 answers 503, p1 prefills it; the second follows it to p1 by prefix
    assert seen == ["prefill-a", "prefill-b", "decode-a", "prefill-b", "decode-a"]
    assert metric(text, 'kvserve_router_routing_decisions_total{reason="prefix",'
                  'replica="p1"}') == 1
    assert state.prefill_index.num_routed("p0") == 0
    assert state.prefill_index.num_routed("p1") == ROUTED
    assert state.index.num_routed("r0") == ROUTED  # and the decode replica that answered


def test_the_ttl_flag() -> None:
    p = argparse.ArgumentParser()
    add_cli_args(p, RouterSettings)
    url = ["--replica", "http://a"]
    assert from_cli_args(RouterSettings, p.parse_args(url)).routed_prefix_ttl == 60.0
    ns = p.parse_args([*url, "--routed-prefix-ttl", "0"])
    assert from_cli_args(RouterSettings, ns).routed_prefix_ttl == 0.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="routed_prefix_ttl"):
            RouterSettings(replicas=("http://a",), routed_prefix_ttl=bad)
