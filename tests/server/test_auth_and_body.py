"""API key on every /v1 path variant and the request body size limit, on the real server."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, assert_ok

BODY = json.dumps({"model": MODEL_NAME, "prompt": "w1 w2", "max_tokens": 2}).encode()


def raw_request(url: str, method: str, target: str, headers: dict[str, str] | None = None,
                body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request with the request target sent byte-for-byte (clients would
    normalize ``..`` and ``//`` away)."""
    host, port = url.removeprefix("http://").split(":")
    head = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


VARIANTS = [
    ("GET", "/v1/models"), ("GET", "/v1/models/"), ("GET", "//v1/models"),
    ("GET", "/v1//models"), ("GET", "/v1/../v1/models"), ("GET", "/./v1/models"),
    ("GET", "/%2Fv1/models"), ("GET", "/%76%31/models"), ("GET", "/v1%2Fmodels"),
    ("GET", "/V1/models"), ("GET", "/health/../v1/models"), ("GET", "/v1/models?x=1"),
    ("POST", "/v1/completions"), ("POST", "/v1/completions/"), ("POST", "//v1/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/../v1/chat/completions"),
    ("GET", "/openapi.json"), ("GET", "/docs"),
]


@pytest.mark.parametrize(("method", "target"), VARIANTS,
                         ids=[f"{m} {t}" for m, t in VARIANTS])
def test_api_key_required_on_every_variant(main_server, client, method, target):
    body = BODY if method == "POST" else b""
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}x"}):
        status, payload = raw_request(main_server.url, method, target, headers, body)
        assert status == 401, (target, headers, payload)
        assert json.loads(payload)["error"]["type"] == "authentication_error"
    assert_ok(client)


def test_right_key_passes_and_health_stays_open(main_server, client):
    status, _ = raw_request(main_server.url, "GET", "/v1/models",
                            {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200
    status, _ = raw_request(main_server.url, "GET", "/v1/models",
                            {"Authorization": f"bearer {API_KEY}"})
    assert status == 200
    for path in ("/health", "/ready", "/version", "/metrics"):
        assert httpx.get(main_server.url + path).status_code == 200, path
    assert_ok(client)


def test_body_over_limit_with_content_length_is_413(client):
    big = json.dumps({"model": MODEL_NAME, "prompt": "w1 " * 30000, "max_tokens": 2})
    assert len(big) > 65536
    r = client.post("/v1/completions", content=big,
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert_ok(client)


def test_declared_length_over_limit_refused_before_reading(main_server, client):
    host, port = main_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}"
                  "\r\nContent-Type: application/json\r\nContent-Length: 99999999\r\n\r\n"
                  .encode())  # no body follows: the answer must not wait for it
        assert s.recv(65536).split(b" ", 2)[1] == b"413"
    assert_ok(client)


def test_chunked_body_over_limit_is_413(client):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"w1 " * 1000
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(),
                    headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 413
    assert_ok(client)


def test_chunked_body_under_limit_works(client):
    def chunks():
        yield BODY[:10]
        yield BODY[10:]

    r = client.post("/v1/completions", content=chunks(),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
