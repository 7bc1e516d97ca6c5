"""A forced shutdown ends streams properly (issue 15, item 4).

When ``--drain-timeout`` passes with streams still running, or on a second SIGTERM, every
stream gets a final chunk per unfinished choice with ``finish_reason: "abort"`` (and its usage
chunk when asked for) and ``data: [DONE]``; the process exits 0 without a traceback. Before,
the streams were cut mid-body (``incomplete chunked read``) with one ``CancelledError``
traceback each.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess, demo_model

# slow: servers started and drained with signals
pytestmark = pytest.mark.slow

STREAMS = [
    ("/v1/completions", {"prompt": "The dict", "n": 2}),
    ("/v1/completions", {"prompt": ["The list", "A tuple"],
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is a set?"}],
                              "stream_options": {"include_usage": True}}),
]


def _read(url: str, path: str, extra: dict, out: dict) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 1500, "ignore_eos": True, "stream": True,
            **extra}
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", url + path, json=body) as r:
            out["status"] = r.status_code
            out["events"] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
    except httpx.HTTPError as e:  # e.g. RemoteProtocolError: incomplete chunked read
        out["error"] = repr(e)


def _run(server: ServerProcess, signals: int) -> list[dict]:
    results = [{} for _ in STREAMS]
    threads = [threading.Thread(target=_read, args=(server.url, path, extra, out))
               for (path, extra), out in zip(STREAMS, results, strict=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(len(r.get("events", ())) >= 3 for r in results):
        assert time.monotonic() < deadline, results
        time.sleep(0.02)
    t0 = time.monotonic()
    for _ in range(signals):
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
    for t in threads:
        t.join(30)
    assert server.proc.wait(timeout=30) == 0, server.log()
    print(f"\nstreams ended and the server exited {time.monotonic() - t0:.2f} s after the "
          "first SIGTERM")
    return results


def _check_ended_with_abort(results: list[dict], log: str) -> None:
    for (path, extra), r in zip(STREAMS, results, strict=True):
        assert "error" not in r, r.get("error")
        assert r["status"] == 200
        events = r["events"]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        choices = 2 if (extra.get("n") == 2 or isinstance(extra.get("prompt"), list)) else 1
        reasons = {}
        for c in chunks:
            for ch in c["choices"]:
                if ch["finish_reason"]:
                    reasons[ch["index"]] = ch["finish_reason"]
        assert reasons == dict.fromkeys(range(choices), "abort"), (path, reasons)
        if extra.get("stream_options"):
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert "Traceback" not in log and "CancelledError" not in log, log


@pytest.fixture
def make_server():
    made: list[ServerProcess] = []

    def make(*args: str) -> ServerProcess:
        server = ServerProcess(demo_model(), "--step-delay", "0.01", *args)
        made.append(server)
        return server.wait_healthy()

    yield make
    for server in made:
        server.stop()


def test_drain_timeout_ends_streams_with_abort_and_done(make_server):
    server = make_server("--drain-timeout", "1")
    results = _run(server, signals=1)
    log = server.log()
    _check_ended_with_abort(results, log)
    assert "drain timeout: ending 3 in-flight request(s)" in log


def test_second_sigterm_ends_streams_with_abort_and_done(make_server):
    server = make_server("--drain-timeout", "60", "--no-access-log")
    t0 = time.monotonic()
    results = _run(server, signals=2)
    assert time.monotonic() - t0 < 20  # not the 60 s drain timeout
    log = server.log()
    _check_ended_with_abort(results, log)
    assert "second SIGTERM" in log
    assert "kvserve.access" not in log  # --no-access-log (item 8)
