"""Prometheus metrics (all ``kvserve_``-prefixed) in a per-app ``CollectorRegistry``.

Engine-side figures (scheduler queues, KV blocks, prefix-cache hit rate, token counters,
preemptions, integrity counters) are read from the engine thread's latest ``EngineSnapshot`` at
scrape time by a custom collector, so the scrape never touches the live engine. Request
latencies, finish reasons and HTTP errors are observed by the front end as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvserve.engine.async_engine import EngineSnapshot

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 300.0, 600.0)


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # values are only known at scrape time

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvserve_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvserve_{name}", doc, value=value)

        yield gauge("num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("num_unfinished_requests", "Requests in the engine, running or waiting.",
                    s.num_unfinished_requests)
        yield gauge("kv_blocks_total", "KV cache blocks in the pool.", s.num_blocks_total)
        yield gauge("kv_blocks_used", "KV cache blocks held by requests.", s.num_blocks_used)
        yield gauge("kv_blocks_free", "KV cache blocks free (incl. reusable cached ones).",
                    s.num_blocks_free)
        usage = 100.0 * s.num_blocks_used / s.num_blocks_total if s.num_blocks_total else 0.0
        yield gauge("kv_cache_usage_percent", "KV cache blocks in use, percent.", usage)
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache "
                    "(fraction of queried tokens, since start).", s.prefix_cache_hit_rate)
        yield counter("prompt_tokens", "Prompt tokens accepted by the engine.",
                      s.counters.get("prompt_tokens", 0))
        yield counter("generation_tokens", "Tokens generated.",
                      s.counters.get("generation_tokens", 0))
        yield counter("engine_steps", "Engine steps run.", s.counters.get("steps", 0))
        yield counter("preemptions", "Sequences preempted for lack of KV blocks.",
                      s.num_preemptions)
        integrity = s.integrity or {}
        for key, doc in (("checks", "KV integrity checks run"),
                         ("failures", "KV integrity checks that failed"),
                         ("repairs", "KV integrity repairs made")):
            yield _labelled(f"kvserve_integrity_{key}", f"{doc}, by reason.", "reason",
                            integrity.get(key))
        if s.kv_tiers is not None:
            yield from _tier_metrics(s.kv_tiers)
        if s.kv_transfer is not None:
            yield from _transfer_metrics(s.kv_transfer)


def _labelled(name: str, doc: str, label: str, values: dict | None) -> CounterMetricFamily:
    """A counter family with one sample per key of ``values`` (sorted), labelled ``label``."""
    fam = CounterMetricFamily(name, doc, labels=[label])
    for key, n in sorted((values or {}).items()):
        fam.add_metric([str(key)], n)
    return fam


def _histogram(name: str, doc: str, bounds: list[float], counts: list[int],
               sum_value: float) -> Iterator[Metric]:
    """A histogram family from per-bucket counts (``bounds`` then +Inf, not cumulative, as
    ``KVTiers.stats`` / ``KVTransfer.stats`` keep them); none while there are no counts."""
    if counts:
        cum, buckets = 0, []
        for le, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
            cum += n
            buckets.append((le, cum))
        yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum_value)


def _transfer_metrics(st: dict) -> Iterator[Metric]:
    """Disaggregation's KV transfer (kvserve/cache/kv_transfer.py ``KVTransfer.stats``)."""
    for key, doc in (("exported", "Prompt KV transfers offered to a decode replica"),
                     ("imported", "Prompt KV transfers fetched from a prefill replica"),
                     ("blocks_installed", "Transferred KV blocks verified and used")):
        yield CounterMetricFamily(f"kvserve_kv_transfer_{key}", f"{doc}.", value=st.get(key, 0))
    fam = CounterMetricFamily("kvserve_kv_transfer_bytes", "KV transfer bytes, by direction.",
                              labels=["direction"])
    fam.add_metric(["sent"], st.get("bytes_sent", 0))
    fam.add_metric(["received"], st.get("bytes_received", 0))
    yield fam
    for key, doc in (("rejected", "Transferred KV blocks refused by verification (recomputed), "
                      "by reason"),
                     ("fallbacks", "Transfers that failed (timeout, unknown, ...): the decode "
                      "replica prefilled itself, by reason")):
        yield _labelled(f"kvserve_kv_transfer_{key}", f"{doc}.", "reason", st.get(key))
    yield GaugeMetricFamily("kvserve_kv_transfer_outstanding", "Offered transfers not yet "
                            "confirmed by a decode replica.", value=st.get("outstanding", 0))
    yield CounterMetricFamily("kvserve_kv_transfer_expired", "Offered transfers dropped "
                              "unconfirmed after --kv-transfer-timeout.",
                              value=st.get("expired", 0))
    yield from _histogram("kvserve_kv_transfer_seconds", "Time to fetch and verify a "
                          "request's transferred KV.", st.get("latency_buckets", []),
                          st.get("latency_counts", []), st.get("latency_seconds", 0.0))


def _tier_metrics(st: dict) -> Iterator[Metric]:
    """The KV tiers (kvserve/cache/kv_tiers.py ``KVTiers.stats``), labelled by tier."""
    tiers = st.get("tiers", {})
    for key, doc in (("hits", "KV blocks restored from a tier (verified)"),
                     ("misses", "Chain blocks looked for in a tier and not there"),
                     ("writes", "KV blocks written down to a tier"),
                     ("evictions", "KV tier entries evicted by its byte cap")):
        yield _labelled(f"kvserve_kv_tier_{key}", f"{doc}.", "tier",
                        {name: t.get(key, 0) for name, t in tiers.items()})
    fam = GaugeMetricFamily("kvserve_kv_tier_bytes", "Bytes a KV tier holds.", labels=["tier"])
    cap = GaugeMetricFamily("kvserve_kv_tier_capacity_bytes", "A KV tier's byte cap.",
                            labels=["tier"])
    for name, t in sorted(tiers.items()):
        fam.add_metric([name], t.get("bytes", 0))
        cap.add_metric([name], t.get("cap_bytes", 0))
    yield fam
    yield cap
    rej = CounterMetricFamily("kvserve_kv_tier_rejected", "KV tier entries refused by "
                              "verification (dropped, recomputed), by tier and reason.",
                              labels=["tier", "reason"])
    for name, t in sorted(tiers.items()):
        for reason, n in sorted((t.get("rejected") or {}).items()):
            rej.add_metric([name, reason], n)
    yield rej
    yield GaugeMetricFamily("kvserve_kv_offload_queue_depth", "Evicted KV blocks waiting to "
                            "be written down.", value=st.get("queue_depth", 0))
    yield CounterMetricFamily("kvserve_kv_offload_dropped_writes", "Write-downs dropped by a "
                              "full queue.", value=st.get("dropped_writes", 0))
    yield from _histogram("kvserve_kv_restore_seconds", "Time to read and verify a request's "
                          "blocks from the KV tiers.", st.get("restore_buckets", []),
                          st.get("restore_counts", []), st.get("restore_seconds", 0.0))


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(snapshot))  # type: ignore[arg-type]
        r = self.registry
        self.ttft = Histogram("kvserve_time_to_first_token_seconds",
                              "Arrival to first generated token.", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("kvserve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds",
                             "Arrival to the last output of a request.", buckets=_E2E_BUCKETS,
                             registry=r)
        self.finished = Counter("kvserve_requests_finished",
                                "Finished sequences (choices) by finish reason "
                                "(stop, length, abort, timeout).", ["finish_reason"], registry=r)
        self.http_errors = Counter("kvserve_http_errors", "HTTP responses with status >= 400.",
                                   ["status"], registry=r)
        self.rejected = Counter("kvserve_requests_rejected",
                                "Generation requests refused before reaching the engine.",
                                ["reason"], registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
