"""SIGTERM: stop accepting (/ready 503, new requests 503), finish in-flight streams, exit 0.

Runs on the shared server, which it shuts down: the ``server_shutdown`` marker makes it the
session's last test (see conftest)."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME

# slow: a server drained with SIGTERM
pytestmark = pytest.mark.slow

TOKENS = 300  # ~1 s or more at the shared server's step delay
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.server_shutdown
def test_sigterm_drains_in_flight_requests_then_exits_0(main_server):
    srv = main_server
    body = {"model": MODEL_NAME, "prompt": "w1 w2 w3", "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=srv.url, timeout=60, headers=AUTH) as c, \
            c.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert json.loads(first[6:])["choices"][0]["text"]

        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        with httpx.Client(base_url=srv.url, timeout=10, headers=AUTH) as probe:
            while probe.get("/ready").status_code != 503:
                assert time.monotonic() < deadline, "/ready never turned 503"
                time.sleep(0.01)
            assert probe.get("/health").status_code == 200
            refused = probe.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "shutting_down"

        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        done = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        assert done and done[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == TOKENS
    assert srv.proc.wait(timeout=60) == 0, srv.log()
    assert "drained" in srv.log()
