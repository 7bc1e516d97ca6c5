"""The router's Prometheus metrics (``kvserve_router_``-prefixed, a per-app registry):
requests and routing decisions per replica and reason, re-routes, streams ended by a failed
replica, and per replica (read at scrape time) health, load, KV usage, prefix-cache hit rate,
indexed blocks, KV-event lag and gaps; and each replica's own KV tier / offload / restore /
transfer families (``kvserve_kv_tier_*``, ...) from its last scrape, with a ``replica`` label."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# per replica: (name, help, the Replica attribute it reads; None: the blocks the router's
# prefix index holds for it)
_GAUGES: tuple[tuple[str, str, str | None], ...] = (
    ("healthy", "1 while the replica is in the pool.", "healthy"),
    ("inflight", "Requests this router has in flight on the replica.", "inflight"),
    ("running", "Sequences running on the replica (its last /metrics).", "running"),
    ("waiting", "Sequences waiting on the replica (its last /metrics).", "waiting"),
    ("load", "The load routing compares: max(in flight here, running + waiting).", "load"),
    ("kv_cache_usage", "Fraction of the replica's KV blocks in use.", "kv_usage"),
    ("prefix_cache_hit_rate", "The replica's prefix-cache hit rate (its /metrics).",
     "hit_rate"),
    ("indexed_blocks", "Prefix-cached blocks the router's index holds for it.", None),
    ("kv_event_lag_seconds", "Receive time minus publish time of its last event batch.",
     "event_lag_s"),
    ("kv_event_gaps", "Sequence gaps seen in its KV-event stream.", "gaps"),
)


class _ReplicaCollector:
    def __init__(self, state: Any) -> None:
        self._state = state

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        pool, index = self._state.pool, self._state.index
        # role: decode (or both) for the main pool, prefill for a disaggregated router's
        pools = [("decode" if self._state.prefill_pool is not None else "both", pool)]
        if self._state.prefill_pool is not None:
            pools.append(("prefill", self._state.prefill_pool))
        for name, doc, attr in _GAUGES:
            fam = GaugeMetricFamily(f"kvserve_router_replica_{name}", doc,
                                    labels=["replica", "url", "role"])
            for role, p in pools:
                for r in p.replicas.values():
                    value = index.num_blocks(r.name) if attr is None else getattr(r, attr)
                    fam.add_metric([r.name, r.url, role], float(value))
            yield fam
        yield from fleet_families([r for _, p in pools for r in p.replicas.values()])


def fleet_families(replicas: Iterable[Any]) -> Iterator[Metric]:
    """Each replica's KV tier / transfer families from its last scrape, one family per name
    with a ``replica`` label added to every sample: one scrape of the router covers the
    fleet."""
    merged: dict[str, Metric] = {}
    for r in replicas:
        for fam in r.fleet:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            for smp in fam.samples:
                out.add_sample(smp.name, {**smp.labels, "replica": r.name}, smp.value)
    yield from merged.values()


class RouterMetrics:
    def __init__(self, state: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ReplicaCollector(state))  # type: ignore[arg-type]
        r = self.registry
        self.requests = Counter("kvserve_router_requests", "HTTP requests answered, by the "
                                "replica that served them ('-': none) and status.",
                                ["replica", "status"], registry=r)
        self.decisions = Counter("kvserve_router_routing_decisions", "Routing decisions by "
                                 "replica and reason (session, prefix, least_loaded, "
                                 "round_robin, retry).", ["replica", "reason"], registry=r)
        self.retries = Counter("kvserve_router_reroutes", "Requests taken off a replica before "
                               "they started, by replica and cause (failed, 429, 503, ...).",
                               ["replica", "cause"], registry=r)
        self.stream_errors = Counter("kvserve_router_stream_errors", "Streams ended with an "
                                     "error event because their replica failed.", ["replica"],
                                     registry=r)
        self.disaggregated = Counter(
            "kvserve_router_disaggregated", "Generation requests with prefill replicas: split "
            "(prefill leg, then decode leg) or whole (sent to a decode replica alone: n > 1, "
            "max_tokens 1, a first token that ended it, no prefill replica answered).",
            ["how"], registry=r)
        self.http_errors = Counter("kvserve_router_http_errors",
                                   "HTTP responses with status >= 400.", ["status"], registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
