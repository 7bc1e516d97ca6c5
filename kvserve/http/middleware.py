"""Pure-ASGI middleware: access log, HTTP error counting (and the last-resort 500), API-key
checks, request body size limit.

Order (outermost first): ``AccessLog`` -> ``ErrorCounter`` -> ``APIKeyAuth`` -> ``BodyLimit``
-> the app, so 401s, 413s and 500s are counted and logged and an unauthenticated client never
gets its body read.
"""

from __future__ import annotations

import hmac
import json
import logging
import posixpath
import time
from urllib.parse import unquote

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.http.errors import error_body

logger = logging.getLogger("kvserve.http")
access_logger = logging.getLogger("kvserve.access")
CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it
GENERATION_KEY = "kvserve.generation"  # in the ASGI scope: the request's Generation, for the log
# Paths that stay open when an API key is set; everything else needs the key.
OPEN_PATHS = frozenset({"/health", "/ready", "/version", "/metrics"})


async def send_error(send: Send, status: int, message: str, *, type: str, code: str,
                     headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, type=type, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def normalize_path(path: str) -> str:
    """Canonical form for access decisions: percent-decoded (repeatedly), backslashes as
    slashes, duplicate slashes collapsed, dot segments resolved, no trailing slash."""
    for _ in range(4):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    path = path.replace("\\", "/")
    path = posixpath.normpath("/" + path)
    return "/" + path.lstrip("/")


class AccessLog:
    """One ``kvserve.access`` INFO line per HTTP request once it is fully answered:
    client, method, path, status, latency and, for generation requests, tokens. A client that
    left before any answer is logged with status 499. Subclasses (the router's) change what
    runs around the app (``serve``) and what the line adds (``describe``)."""

    def __init__(self, app: ASGIApp, log: bool = True) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = CLIENT_CLOSED

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.serve(scope, receive, recording_send)
        finally:
            extra = self.describe(scope, status)
            if self.log:
                client = scope.get("client")
                access_logger.info('%s "%s %s" %d %.3fs%s',
                                   f"{client[0]}:{client[1]}" if client else "-",
                                   scope.get("method", "-"), scope.get("path", "-"), status,
                                   time.perf_counter() - start, extra)

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    def describe(self, scope: Scope, status: int) -> str:
        """What the line adds after the latency (called once the request was answered, whether
        or not the line is logged)."""
        gen = scope.get(GENERATION_KEY)
        return "" if gen is None else (f" prompt_tokens={gen.num_prompt_tokens}"
                                       f" completion_tokens={gen.num_generated_tokens}")


class ErrorCounter:
    """Counts responses >= 400 by status, and answers any exception that escapes the app with
    an OpenAI-shaped 500 (counted like the rest; the traceback goes to the log once)."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.counter.labels(str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            logger.exception("unhandled error answering %s %s", scope.get("method"),
                             scope.get("path"))
            if not started:  # after the headers nothing can be said; the body just ends
                await send_error(counting_send, 500, "internal server error",
                                 type="server_error", code="internal_error")


class APIKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                    return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = scope.get("raw_path")
        paths = {normalize_path(scope.get("path", "/"))}
        if raw:
            paths.add(normalize_path(raw.split(b"?", 1)[0].decode("latin-1")))
        if not paths <= OPEN_PATHS and not self._authorized(scope):
            return await send_error(send, 401, "missing or invalid API key (send "
                                    "'Authorization: Bearer <key>')",
                                    type="authentication_error", code="invalid_api_key",
                                    headers={"WWW-Authenticate": "Bearer"})
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads the whole body first (at most ``max_bytes``), then replays it to the app.

    A declared Content-Length over the limit is refused before reading; a chunked body is
    refused as soon as it passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body exceeds the {self.max_bytes}-byte limit"
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await send_error(send, 400, "invalid Content-Length header",
                                            type="invalid_request_error",
                                            code="invalid_content_length")
                if declared > self.max_bytes:
                    return await send_error(send, 413, too_large,
                                            type="invalid_request_error",
                                            code="request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away while sending
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await send_error(send, 413, too_large, type="invalid_request_error",
                                        code="request_too_large")
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks),
                                  "more_body": False}]

        async def replaying_receive() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replaying_receive, send)
