"""vLLM-compatible metrics (docs/server.md, "Metrics"): the table in the doc is the
specification. A live in-process server's ``/metrics``, parsed with prometheus_client's own
text parser, exports every "always" row under its name, type and labels, and nothing the table
lacks; a snapshot with every optional part on (integrity, KV tiers, transfer, speculation,
LoRA) exports every row. The figures agree with the responses and with their kvserve twins;
the Gateway API Inference Extension's model-server metrics (queued, running, KV utilization,
LoRA info, block size) are gauges that move with the load."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.stats import BucketCounts, EngineStats, SpecDecodeCounters
from kvserve.server.metrics import ServerMetrics
from tests.server.conftest import MODEL_NAME

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"


def doc_table() -> dict[str, tuple[str, frozenset[str], str]]:
    """name -> (type, labels, when) from the metrics table of docs/server.md."""
    text = DOC.read_text()
    section = text[text.index("## Metrics (`GET /metrics`)"):]
    section = section[:section.index("\n## ", 3)]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.fullmatch(r"`([^`]+)`", cells[0]).group(1)
        labels = frozenset(re.findall(r"`([^`]+)`", cells[2]))
        assert name not in rows, f"{name} is in the table twice"
        rows[name] = (cells[1], labels, cells[3])
    return rows


def exported(text: str) -> dict[str, tuple[str, frozenset[str], dict]]:
    """Exposed name -> (type, sample label names but le, {sample name + labels: value})."""
    out = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = frozenset(k for s in fam.samples for k in s.labels if k != "le")
        values = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}
        out[name] = (fam.type, labels, values)
    # prometheus_client's own counters add a "<name>_created" gauge (part of the counter)
    for name in [n for n in out if n.endswith("_created")]:
        if out.get(name[:-len("_created")] + "_total", ("",))[0] == "counter":
            del out[name]
    return out


def value(fams: dict, sample: str, **labels: str) -> float:
    for fam in fams.values():
        for (name, lbls), v in fam[2].items():
            if name == sample and all(dict(lbls).get(k) == x for k, x in labels.items()):
                return v
    raise KeyError(sample)


def check_rows(fams: dict, rows: dict, which) -> None:
    for name, (typ, labels, when) in rows.items():
        if not which(when):
            continue
        assert name in fams, f"{name} ({when}) is not exported"
        got_type, got_labels, samples = fams[name]
        assert got_type == typ, f"{name}: {got_type}, the table says {typ}"
        # a kvserve family labelled by an event (status, reason) has samples once one happened
        assert samples or (labels and not name.startswith("vllm:")), f"{name}: no samples"
        if samples:
                assert got_labels == labels, f"{name}: labels {sorted(got_labels)}, the table " \
                                         f"says {sorted(labels)}"


def test_table_parses():
    rows = doc_table()
    vllm = [n for n in rows if n.startswith("vllm:")]
    assert len(vllm) >= 25 and all(rows[n][0] in ("gauge", "counter", "histogram")
                                   for n in rows)
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:request_success_total", "vllm:iteration_tokens_total",
                 "vllm:spec_decode_num_drafts_total"):
        assert name in rows
    assert rows["vllm:request_success_total"][1] == {"model_name", "engine", "finished_reason"}


async def _post(c, path: str, body: dict) -> dict:
    r = await c.post(path, json={"model": MODEL_NAME, **body})
    assert r.status_code == 200, r.text
    if body.get("stream"):
        import json
        chunks = [json.loads(x[6:]) for x in r.text.splitlines()
                  if x.startswith("data: ") and x != "data: [DONE]"]
        return chunks[-1]
    return r.json()


def test_live_metrics_match_the_table_and_the_responses(inprocess):
    srv = inprocess()
    prompt = " ".join(f"w{i}" for i in range(200, 240))

    async def go():
        async with srv.client() as c:
            outs = [await _post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                                       "ignore_eos": True})
                    for _ in range(2)]
            outs.append(await _post(c, "/v1/completions", {
                "prompt": "w1 w2 w3", "max_tokens": 3, "n": 2, "ignore_eos": True}))
            outs.append(await _post(c, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 5,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}))
            deadline = time.monotonic() + 10  # the snapshot is the engine thread's latest
            while True:
                text = (await c.get("/metrics")).text
                fams = exported(text)
                if value(fams, "vllm:generation_tokens_total") == 4 + 4 + 6 + 5 or \
                        time.monotonic() > deadline:
                    return outs, fams
                await asyncio.sleep(0.05)

    outs, fams = srv.run(go())
    rows = doc_table()
    check_rows(fams, rows, lambda when: when == "always")
    missing = sorted(set(fams) - set(rows))
    assert not missing, f"exported but not in the table of docs/server.md: {missing}"
    for name in set(fams) & set(rows):  # optional families that are on: right type too
        assert fams[name][0] == rows[name][0], name
        if fams[name][2]:
            assert fams[name][1] == rows[name][1], name

    usage = [o["usage"] for o in outs]
    prompt_tokens = sum(u["prompt_tokens"] for u in usage)
    lab = {"model_name": MODEL_NAME, "engine": "0"}
    assert value(fams, "vllm:prompt_tokens_total", **lab) == prompt_tokens == value(
        fams, "kvserve_prompt_tokens_total")
    assert value(fams, "vllm:generation_tokens_total") == 19 == sum(
        u["completion_tokens"] for u in usage)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert cached >= 32  # the repeated 40-word prompt: two whole blocks
    assert value(fams, "vllm:prefix_cache_hits_total") >= cached
    assert value(fams, "vllm:prefix_cache_queries_total") >= prompt_tokens
    assert value(fams, "vllm:request_success_total", finished_reason="length") == 5  # choices
    assert value(fams, "vllm:request_success_total", finished_reason="stop") == 0
    # one record, two names: the kvserve twin has the same count and sum
    for base in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "inter_token_latency_seconds"):
        for part in ("_count", "_sum"):
            assert value(fams, f"vllm:{base}{part}") == value(fams, f"kvserve_{base}{part}")
    assert value(fams, "vllm:time_to_first_token_seconds_count") == 4  # HTTP requests
    assert value(fams, "vllm:inter_token_latency_seconds_count") == 3 + 3 + 2 + 4
    assert value(fams, "vllm:request_prompt_tokens_count") == 4  # prompts
    assert value(fams, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value(fams, "vllm:request_generation_tokens_sum") == 19
    assert value(fams, "vllm:request_params_n_sum") == 1 + 1 + 2 + 1
    assert value(fams, "vllm:request_queue_time_seconds_count") == 4
    assert value(fams, "vllm:request_decode_time_seconds_count") == 4
    assert value(fams, "vllm:iteration_tokens_total_count") == value(
        fams, "kvserve_engine_steps_total")
    assert value(fams, "vllm:iteration_tokens_total_bucket", le="1.0") >= 1  # decode steps
    assert value(fams, "vllm:num_requests_running") == value(fams,
                                                             "kvserve_num_requests_running")
    assert value(fams, "vllm:kv_cache_usage_perc") * 100 == pytest.approx(
        value(fams, "kvserve_kv_cache_usage_percent"))
    assert value(fams, "vllm:cache_config_info", block_size="16") == 1


def full_snapshot() -> EngineStats:
    """A snapshot with every optional part on (integrity, tiers, transfer, speculation,
    LoRA)."""
    spec = SpecDecodeCounters()
    spec.record(3, 2)
    spec.record(3, 0)
    it = BucketCounts((1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
    it.observe(7)
    return EngineStats(
        num_running=2, num_waiting=1, num_blocks_total=10, num_blocks_used=4, block_size=16,
        counters={"prompt_tokens": 10, "prefix_cache_queries": 10, "prefix_cache_hits": 4},
        iteration_tokens=it, cache_config={"block_size": "16", "num_gpu_blocks": "10",
                                           "cache_dtype": "bf16",
                                           "enable_prefix_caching": "True"},
        integrity={"checks": {"seal": 3}, "failures": {"prefix_hit": 1},
                   "repairs": {"prefix_hit": 1}},
        kv_tiers={"tiers": {"cpu": {"hits": 1, "misses": 2, "writes": 3, "bytes": 4,
                                    "cap_bytes": 5, "evictions": 6,
                                    "rejected": {"checksum": 1}}},
                  "queue_depth": 0, "dropped_writes": 0, "restore_buckets": [0.1],
                  "restore_counts": [1, 0], "restore_seconds": 0.05},
        kv_transfer={"exported": 1, "imported": 1, "blocks_installed": 2, "bytes_sent": 9,
                     "bytes_received": 9, "rejected": {"checksum": 1},
                     "fallbacks": {"timeout": 1}, "outstanding": 0, "expired": 0,
                     "latency_buckets": [0.1], "latency_counts": [1, 0],
                     "latency_seconds": 0.05},
        spec_decode=spec.as_dict(), lora={"max_lora": 2, "running": ["a"], "waiting": ["b"]})


def test_every_row_with_every_optional_part_on():
    snap = full_snapshot()
    metrics = ServerMetrics(lambda: snap, "m", 64)
    metrics.http_errors.labels("404").inc()
    metrics.rejected.labels("queue_full").inc()
    fams = exported(metrics.render()[0].decode())
    rows = doc_table()
    check_rows(fams, rows, lambda when: True)
    assert not set(fams) - set(rows)
    assert value(fams, "vllm:spec_decode_num_drafts_total") == 2
    assert value(fams, "vllm:spec_decode_num_draft_tokens_total") == 6
    assert value(fams, "vllm:spec_decode_num_accepted_tokens_total") == 2
    assert [value(fams, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(k))
            for k in range(3)] == [1, 1, 0]
    assert value(fams, "vllm:lora_requests_info", running_lora_adapters="a",
                 waiting_lora_adapters="b", max_lora="2") > 0
    assert value(fams, "vllm:kv_cache_usage_perc") == 0.4
    assert value(fams, "vllm:iteration_tokens_total_bucket", le="8.0") == 1
    # speculation and LoRA off: their families are absent
    off = exported(ServerMetrics(lambda: EngineStats(), "m", 64).render()[0].decode())
    assert not [n for n in off if "spec_decode" in n or "lora" in n]


def test_gateway_api_inference_extension_metrics(inprocess):
    """The endpoint picker's model-server protocol: TotalQueuedRequests, TotalRunningRequests
    and KVCacheUtilization are vLLM-named gauges that follow the load; block size and LoRA
    info where present."""
    srv = inprocess(step_delay_s=0.02, engine_kw={"max_num_seqs": 1})
    body = {"model": MODEL_NAME, "prompt": "w7 w8 w9", "max_tokens": 40, "ignore_eos": True}

    async def go():
        async with srv.client() as c:
            tasks = [asyncio.create_task(c.post("/v1/completions", json=body))
                     for _ in range(3)]
            seen = None
            deadline = time.monotonic() + 30
            while seen is None and time.monotonic() < deadline:
                fams = exported((await c.get("/metrics")).text)
                if value(fams, "vllm:num_requests_running") == 1 and value(
                        fams, "vllm:num_requests_waiting") >= 1:
                    seen = fams
                await asyncio.sleep(0.01)
            for t in tasks:
                assert (await t).status_code == 200
            idle = exported((await c.get("/metrics")).text)
            return seen, idle

    busy, idle = srv.run(go())
    assert busy is not None, "never saw one request running and another queued"
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:cache_config_info"):
        assert busy[name][0] == "gauge", name
        assert idle[name][0] == "gauge", name
    assert 0 < value(busy, "vllm:kv_cache_usage_perc") <= 1
    assert value(idle, "vllm:num_requests_running") == value(idle,
                                                             "vllm:num_requests_waiting") == 0
    assert value(idle, "vllm:cache_config_info", block_size="16") == 1
    assert "vllm:lora_requests_info" not in idle  # no LoRA served

    # LoRA through the engine's hook: the gauge appears with the protocol's labels
    srv.engine._engine.lora_info = lambda: {"max_lora": 4, "running": ["sql"],
                                            "waiting": []}

    async def once():
        async with srv.client() as c:
            r = await c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 200
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                fams = exported((await c.get("/metrics")).text)
                if "vllm:lora_requests_info" in fams:
                    return fams
                await asyncio.sleep(0.05)
            return fams

    fams = srv.run(once())
    typ, labels, _ = fams["vllm:lora_requests_info"]
    assert typ == "gauge"
    assert labels == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert value(fams, "vllm:lora_requests_info", running_lora_adapters="sql",
                 max_lora="4") > 0


def test_spec_decode_metrics_with_speculation_on(inprocess):
    """``--speculative-config``: the vllm:spec_decode_* counters appear, consistent with each
    other (accepted <= draft tokens; per position, drafts that accepted position k are
    non-increasing in k and add up to the accepted tokens)."""
    srv = inprocess(engine_kw={"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}})
    prompt = " ".join(["w11 w12 w13 w14"] * 8)  # repetitive: the n-gram drafter proposes

    async def go():
        async with srv.client() as c:
            r = await c.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 10
            while True:
                fams = exported((await c.get("/metrics")).text)
                if value(fams, "vllm:generation_tokens_total") >= 24 or \
                        time.monotonic() > deadline:
                    return fams
                await asyncio.sleep(0.05)

    fams = srv.run(go())
    rows = doc_table()
    for name in [n for n in rows if n.startswith("vllm:spec_decode_")]:
        typ, labels, _ = rows[name]
        assert fams[name][0] == typ and fams[name][1] == labels, name
    drafts = value(fams, "vllm:spec_decode_num_drafts_total")
    proposed = value(fams, "vllm:spec_decode_num_draft_tokens_total")
    accepted = value(fams, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts >= 1 and 0 <= accepted <= proposed <= 3 * drafts
    per_pos = [v for (n, _), v in sorted(
        fams["vllm:spec_decode_num_accepted_tokens_per_pos_total"][2].items(),
        key=lambda kv: int(dict(kv[0][1])["position"])) if n.endswith("_total")]
    assert sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
