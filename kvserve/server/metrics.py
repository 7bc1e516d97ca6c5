"""Prometheus metrics in a per-app ``CollectorRegistry``: kvserve's own (``kvserve_``) and
vLLM's names (``vllm:``, labelled ``model_name`` and ``engine``) that dashboards, autoscalers
and the Gateway API Inference Extension read (the table in docs/server.md).

Engine-side figures (scheduler queues, KV blocks, prefix-cache queries and hits, token
counters, tokens per step, preemptions, integrity, tiers, transfer, speculation, LoRA) are read
from the engine thread's latest ``EngineSnapshot`` at scrape time by a custom collector, so the
scrape never touches the live engine. Request figures are recorded once, by the front end as
they happen, into one ``RequestRecorder``; each accumulator is exposed under both names (its
buckets are the union of both families' buckets, so each family reads exactly).
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvserve.engine.async_engine import EngineSnapshot
from kvserve.engine.stats import ITERATION_TOKEN_BOUNDS, BucketCounts
from kvserve.outputs import RequestMetrics

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 300.0, 600.0)
# vLLM's buckets (vllm/v1/metrics/loggers.py)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
VLLM_LABELS = ("model_name", "engine")
# kvserve's finish reasons (kvserve_requests_finished_total) -> vLLM's finished_reason
VLLM_FINISHED_REASON = {"stop": "stop", "length": "length", "abort": "abort",
                        "timeout": "abort", "grammar_dead_end": "stop"}


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, base = [], 1
    while base <= limit:
        out += [m * base for m in (1, 2, 5) if m * base <= limit]
        base *= 10
    return tuple(out)


def _union(*bounds: Sequence[float]) -> tuple[float, ...]:
    return tuple(sorted({float(b) for bs in bounds for b in bs}))


def _hist(name: str, doc: str, acc: BucketCounts, bounds: Sequence[float],
          labels: dict[str, str] | None = None) -> HistogramMetricFamily:
    """``acc`` exposed as the histogram ``name`` with ``bounds`` (a subset of its own)."""
    keys = list(labels or {})
    fam = HistogramMetricFamily(name, doc, labels=keys)
    buckets = [(_le(le), n) for le, n in acc.cumulative(tuple(float(b) for b in bounds))]
    fam.add_metric([labels[k] for k in keys] if labels else [], buckets, sum_value=acc.sum)
    return fam


def _le(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(float(le))


class RequestRecorder:
    """The front end's one record of request figures (event-loop side; a lock covers the
    scrape). Times are ``time.monotonic()`` seconds, the clock of the engine's
    ``RequestMetrics``."""

    def __init__(self, max_model_len: int) -> None:
        self.lock = threading.Lock()
        self.token_bounds = buckets_1_2_5(max_model_len)
        latency = VLLM_REQUEST_LATENCY_BUCKETS
        self.ttft = BucketCounts(_union(_TTFT_BUCKETS, VLLM_TTFT_BUCKETS))
        self.itl = BucketCounts(_union(_ITL_BUCKETS, VLLM_ITL_BUCKETS))
        self.e2e = BucketCounts(_union(_E2E_BUCKETS, latency))
        self.queue = BucketCounts(_union(latency))
        self.prefill = BucketCounts(_union(latency))
        self.decode = BucketCounts(_union(latency))
        self.inference = BucketCounts(_union(latency))
        self.tpot = BucketCounts(_union(VLLM_ITL_BUCKETS))  # per request: decode / (tokens-1)
        self.prompt_tokens = BucketCounts(_union(self.token_bounds))
        self.generation_tokens = BucketCounts(_union(self.token_bounds))
        self.max_tokens_param = BucketCounts(_union(self.token_bounds))
        self.n_param = BucketCounts(_union(VLLM_N_BUCKETS))
        self.finished: Tally[str] = Tally()  # per choice, kvserve's reasons

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(max(0.0, seconds))

    def inter_token(self, gap: float, n: int = 1) -> None:
        with self.lock:
            self.itl.observe(max(0.0, gap), n)

    def request_done(self, e2e: float | None, reasons: Sequence[str]) -> None:
        """An HTTP request closed: its end-to-end time (None: it produced nothing) and each
        choice's finish reason (a key of ``VLLM_FINISHED_REASON``)."""
        with self.lock:
            self.finished.update(reasons)
            if e2e is not None:
                self.e2e.observe(max(0.0, e2e))

    def prompt_done(self, arrival: float, m: RequestMetrics, prompt_tokens: int,
                    choice_tokens: Sequence[int], n: int, max_tokens: int | None) -> None:
        """One engine request (a prompt and its ``n`` choices; times: its first sequence's)
        that got its first token. Queue time runs from the server's ``arrival``, so it counts
        the front end's fair queue too."""
        with self.lock:
            self.prompt_tokens.observe(prompt_tokens)
            self.generation_tokens.observe(sum(choice_tokens))
            self.n_param.observe(n)
            if max_tokens is not None:
                self.max_tokens_param.observe(max_tokens)
            start, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
            if start is None or first is None:
                return
            self.queue.observe(max(0.0, start - arrival))
            self.prefill.observe(max(0.0, first - start))
            if last is not None:
                self.decode.observe(max(0.0, last - first))
                self.inference.observe(max(0.0, last - start))
                gen = choice_tokens[0] if choice_tokens else 0
                if gen > 1:
                    self.tpot.observe((last - first) / (gen - 1))

    def collect(self, vllm: dict[str, str]) -> Iterator[Metric]:
        with self.lock:
            yield _hist("kvserve_time_to_first_token_seconds", "Arrival to first generated token.",
                        self.ttft, _TTFT_BUCKETS)
            yield _hist("kvserve_inter_token_latency_seconds", "Time between consecutive "
                        "generated tokens.", self.itl, _ITL_BUCKETS)
            yield _hist("kvserve_e2e_request_latency_seconds", "Arrival to the last output of a "
                        "request.", self.e2e, _E2E_BUCKETS)
            fin = CounterMetricFamily("kvserve_requests_finished", "Finished sequences "
                                      "(choices) by finish reason (stop, length, abort, "
                                      "timeout, grammar_dead_end).", labels=["finish_reason"])
            success = Tally()
            for reason, n in sorted(self.finished.items()):
                fin.add_metric([reason], n)
                success[VLLM_FINISHED_REASON.get(reason, "abort")] += n
            yield fin
            keys = [*VLLM_LABELS, "finished_reason"]
            fam = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                      "requests (finished sequences).", labels=keys)
            for reason in ("stop", "length", "abort"):
                fam.add_metric([vllm["model_name"], vllm["engine"], reason], success[reason])
            yield fam
            lat = VLLM_REQUEST_LATENCY_BUCKETS
            for name, doc, acc, bounds in (
                    ("time_to_first_token_seconds", "Histogram of time to first token in "
                     "seconds.", self.ttft, VLLM_TTFT_BUCKETS),
                    ("inter_token_latency_seconds", "Histogram of inter-token latency in "
                     "seconds.", self.itl, VLLM_ITL_BUCKETS),
                    ("time_per_output_token_seconds", "Histogram of time per output token in "
                     "seconds (deprecated by vLLM: inter_token_latency_seconds).", self.itl,
                     VLLM_ITL_BUCKETS),
                    ("request_time_per_output_token_seconds", "Histogram of "
                     "time_per_output_token_seconds per request.", self.tpot,
                     VLLM_ITL_BUCKETS),
                    ("e2e_request_latency_seconds", "Histogram of e2e request latency in "
                     "seconds.", self.e2e, lat),
                    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase "
                     "for request.", self.queue, lat),
                    ("request_inference_time_seconds", "Histogram of time spent in RUNNING "
                     "phase for request.", self.inference, lat),
                    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase "
                     "for request.", self.prefill, lat),
                    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase "
                     "for request.", self.decode, lat),
                    ("request_prompt_tokens", "Number of prefill tokens processed.",
                     self.prompt_tokens, self.token_bounds),
                    ("request_generation_tokens", "Number of generation tokens processed.",
                     self.generation_tokens, self.token_bounds),
                    ("request_params_max_tokens", "Histogram of the max_tokens request "
                     "parameter.", self.max_tokens_param, self.token_bounds),
                    ("request_params_n", "Histogram of the n request parameter.",
                     self.n_param, VLLM_N_BUCKETS)):
                yield _hist(f"vllm:{name}", doc, acc, bounds, vllm)


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], recorder: RequestRecorder,
                 vllm: dict[str, str]) -> None:
        self._snapshot = snapshot
        self._recorder = recorder
        self._vllm = vllm

    def describe(self) -> list[Metric]:
        return []  # values are only known at scrape time

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield from self._recorder.collect(self._vllm)
        yield from _vllm_engine_metrics(s, self._vllm)

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


def _vllm_engine_metrics(s: EngineSnapshot, vllm: dict[str, str]) -> Iterator[Metric]:
    """vLLM's engine-side metrics, from the snapshot (docs/server.md has the table)."""
    keys, values = list(vllm), list(vllm.values())

    def one(fam: GaugeMetricFamily | CounterMetricFamily, value: float):
        fam.add_metric(values, value)
        return fam

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return one(GaugeMetricFamily(f"vllm:{name}", doc, labels=keys), value)

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return one(CounterMetricFamily(f"vllm:{name}", doc, labels=keys), value)

    c = s.counters
    yield gauge("num_requests_running", "Number of requests in model execution batches.",
                s.num_running)
    yield gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                s.num_waiting)
    usage = s.num_blocks_used / s.num_blocks_total if s.num_blocks_total else 0.0
    yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
    yield counter("prompt_tokens", "Number of prefill tokens processed.",
                  c.get("prompt_tokens", 0))
    yield counter("generation_tokens", "Number of generation tokens processed.",
                  c.get("generation_tokens", 0))
    yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                  "tokens.", c.get("prefix_cache_queries", 0))
    yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                  "tokens.", c.get("prefix_cache_hits", 0))
    yield counter("num_preemptions", "Cumulative number of preemption from the engine.",
                  s.num_preemptions)
    it = s.iteration_tokens or BucketCounts(ITERATION_TOKEN_BOUNDS)
    yield _hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                it, ITERATION_TOKEN_BOUNDS, vllm)
    if s.cache_config:
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig", labels=list(s.cache_config))
        info.add_metric(list(s.cache_config.values()), 1.0)
        yield info
    if s.lora is not None:
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters",
                                         "running_lora_adapters"])
        lora.add_metric([str(s.lora.get("max_lora", 0)), ",".join(s.lora.get("waiting", [])),
                         ",".join(s.lora.get("running", []))], time.time())
        yield lora
    sd = s.spec_decode
    if sd is not None:
        yield counter("spec_decode_num_drafts", "Number of spec decoding drafts.",
                      sd["num_drafts"])
        yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.",
                      sd["num_draft_tokens"])
        yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      sd["num_accepted_tokens"])
        pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft's positions.",
                                  labels=[*keys, "position"])
        for k, n in enumerate(sd["accepted_per_pos"]):
            pos.add_metric([*values, str(k)], n)
        yield pos


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
    """The server's registry: the snapshot collector (engine figures), the request recorder
    (``record``: what the front end observes) and the counters the middleware and admission
    increment."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str = "kvserve",
                 max_model_len: int = 2048) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.record = RequestRecorder(max_model_len)
        vllm = {"model_name": model_name, "engine": "0"}
        self.registry.register(_SnapshotCollector(snapshot, self.record, vllm))  # type: ignore[arg-type]
        r = self.registry
        self.http_errors = Counter("kvserve_http_errors", "HTTP responses with status >= 400.",
                                   ["status"], registry=r)
        self.rejected = Counter("kvserve_requests_rejected",
                                "Generation requests refused before reaching the engine.",
                                ["reason"], registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
