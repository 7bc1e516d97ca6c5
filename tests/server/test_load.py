"""Load on the real server: 64 concurrent streams, a quarter of the clients hang up
mid-stream; then the server must be idle with every KV block free. Also the bench client."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.bench.serve_bench import main as bench_main
from kvserve.bench.serve_bench import run_serve_bench
from tests.server.conftest import API_KEY, MODEL_NAME, assert_ok, metric, wait_idle

# slow: 64 concurrent streams through a server
pytestmark = pytest.mark.slow

CLIENTS = 64
SURVIVOR_TOKENS = 24


async def _stream(client: httpx.AsyncClient, i: int, hang_up: bool) -> dict:
    chat = i % 2 == 0
    body = {"model": MODEL_NAME, "stream": True, "ignore_eos": True, "temperature": 1.0,
            "seed": i, "max_tokens": 300 if hang_up else SURVIVOR_TOKENS,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"}]
    else:
        body["prompt"] = f"w{i} w{i + 1} w{i + 2}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    result = {"status": None, "done": False, "finish": None, "tokens": None, "chunks": 0}
    async with client.stream("POST", path, json=body) as r:
        result["status"] = r.status_code
        if r.status_code != 200:
            return result
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                result["tokens"] = event["usage"]["completion_tokens"]
            for ch in event["choices"]:
                result["chunks"] += 1
                result["finish"] = ch["finish_reason"] or result["finish"]
            if hang_up and result["chunks"] >= 3:
                return result  # leaves the stream: the connection is closed mid-body
    return result


def test_64_streams_with_disconnects_leave_no_trace(main_server, client):
    async def main():
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=main_server.url, limits=limits, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            return await asyncio.gather(*(_stream(c, i, hang_up=i % 4 == 3)
                                          for i in range(CLIENTS)))

    results = asyncio.run(main())
    assert all(r["status"] == 200 for r in results), [r["status"] for r in results]
    survivors = [r for i, r in enumerate(results) if i % 4 != 3]
    quitters = [r for i, r in enumerate(results) if i % 4 == 3]
    assert len(survivors) == 48 and len(quitters) == 16
    for r in survivors:
        assert r["done"] and r["finish"] == "length" and r["tokens"] == SURVIVOR_TOKENS, r
    assert all(not r["done"] for r in quitters)

    text = wait_idle(lambda: client.get("/metrics").text)
    assert metric(text, "kvserve_kv_blocks_free") == metric(text, "kvserve_kv_blocks_total")
    assert metric(text, "kvserve_num_unfinished_requests") == 0
    assert metric(text, 'kvserve_requests_finished_total{finish_reason="abort"}') >= 16
    assert not any(line.startswith('kvserve_http_errors_total{status="5')
                   for line in text.splitlines())
    assert metric(text, "kvserve_time_to_first_token_seconds_count") >= CLIENTS
    assert httpx.get(main_server.url + "/ready").json()["in_flight"] == 0
    assert_ok(client)


def test_serve_bench_reports(main_server, tmp_path):
    out = tmp_path / "bench.json"
    report = run_serve_bench(main_server.url, concurrency=8, requests=16, max_tokens=8,
                             prompt="w1 w2 w3 w4", api_key=API_KEY, json_out=str(out))
    assert report["completed"] == 16 and report["failed"] == 0, report["errors"]
    assert report["total_output_tokens"] == 16 * 8
    assert report["output_throughput_tok_s"] > 0
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        stats = report[key]
        assert stats["p50"] <= stats["p90"] <= stats["p99"]
    assert json.loads(out.read_text())["completed"] == 16
    chat = run_serve_bench(main_server.url, concurrency=4, requests=4, max_tokens=4,
                           chat=True, api_key=API_KEY)
    assert chat["completed"] == 4
    bad = run_serve_bench(main_server.url, concurrency=2, requests=2, max_tokens=4,
                          model=MODEL_NAME, api_key="wrong")
    assert bad["failed"] == 2 and bad["errors"] == {"http_401": 2}
    cli_out = tmp_path / "cli.json"
    assert bench_main(["--url", main_server.url, "--concurrency", "2", "--requests", "2",
                       "--max-tokens", "3", "--api-key", API_KEY, "--json", str(cli_out)]) == 0
    assert json.loads(cli_out.read_text())["total_output_tokens"] == 6


def _counter(text: str, name: str) -> float:
    try:
        return metric(text, name)
    except KeyError:
        return 0.0


def test_non_streaming_client_that_hangs_up_is_aborted(main_server, client):
    aborted = 'kvserve_requests_finished_total{finish_reason="abort"}'
    before = client.get("/metrics").text
    body = {"model": MODEL_NAME, "prompt": "w7 w8", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(main_server.url + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(30, read=0.5))
    after = wait_idle(lambda: client.get("/metrics").text)
    generated = metric(after, "kvserve_generation_tokens_total") - \
        metric(before, "kvserve_generation_tokens_total")
    assert generated < 480  # stopped early: aborted, not run to the end
    assert _counter(after, aborted) == _counter(before, aborted) + 1
    assert_ok(client)
