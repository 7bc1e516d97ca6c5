"""One access log line per HTTP request (issue 15, item 8), on the shared server. The
``--no-access-log`` side is checked in ``test_forced_shutdown``."""

from __future__ import annotations

import re
import time

from tests.server.conftest import MODEL_NAME

LINE = re.compile(r'INFO kvserve\.access: 127\.0\.0\.1:\d+ "(\w+) (\S+)" (\d{3}) '
                  r'(\d+\.\d{3})s(?: prompt_tokens=(\d+) completion_tokens=(\d+))?$')


def _new_lines(server, before: str) -> list[re.Match]:
    deadline = time.monotonic() + 5
    while True:
        text = server.log()[len(before):]
        lines = [m for m in map(LINE.match, text.splitlines()) if m]
        if len(lines) >= 4 or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_one_access_line_per_request(main_server, client):
    before = main_server.log()
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "w1 w2 w3",
                                             "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    usage = r.json()["usage"]
    with client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "w1"}],
            "max_tokens": 3, "ignore_eos": True, "stream": True}) as s:
        assert s.status_code == 200
        s.read()
    assert client.post("/v1/completions", json={"prompt": ""}).status_code == 400
    assert client.get("/health").status_code == 200
    # a line is written once its request's app returns, which for a stream can be after the
    # client has read it to the end and sent the next request: lines by request, not in order
    raw = _new_lines(main_server, before)
    lines = {(m[1], m[2], m[3]): m for m in raw}
    assert len(raw) == 4
    assert sorted(lines) == [
        ("GET", "/health", "200"), ("POST", "/v1/chat/completions", "200"),
        ("POST", "/v1/completions", "200"), ("POST", "/v1/completions", "400")]
    first, stream = lines["POST", "/v1/completions", "200"], lines[
        "POST", "/v1/chat/completions", "200"]
    assert int(first[5]) == usage["prompt_tokens"] and int(first[6]) == 5
    assert float(first[4]) > 0
    assert stream[6] == "3"
    # no tokens: never reached the engine
    assert lines["POST", "/v1/completions", "400"][5] is None
    assert lines["GET", "/health", "200"][5] is None
