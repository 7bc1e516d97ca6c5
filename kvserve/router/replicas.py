"""The replicas behind the router: health, load, and their KV-event streams.

One task per replica checks ``/health`` every ``health_interval_s`` (and scrapes ``/metrics``
for load and prefix-cache hit rate). ``fail_after`` failed checks in a row (an error, a non-200,
or no answer within ``health_timeout_s``: a dead or hung replica) take it out of the pool; its
``down`` event wakes every stream proxied to it. One good check brings it back (rejoin): its
prefix-index entries are dropped and rebuilt from a replay of its event buffer.

Events: a SUB socket on the replica's ``--kv-events-endpoint`` (learned from its ``GET
/kv_events``). Batches carry sequence numbers; a gap is filled from the replica's replay
socket when it has one, else its entries are cleared (stale entries only cost a worse route);
a sequence number going backwards means the replica restarted: cleared too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from kvserve.cache.kv_events import END_SEQ, decode_batch
from kvserve.http.openapi import LIMITS_KEY, RequestLimits
from kvserve.router.prefix_index import PrefixIndex

logger = logging.getLogger("kvserve.router")


@dataclass(slots=True)
class Replica:
    name: str
    url: str
    healthy: bool = False
    failures: int = 0
    inflight: int = 0  # this router's requests on it
    running: int = 0  # from its last /metrics scrape
    waiting: int = 0
    kv_usage: float = 0.0  # fraction
    hit_rate: float = 0.0
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    next_seq: int | None = None  # the event batch expected next
    last_event_ts: float | None = None
    event_lag_s: float = 0.0  # receive time - publish time of the last batch
    gaps: int = 0
    replayed: tuple[int, int] = (0, 0)  # [lo, hi) of the batches the last replay applied
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while out of the pool
    # its KV tier / transfer metric families from its last /metrics scrape (FLEET_PREFIXES),
    # which the router's /metrics shows again labelled by replica
    fleet: list = field(default_factory=list)
    # the request limits its /openapi.json states (the router's schema states them too)
    limits: RequestLimits | None = None

    @property
    def load(self) -> int:
        return max(self.inflight, self.running + self.waiting)


def _endpoint_for(url: str, endpoint: str) -> str:
    """A replica's bound ``tcp://*:P`` / ``tcp://0.0.0.0:P`` as reachable from here."""
    host = urlsplit(url).hostname or "127.0.0.1"
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard):]}"
    return endpoint


# A replica's metric families the router's /metrics repeats with a ``replica`` label.
FLEET_PREFIXES = ("kvserve_kv_tier_", "kvserve_kv_offload_", "kvserve_kv_restore_",
                  "kvserve_kv_transfer_")


def parse_metrics(text: str) -> dict[str, float]:
    return scrape(text)[0]


def scrape(text: str) -> tuple[dict[str, float], list]:
    """A replica's /metrics text: its unlabelled samples by name, and its families named by
    ``FLEET_PREFIXES`` (prometheus_client ``Metric``s)."""
    from prometheus_client.parser import text_string_to_metric_families

    out, fleet = {}, []
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith(FLEET_PREFIXES):
            fleet.append(fam)
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out, fleet


class ReplicaPool:
    def __init__(self, urls: list[str], *, api_key: str | None, index: PrefixIndex,
                 health_interval_s: float = 0.5, health_timeout_s: float = 1.0,
                 fail_after: int = 2, on_change=None, prefix: str = "r") -> None:
        if not urls:
            raise ValueError("replica: at least one replica URL is needed")
        # names: r0, r1, ... (prefill replicas of a disaggregated router: p0, p1, ...)
        self.replicas = {f"{prefix}{i}": Replica(f"{prefix}{i}", u.rstrip("/"))
                         for i, u in enumerate(urls)}
        for r in self.replicas.values():
            r.down.set()
        self.index = index
        self.api_key = api_key
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.fail_after = fail_after
        self.on_change = on_change  # called (replica, joined: bool)
        self._tasks: list[asyncio.Task] = []
        self._event_tasks: dict[str, asyncio.Task] = {}
        self._client: httpx.AsyncClient | None = None
        self._ctx = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    async def start(self) -> None:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._client = httpx.AsyncClient(timeout=self.health_timeout_s, headers=self.headers())
        self._tasks = [asyncio.create_task(self._watch(r)) for r in self.replicas.values()]

    async def stop(self) -> None:
        tasks = self._tasks + list(self._event_tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if self._client is not None:
            await self._client.aclose()
        if self._ctx is not None:
            self._ctx.destroy(0)

    def report_failure(self, r: Replica) -> None:
        """A proxied request could not reach it: count a failed check now."""
        self._fail(r, "request failed")

    # ---- health ----------------------------------------------------------------------------
    def _fail(self, r: Replica, why: str) -> None:
        r.failures += 1
        if r.healthy and r.failures >= self.fail_after:
            r.healthy = False
            r.down.set()
            r.running = r.waiting = 0
            logger.warning("replica %s (%s) left the pool: %s", r.name, r.url, why)
            self._stop_events(r)
            self.index.clear(r.name)
            if self.on_change:
                self.on_change(r, False)

    async def _check(self, r: Replica) -> None:
        assert self._client is not None
        try:
            resp = await self._client.get(f"{r.url}/health")
            ok = resp.status_code == 200
            why = f"/health answered {resp.status_code}"
        except (httpx.HTTPError, OSError) as e:
            ok, why = False, f"/health: {type(e).__name__}"
        if not ok:
            self._fail(r, why)
            return
        r.failures = 0
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            m, r.fleet = scrape((await self._client.get(f"{r.url}/metrics")).text)
            r.running = int(m.get("kvserve_num_requests_running", 0))
            r.waiting = int(m.get("kvserve_num_requests_waiting", 0))
            r.kv_usage = m.get("kvserve_kv_cache_usage_percent", 0.0) / 100.0
            r.hit_rate = m.get("kvserve_prefix_cache_hit_rate", 0.0)
        if not r.healthy:
            await self._join(r)

    async def _join(self, r: Replica) -> None:
        assert self._client is not None
        self.index.clear(r.name)
        r.next_seq = None
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, AttributeError):
            info = (await self._client.get(f"{r.url}/openapi.json")).json().get("info", {})
            r.limits = RequestLimits.from_dict(info.get(LIMITS_KEY))
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            info = (await self._client.get(f"{r.url}/kv_events")).json()
            ep, rep = info.get("endpoint"), info.get("replay_endpoint")
            r.events_endpoint = _endpoint_for(r.url, ep) if ep else None
            r.replay_endpoint = _endpoint_for(r.url, rep) if rep else None
            if self.index.block_size is None and isinstance(info.get("block_size"), int):
                # routed prompts are recorded (and matched) before the first KV event
                self.index.block_size = info["block_size"]
        if r.events_endpoint:
            self._event_tasks[r.name] = asyncio.create_task(self._events(r))
        r.healthy = True
        r.down = asyncio.Event()
        logger.info("replica %s (%s) joined the pool%s", r.name, r.url,
                    f"; KV events from {r.events_endpoint}" if r.events_endpoint else "")
        if self.on_change:
            self.on_change(r, True)

    async def _watch(self, r: Replica) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self._check(r)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("health check of %s failed", r.name)
            await asyncio.sleep(max(0.0, self.health_interval_s - (time.monotonic() - t0)))

    # ---- KV events ---------------------------------------------------------------------------
    def _stop_events(self, r: Replica) -> None:
        task = self._event_tasks.pop(r.name, None)
        if task is not None:
            task.cancel()

    def _apply(self, r: Replica, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except ValueError as e:
            logger.warning("replica %s: undecodable KV event batch %d: %s", r.name, seq, e)
            return
        for ev in batch.events:
            self.index.apply(r.name, ev)
        r.next_seq = seq + 1
        r.last_event_ts = batch.ts
        r.event_lag_s = max(0.0, time.time() - batch.ts)

    async def _replay(self, r: Replica, start: int, stop: int | None) -> bool:
        """Apply buffered batches ``start`` .. ``stop - 1`` (all from ``start`` when None);
        False when the replica cannot supply ``start``."""
        import zmq

        if r.replay_endpoint is None or self._ctx is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(r.replay_endpoint)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            first = first_applied = True
            while True:
                if not await sock.poll(2000):
                    return False
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    return False
                _, seq_b, payload = frames
                if seq_b == END_SEQ:
                    return not first or start == 0 or stop == start
                seq = int.from_bytes(seq_b, "big")
                if first and seq != start and start != 0:
                    return False  # the buffer no longer reaches back to start
                first = False
                if stop is None or seq < stop:
                    self._apply(r, seq, payload)
                    lo = r.replayed[0] if not first_applied else seq
                    r.replayed = (lo, seq + 1)
                    first_applied = False
        finally:
            sock.close(0)

    async def _events(self, r: Replica) -> None:
        import zmq

        assert self._ctx is not None and r.events_endpoint is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(r.events_endpoint)
        try:
            await asyncio.sleep(0.05)  # let the subscription reach the publisher
            await self._replay(r, 0, None)  # what it cached before we subscribed
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    logger.warning("replica %s: malformed KV event message", r.name)
                    continue
                seq = int.from_bytes(frames[1], "big")
                expected = r.next_seq
                if expected is not None and seq < expected:
                    lo, hi = r.replayed
                    if lo <= seq < hi:
                        continue  # already applied from the replay
                    logger.warning("replica %s: KV event sequence went back (%d < %d): it "
                                   "restarted; clearing its entries", r.name, seq, expected)
                    self.index.clear(r.name)
                elif expected is not None and seq > expected:
                    r.gaps += 1
                    if not await self._replay(r, expected, seq):
                        logger.warning("replica %s: KV events %d..%d lost; clearing its "
                                       "entries", r.name, expected, seq - 1)
                        self.index.clear(r.name)
                self._apply(r, seq, frames[2])
        finally:
            sub.close(0)
