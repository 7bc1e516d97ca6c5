"""``build_router_app``: the OpenAI endpoint in front of the replicas (an async HTTP proxy).

Each generation request is routed (``kvserve.router.policy``, a prefill leg first where it
plans one) to a healthy replica and relayed as it comes back, server-sent events included.
What a client sees when things fail:

  * A request is *started* once its replica answers with headers (a kvserve replica answers
    only after the first token, or with an error). Until then it is re-routed to another
    replica, up to ``max_attempts``: when the connection fails, the replica leaves the pool
    (dies, hangs past its health checks), or it answers 503 (draining, engine dead) or 429
    (full; the last 429 with its ``Retry-After`` goes back when every replica is full).
    A non-streaming request is re-routed the same way until its whole body has arrived:
    generation has no side effects and nothing has reached the client.
  * A stream whose replica fails after it started ends with an OpenAI-shaped error event
    (``code: "replica_failed"``) and ``data: [DONE]``, at an event boundary.
  * The router itself never answers with a bare 5xx: every error is OpenAI-shaped JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.http.errors import error_body, error_response, http_error_handler
from kvserve.http.middleware import AccessLog, APIKeyAuth, BodyLimit, ErrorCounter
from kvserve.http.openapi import ERRORS, GENERATION_RESPONSES, add_metrics_and_version, publish
from kvserve.http.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from kvserve.router.hashing import HashRing
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policy import Candidate, Decision, decide, plan
from kvserve.router.prefix_index import PrefixIndex
from kvserve.router.replicas import Replica, ReplicaPool
from kvserve.router.settings import RouterSettings
from kvserve.version import __version__

logger = logging.getLogger("kvserve.router")
ROUTE_KEY = "kvserve.route"  # in the ASGI scope: {"replica", "reason", "attempts"}
_FORWARD_REQ = ("content-type", "accept", "x-request-id", "openai-organization")
_FORWARD_RESP = ("content-type", "retry-after", "cache-control", "x-request-id",
                 "x-accel-buffering")
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class _Gone(Exception):
    """The replica left the pool, or the router is ending every request."""


def prompt_token_ids(tokenizer: Any, payload: dict) -> list[int] | None:
    """The prompt as the replica will tokenize it (its first prompt for a batch); None when it
    cannot be told (the replica validates the request itself)."""
    try:
        if isinstance(payload.get("messages"), list):
            conv = []
            for m in payload["messages"]:
                content = m.get("content")
                if isinstance(content, list):
                    content = "\n".join(p.get("text") or "" for p in content)
                msg = {"role": "system" if m.get("role") == "developer" else m.get("role"),
                       "content": content or ""}
                if m.get("name") is not None:
                    msg["name"] = m["name"]
                conv.append(msg)
            ids = tokenizer.apply_chat_template(
                conv, tokenize=True,
                add_generation_prompt=payload.get("add_generation_prompt", True))
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        p = payload.get("prompt")
        if isinstance(p, list) and p and not all(isinstance(x, int) for x in p):
            p = p[0]
        if isinstance(p, str):
            return list(tokenizer.encode(p, add_special_tokens=True))
        if isinstance(p, list) and all(isinstance(x, int) for x in p):
            return p
    except Exception:  # noqa: BLE001 - any malformed body: route without a prefix
        return None
    return None


class RouterState:
    """What ``DrainingServer`` drives (draining, in-flight count, end_all) plus the pool."""

    def __init__(self, settings: RouterSettings, api_key: str | None, tokenizer: Any,
                 tokenizer_workers: int = 2, tracing: Any = None) -> None:
        self.settings = settings
        self.index = PrefixIndex(settings.routed_prefix_ttl)
        self.ring = HashRing()
        self.metrics = RouterMetrics(self)
        pool = functools.partial(
            ReplicaPool, api_key=settings.replica_api_key or api_key,
            health_interval_s=settings.health_interval, health_timeout_s=settings.health_timeout,
            fail_after=settings.fail_after)
        self.pool = pool(list(settings.replicas) + list(settings.decode), index=self.index,
                         on_change=self._membership)
        # Disaggregation (docs/disaggregation.md): prompts run here first, then self.pool
        # (the decode replicas) continues from their KV.
        self.prefill_index = PrefixIndex(settings.routed_prefix_ttl)
        self.prefill_pool: ReplicaPool | None = None
        if settings.prefill:
            self.prefill_pool = pool(list(settings.prefill), index=self.prefill_index, prefix="p")
        self.tokenizers = None
        if tokenizer is not None and settings.uses_tokenizer:
            from kvserve.http.tokenizer_pool import TokenizerPool

            self.tokenizers = TokenizerPool(tokenizer, tokenizer_workers)
        self.client: httpx.AsyncClient | None = None
        self.draining = False
        self.inflight = 0
        self.ending = asyncio.Event()
        self.dead_error: BaseException | None = None  # the router has no engine to lose
        self._rr = 0
        self.tracing = tracing  # kvserve.http.tracing.Tracing, only when tracing is on

    def _membership(self, r: Replica, joined: bool) -> None:
        (self.ring.add if joined else self.ring.remove)(r.name)

    async def start(self) -> None:
        s = self.settings
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=s.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        await self.pool.start()
        if self.prefill_pool is not None:
            await self.prefill_pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        if self.prefill_pool is not None:
            await self.prefill_pool.stop()
        if self.client is not None:
            await self.client.aclose()
        if self.tokenizers is not None:
            self.tokenizers.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def end_all(self) -> None:
        self.ending.set()

    def next_turn(self) -> int:
        self._rr += 1
        return self._rr - 1


async def _race(aw: Awaitable, *events: asyncio.Event) -> Any:
    """``aw``'s result, or ``_Gone`` as soon as one of ``events`` is set."""
    task = asyncio.ensure_future(aw)
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait([task, *waits], return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise _Gone()
    finally:
        for w in waits:
            w.cancel()
        if not task.done():
            task.cancel()


def _sse_error(message: str, code: str) -> bytes:
    body = json.dumps(error_body(message, type="server_error", code=code))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


async def _relay(state: RouterState, up: httpx.Response, r: Replica,
                 route: dict) -> AsyncIterator[bytes]:
    """The replica's events, forwarded whole (split at blank lines); a failure ends the stream
    with an error event and [DONE]."""
    buf, saw_done = b"", False
    chunks = up.aiter_raw()
    down, ending = r.down, state.ending
    try:
        while True:
            try:
                chunk = await _race(chunks.__anext__(), down, ending)
            except StopAsyncIteration:
                break
            buf += chunk
            cut = buf.rfind(b"\n\n")
            if cut >= 0:
                out, buf = buf[:cut + 2], buf[cut + 2:]
                saw_done = saw_done or out.rstrip().endswith(b"data: [DONE]")
                yield out
        if not saw_done:
            raise httpx.RemoteProtocolError("the stream ended without [DONE]")
    except (_Gone, httpx.HTTPError, OSError) as e:
        why = ("the router is shutting down" if state.ending.is_set() else
               f"replica {r.name} failed while streaming ({type(e).__name__})")
        logger.warning("stream on %s ended early: %s", r.name, why)
        state.metrics.stream_errors.labels(r.name).inc()
        route["stream_error"] = True
        yield _sse_error(why, "replica_failed" if not state.ending.is_set() else "shutdown")
    finally:
        r.inflight -= 1
        with contextlib.suppress(BaseException):
            await up.aclose()


def _response_headers(up: httpx.Response, r: Replica) -> dict[str, str]:
    out = {k: up.headers[k] for k in _FORWARD_RESP if k in up.headers}
    out["x-kvserve-replica"] = r.name
    return out


async def proxy(state: RouterState, request: Request, path: str) -> Response:
    if state.tracing is None:
        return await _proxy(state, request, path, None)
    from kvserve.http.tracing import RouterTrace

    trace = RouterTrace(state.tracing, request.headers, path)
    try:
        resp = await _proxy(state, request, path, trace)
    except BaseException as e:
        trace.end(None, type(e).__name__)
        raise
    route = request.scope.get(ROUTE_KEY) or {}
    trace.set({"kvserve.replica": route.get("replica"), "kvserve.route.reason":
               route.get("reason"), "kvserve.route.attempts": route.get("attempts")})
    if isinstance(resp, StreamingResponse):
        resp.body_iterator = _traced(resp.body_iterator, trace, resp.status_code, route)
    else:
        trace.end(resp.status_code)
    return resp


async def _traced(body: AsyncIterator, trace: Any, status: int,
                  route: dict) -> AsyncIterator:
    """A relayed stream whose trace ends with it."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        trace.end(status, "stream_error" if route.get("stream_error") else None)


async def _proxy(state: RouterState, request: Request, path: str, trace: Any) -> Response:
    s = state.settings
    route: dict = {"replica": "-", "reason": "-", "attempts": 0}
    request.scope[ROUTE_KEY] = route
    if state.draining:
        return error_response(503, "the router is shutting down", type="server_error",
                              code="draining", headers={"Retry-After": "1"})
    body = request_body = await request.body()
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    stream = isinstance(payload, dict) and payload.get("stream") is True
    session = request.headers.get(s.session_header)
    matches: dict[str, int] = {}
    prefill, routing = plan(s.routing, state.prefill_pool is not None, payload)
    index = state.prefill_index if prefill else state.index
    ids: list[int] | None = None
    keys: list[bytes] = []  # the prompt's chain keys in ``index``
    if state.tokenizers is not None and isinstance(payload, dict) and index.block_size:
        ids = await state.tokenizers.run(prompt_token_ids, payload)
        if ids:
            keys = index.prompt_keys(ids)
            matches = index.match_keys(keys)
    headers = {k: request.headers[k] for k in _FORWARD_REQ if k in request.headers}
    if session:
        headers[s.session_header] = session
    key = state.pool.api_key
    auth = f"Bearer {key}" if key else request.headers.get("authorization")
    if auth:
        headers["authorization"] = auth
    assert state.client is not None
    if prefill and (leg := await _prefill_leg(state, path, payload, headers, prefill, matches,
                                              keys, trace)) is not None:
        body = json.dumps({**payload, "kv_transfer": {"role": "decode", **leg}}).encode()
        headers["content-type"] = "application/json"
    if index is not state.index and state.index.block_size != index.block_size:
        # the prefill index's keys: the decode pool's own (the same chain at the same size)
        keys = state.index.prompt_keys(ids) if ids else []
    if state.prefill_pool is not None:
        state.metrics.disaggregated.labels("split" if body is not request_body else "whole").inc()
    last: tuple[int, bytes, dict[str, str]] | None = None  # a 429 / 503 answer to fall back on
    for attempt, (r, d) in enumerate(_picks(state, state.pool, routing, session, matches)):
        reason = d.reason if attempt == 0 else "retry"
        route.update(replica=r.name, reason=reason, attempts=attempt + 1)
        state.metrics.decisions.labels(r.name, reason).inc()
        r.inflight += 1
        handed_over = False
        up: httpx.Response | None = None
        span, hdrs = None, headers
        if trace is not None:
            span, carry = trace.forward("decode" if body is not request_body else "whole",
                                        r.name, r.url, path)
            hdrs = {**headers, **carry}
        try:
            req = state.client.build_request("POST", f"{r.url}{path}", content=body,
                                              headers=hdrs)
            up = await _race(state.client.send(req, stream=True), r.down, state.ending)
            if up.status_code in (429, 502, 503, 504):
                content = await _race(up.aread(), r.down, state.ending)
                last = (up.status_code, content, _response_headers(up, r))
                state.metrics.retries.labels(r.name, str(up.status_code)).inc()
                if span is not None:
                    trace.forwarded(span, up.status_code)
                continue
            if stream and up.headers.get("content-type", "").startswith("text/event-stream"):
                if up.status_code == 200:  # the replica ran the prompt: its first token is out
                    state.index.record(r.name, keys)
                handed_over = True
                return StreamingResponse(_relay(state, up, r, route),
                                         status_code=up.status_code,
                                         headers=_response_headers(up, r))
            content = await _race(up.aread(), r.down, state.ending)
            if span is not None:
                trace.forwarded(span, up.status_code)
            if up.status_code == 200:  # answered whole: no retry elsewhere from here on
                state.index.record(r.name, keys)
            return Response(content, status_code=up.status_code,
                            headers=_response_headers(up, r))
        except (_Gone, httpx.HTTPError, OSError) as e:
            if span is not None:
                trace.forwarded(span, None, type(e).__name__)
            if state.ending.is_set():
                return error_response(503, "the router is shutting down", type="server_error",
                                      code="shutdown", headers={"Retry-After": "1"})
            logger.warning("replica %s failed before answering (%s); re-routing", r.name,
                           type(e).__name__)
            state.metrics.retries.labels(r.name, "failed").inc()
            if not isinstance(e, _Gone):
                state.pool.report_failure(r)
        finally:
            if not handed_over:
                r.inflight -= 1
                if up is not None:
                    with contextlib.suppress(BaseException):
                        await up.aclose()
    if last is not None:
        status, content, hdrs = last
        return Response(content, status_code=status, headers=hdrs)
    return error_response(503, "no replica is available to serve this request; retry later",
                          type="server_error", code="no_replica_available",
                          headers={"Retry-After": "1"})


def _picks(state: RouterState, pool: ReplicaPool, routing: str, session: str | None,
           matches: dict[str, int]) -> Iterator[tuple[Replica, Decision]]:
    """``decide``'s picks among ``pool``'s healthy replicas, none twice, up to max_attempts."""
    s, tried = state.settings, set()
    for _ in range(s.max_attempts):
        cands = [Candidate(r.name, r.load, r.kv_usage) for r in pool.healthy()
                 if r.name not in tried]
        if not cands:
            return
        d = decide(routing, cands, session=session, matches=matches, ring=state.ring,
                   rr_turn=state.next_turn(), load_factor=s.load_factor,
                   load_cost_tokens=s.prefix_load_cost)
        tried.add(d.replica)
        yield pool.replicas[d.replica], d


async def _prefill_leg(state: RouterState, path: str, payload: dict, headers: dict[str, str],
                       routing: str, matches: dict[str, int], keys: list[bytes],
                       trace: Any = None) -> dict | None:
    """Run the prompt on the prefill replica ``routing`` picks; its ``kv_transfer`` answer
    (handle + first token), or None: the decode leg then takes the request whole (no prefill
    replica answered, the request was refused there, or its first token ended it). ``keys``:
    the prompt's chain keys in the prefill index, recorded for the replica that ran it."""
    pool = state.prefill_pool
    assert pool is not None and state.client is not None
    leg = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
    body = json.dumps({**leg, "kv_transfer": {"role": "prefill"}}).encode()
    hdrs = {**headers, "content-type": "application/json"}
    for r, d in _picks(state, pool, routing, None, matches):
        state.metrics.decisions.labels(r.name, d.reason).inc()
        r.inflight += 1
        span, sent = None, hdrs
        if trace is not None:
            span, carry = trace.forward("prefill", r.name, r.url, path)
            sent = {**hdrs, **carry}
        try:
            up = await _race(state.client.post(f"{r.url}{path}", content=body, headers=sent),
                             r.down, state.ending)
            if span is not None:
                trace.forwarded(span, up.status_code)
            if up.status_code in (429, 502, 503, 504):
                state.metrics.retries.labels(r.name, str(up.status_code)).inc()
                continue
            if up.status_code != 200:
                return None
            out = up.json().get("kv_transfer")  # a body that is not JSON: tried elsewhere
            state.prefill_index.record(r.name, keys)
            return out if isinstance(out, dict) else None
        except (_Gone, httpx.HTTPError, OSError, ValueError) as e:
            if span is not None:
                trace.forwarded(span, None, type(e).__name__)
            if state.ending.is_set():
                return None
            logger.warning("prefill replica %s failed (%s); trying another", r.name,
                           type(e).__name__)
            state.metrics.retries.labels(r.name, "failed").inc()
            if not isinstance(e, (_Gone, ValueError)):
                pool.report_failure(r)
        finally:
            r.inflight -= 1
    return None


class RouterAccessLog(AccessLog):
    """One ``kvserve.access`` line per HTTP request, naming the replica that served it."""

    def __init__(self, app: ASGIApp, state: RouterState, log: bool = True) -> None:
        super().__init__(app, log)
        self.state = state

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        generation = scope.get("path") in _GENERATION_PATHS and scope.get("method") == "POST"
        if generation:
            self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if generation:
                self.state.inflight -= 1

    def describe(self, scope: Scope, status: int) -> str:
        route = scope.get(ROUTE_KEY)
        extra = ""
        if route is not None:
            extra = (f" replica={route['replica']} reason={route['reason']} "
                     f"attempts={route['attempts']}")
            if route.get("stream_error"):
                extra += " stream_error=1"
            self.state.metrics.requests.labels(route["replica"], str(status)).inc()
        return extra


def build_router_app(state: RouterState, *, api_key: str | None,
                     max_body_bytes: int = 4 * 2**20, access_log: bool = True) -> FastAPI:
    """The caller runs ``state.start()`` on the serving loop before requests arrive (the app's
    lifespan does) and ``state.stop()`` after."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="kvserve router", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible endpoint in front of kvserve replicas")
    app.state.server = state
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    publish(app, {"/v1/completions": CompletionRequest,
                  "/v1/chat/completions": ChatCompletionRequest},
            limits=lambda: next((r.limits for r in state.pool.replicas.values()
                                 if r.limits is not None), None))

    # The replicas' API, published as they publish it; the body goes on to a replica
    # untouched, which validates it (the same models: the same 400s).
    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=GENERATION_RESPONSES)
    async def completions(request: Request) -> Response:
        """Text completion on a replica; `stream: true` answers with server-sent events."""
        return await proxy(state, request, "/v1/completions")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        """Chat completion on a replica; `stream: true` answers with server-sent events."""
        return await proxy(state, request, "/v1/chat/completions")

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> Response:
        assert state.client is not None
        for r in state.pool.healthy():
            with contextlib.suppress(httpx.HTTPError, OSError):
                up = await state.client.get(f"{r.url}/v1/models",
                                            headers=state.pool.headers(), timeout=5.0)
                if up.status_code == 200:
                    return Response(up.content, media_type="application/json")
        return error_response(503, "no replica is available", type="server_error",
                              code="no_replica_available", headers={"Retry-After": "1"})

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one replica is in the pool."""
        n = len(state.pool.healthy())
        return JSONResponse({"status": "ok" if n else "no_replicas", "replicas": n},
                            status_code=200 if n else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        n = len(state.pool.healthy())
        if state.draining:
            return JSONResponse({"status": "draining", "in_flight": state.inflight},
                                status_code=503)
        return JSONResponse({"status": "ready" if n else "no_replicas", "replicas": n,
                             "in_flight": state.inflight}, status_code=200 if n else 503)

    @app.get("/router/replicas")
    async def replicas() -> dict:
        """Each replica's state as the router sees it (prefill replicas apart)."""
        def rows(pool: ReplicaPool, index: PrefixIndex) -> list[dict]:
            return [{"name": r.name, "url": r.url, "healthy": r.healthy,
                     "inflight": r.inflight, "running": r.running,
                     "waiting": r.waiting, "kv_usage": r.kv_usage,
                     "prefix_cache_hit_rate": r.hit_rate,
                     "indexed_blocks": index.num_blocks(r.name),
                     "indexed_by_medium": index.blocks_by_medium(r.name),
                     "routed_blocks": index.num_routed(r.name),
                     "events_endpoint": r.events_endpoint, "event_gaps": r.gaps,
                     "next_event_seq": r.next_seq}
                    for r in pool.replicas.values()]

        out = {"routing": state.settings.routing, "block_size": state.index.block_size,
               "replicas": rows(state.pool, state.index)}
        if state.prefill_pool is not None:
            out["prefill_replicas"] = rows(state.prefill_pool, state.prefill_index)
        return out

    add_metrics_and_version(app, state.metrics.render)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyAuth, api_key=api_key)
    app.add_middleware(ErrorCounter, counter=state.metrics.http_errors)
    # outermost: counts in-flight generation requests for the drain even without the log
    app.add_middleware(RouterAccessLog, state=state, log=access_log)
    return app
