"""`kvserve bench serve`'s client against a scripted HTTP server (no model): how it reads SSE
bodies that arrive in pieces, what it measures and how it counts each kind of failure."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvserve.bench.serve_bench import main as bench_main
from kvserve.bench.serve_bench import run_serve_bench

TOKENS = 5


def _event(d: dict, eol: bytes = b"\n") -> bytes:
    return b"data: " + json.dumps(d).encode() + eol + eol


def _chunk(i: int) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": f" t{i}", "finish_reason": None}], "usage": None}


class Scripted:
    """Answers ``GET /v1/models`` and streams ``POST``s by the request's ``prompt``: "ok" (the
    tokens, each event cut in two writes, then usage and [DONE]), "crlf" (the same with CRLF
    lines), "error" (an error event), "cut" (no [DONE]), "stall" (nothing for 5 s), "deny"
    (401). Records each request's headers and body."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], dict]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                lines = head.split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in
                           (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if lines[0].startswith("GET"):
                    data = json.dumps({"data": [{"id": "base"},
                                                {"id": "sql", "parent": "base"}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
                    continue
                req = json.loads(body)
                self.requests.append((headers, req))
                await self._stream(writer, req["prompt"])
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, kind: str) -> None:
        if kind == "deny":
            writer.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 2\r\n\r\n{}")
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")

        async def send(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(0.002)  # a read of its own

        if kind == "stall":
            await asyncio.sleep(5)
        eol = b"\r\n" if kind == "crlf" else b"\n"
        for i in range(TOKENS):
            ev = _event(_chunk(i), eol)
            await send(ev[:9])  # an event cut between reads
            await send(ev[9:] + (b": keep-alive\n\n" if i == 1 else b""))
            if kind == "error" and i == 2:
                await send(_event({"error": {"message": "x", "code": "overloaded"}}))
                break
        if kind in ("ok", "crlf"):
            await send(_event({"id": "cmpl-1", "choices": [], "usage": {
                "prompt_tokens": 3, "completion_tokens": TOKENS, "total_tokens": 3 + TOKENS}}))
            await send(b"data: [DONE]" + eol + eol)
        writer.write(b"0\r\n\r\n")

    def close(self) -> None:
        async def shut() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(shut(), self.loop)
        self.thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    s = Scripted()
    yield s
    s.close()


def test_streams_read_in_pieces_are_measured(scripted):
    for kind in ("ok", "crlf"):
        r = run_serve_bench(scripted.url, concurrency=2, requests=3, max_tokens=TOKENS,
                            prompt=kind, api_key="k3y", traceparent=True, seed=4)
        assert r["completed"] == 3 and r["failed"] == 0 and r["errors"] == {}, r
        assert r["total_output_tokens"] == 3 * TOKENS  # from the usage events
        assert r["models"] == {"base": 3}  # the first of /v1/models
        ttft, itl = r["ttft_ms"], r["itl_ms"]
        assert ttft["p50"] > 0 and itl["p50"] > 0
        assert ttft["p50"] <= ttft["p99"] and itl["p50"] <= itl["p99"]
    headers, body = scripted.requests[-1]
    assert headers["authorization"] == "Bearer k3y"
    assert headers["traceparent"].startswith("00-") and headers["traceparent"].endswith("-01")
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == TOKENS
    assert body["stream_options"] == {"include_usage": True}
    assert sorted(b["seed"] for _, b in scripted.requests[-3:]) == [4, 5, 6]


def test_failures_are_counted_by_kind(scripted):
    for kind, error in (("error", "stream_overloaded"), ("cut", "stream_ended_without_done"),
                        ("deny", "http_401")):
        r = run_serve_bench(scripted.url, concurrency=2, requests=2, max_tokens=TOKENS,
                            prompt=kind, model="base")
        assert r["completed"] == 0 and r["errors"] == {error: 2}, (kind, r)
    t0 = time.perf_counter()
    r = run_serve_bench(scripted.url, concurrency=1, requests=1, max_tokens=TOKENS,
                        prompt="stall", model="base", timeout=0.3)
    assert time.perf_counter() - t0 < 4  # the read timeout, not the stall's end
    [(error, count)] = r["errors"].items()
    assert count == 1 and error.startswith("exception_") and "Timeout" in error, error


def test_lora_mix_spreads_requests_over_the_listed_adapters(scripted):
    r = run_serve_bench(scripted.url, concurrency=2, requests=4, max_tokens=TOKENS,
                        prompt="ok", lora_mix="all")
    assert r["models"] == {"sql": 4} and r["completed"] == 4
    with pytest.raises(ValueError, match="lora_mix"):
        run_serve_bench(scripted.url, concurrency=1, requests=1, prompt="ok", lora_mix="zz")


def test_cli_reports_an_unreachable_server(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert bench_main(["--url", f"http://127.0.0.1:{port}", "--requests", "1"]) == 1
    assert "cannot reach" in capsys.readouterr().err
