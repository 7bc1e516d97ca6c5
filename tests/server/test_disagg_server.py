"""Disaggregation legs over HTTP (kvserve/server/disagg.py): a prefill-role server answers the
first token and a handle; a decode-role server given them answers what a colocated server
answers -- chat and completions, streamed and not, with logprobs and stop strings."""

from __future__ import annotations

import json
import time

import pytest

from tests.server.conftest import MODEL_NAME, metric

BODIES = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "The quick brown fox jumps over the "
                        "lazy dog and then", "max_tokens": 8, "temperature": 0,
                        "logprobs": 2, "ignore_eos": True},
    "/v1/chat/completions": {"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "Tell me a story about a dog and a cat."}],
        "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "ignore_eos": True},
}


def _strip(d: dict) -> dict:
    d = dict(d)
    for k in ("id", "created"):
        d.pop(k, None)
    return d


async def _sse(client, path: str, body: dict) -> list[dict]:
    r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def _text(chunks: list[dict]) -> str:
    parts = []
    for c in chunks:
        for ch in c["choices"]:
            parts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return "".join(parts)


@pytest.mark.parametrize("path", list(BODIES))
def test_legs_equal_colocated(inprocess, tmp_path, path):
    kw = {"kv_transfer": "dir", "kv_transfer_dir": str(tmp_path)}
    colo = inprocess()
    pre = inprocess(engine_kw=kw, role="prefill")
    dec = inprocess(engine_kw=kw, role="decode")
    body = BODIES[path]

    async def go():
        async with colo.client() as c, pre.client() as p, dec.client() as d:
            want = (await c.post(path, json=body)).json()
            want_stream = await _sse(c, path, body)
            got = []
            for stream in (False, True):
                r = await p.post(path, json={**body, "kv_transfer": {"role": "prefill"}})
                assert r.status_code == 200, r.text
                leg = r.json()["kv_transfer"]
                assert leg["handle"]["num_tokens"] == r.json()["usage"]["prompt_tokens"]
                dbody = {**body, "kv_transfer": {"role": "decode", **leg}}
                if stream:
                    got.append(await _sse(d, path, dbody))
                else:
                    got.append((await d.post(path, json=dbody)).json())
            # a decode-role server refuses a prefill leg, naming the field
            r = await d.post(path, json={**body, "kv_transfer": {"role": "prefill"}})
            assert r.status_code == 400 and "kv_transfer.role" in r.text
            return want, want_stream, got

    want, want_stream, (full, chunks) = colo.run(go())
    assert _strip(full)["choices"] == _strip(want)["choices"]
    assert full["usage"] == want["usage"]
    assert _text(chunks) == _text(want_stream) == (
        want["choices"][0].get("text") or want["choices"][0]["message"]["content"])
    st = dec.engine.snapshot().kv_transfer
    assert st["blocks_installed"] > 0 and not st["rejected"] and not st["fallbacks"]

    async def scrape(srv):
        async with srv.client() as c:
            return (await c.get("/metrics")).text

    text = colo.run(scrape(dec))
    assert metric(text, "kvserve_kv_transfer_blocks_installed_total") == st["blocks_installed"]
    assert 'kvserve_kv_transfer_bytes_total{direction="received"}' in text
    assert "kvserve_kv_transfer_seconds_bucket" in text
    text = colo.run(scrape(pre))
    assert metric(text, "kvserve_kv_transfer_exported_total") == 2  # the two legs above
    deadline = time.monotonic() + 10  # the snapshot is the engine thread's latest
    while metric(text, "kvserve_kv_transfer_outstanding") and time.monotonic() < deadline:
        time.sleep(0.1)
        text = colo.run(scrape(pre))
    assert metric(text, "kvserve_kv_transfer_outstanding") == 0  # both confirmed


def test_decode_leg_reports_the_prefill_replicas_cached_tokens(inprocess, tmp_path):
    """usage.prompt_tokens_details.cached_tokens of a split request counts the prefill
    replica's prefix-cache hits; the blocks the decode replica received are not hits."""
    kw = {"kv_transfer": "dir", "kv_transfer_dir": str(tmp_path)}
    pre = inprocess(engine_kw=kw, role="prefill")
    dec = inprocess(engine_kw=kw, role="decode")
    body = {"model": MODEL_NAME, "prompt": " ".join(f"w{i}" for i in range(100, 140)),
            "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def prefill(p) -> dict:
        r = await p.post("/v1/completions", json={**body, "kv_transfer": {"role": "prefill"}})
        leg = r.json()["kv_transfer"]
        assert leg["cached_tokens"] == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return {**body, "kv_transfer": {"role": "decode", **leg}}

    async def go():
        # each decode leg gets a prefill leg of its own (a transfer is consumed by the decode
        # that imports it); the prefill legs after the first hit the first one's blocks
        async with pre.client() as p, dec.client() as d:
            out = []
            for _ in range(2):
                dbody = await prefill(p)
                full = (await d.post("/v1/completions", json=dbody)).json()
                sbody = await prefill(p)
                chunks = await _sse(d, "/v1/completions", {
                    **sbody, "stream_options": {"include_usage": True}})
                out.append((dbody["kv_transfer"]["cached_tokens"], full["usage"],
                            sbody["kv_transfer"]["cached_tokens"], chunks[-1]["usage"]))
            return out

    (c0, u0, cs0, s0), (c1, u1, cs1, s1) = pre.run(go())
    prompt = u0["prompt_tokens"]
    hit = (prompt - 1) // 16 * 16
    assert c0 == 0 and hit > 0 and cs0 == c1 == cs1 == hit
    for c, u in ((c0, u0), (cs0, s0), (c1, u1), (cs1, s1)):
        assert u["prompt_tokens_details"]["cached_tokens"] == c
