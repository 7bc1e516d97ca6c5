"""deploy/grafana/kvserve.json: every panel expression parses (kvserve/bench/promql.py, the
evaluator benchmarks/dashboard.py draws the panels with) and names only metrics the server
exports; on two scrapes of a live server every always-on panel has data. The evaluator itself
against hand-computed answers."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import pytest

from kvserve.bench.promql import Evaluator, parse, scrape_samples, selectors
from kvserve.server.metrics import ServerMetrics
from tests.server.conftest import MODEL_NAME
from tests.server.test_vllm_metrics import full_snapshot

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvserve.json"
VARIABLES = {"model_name": ".*", "__rate_interval": "30s"}
# metrics with data only when a part is on (tiers, transfer) or after an event (a failure)
OPTIONAL = ("kvserve_kv_tier", "kvserve_kv_transfer", "kvserve_kv_restore",
            "kvserve_integrity_failures", "kvserve_integrity_repairs")


def targets() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            out.append((panel["title"], t["expr"]))
    return out


def test_every_expression_names_an_exported_metric():
    samples = {name for name, _ in scrape_samples(
        ServerMetrics(full_snapshot, MODEL_NAME, 64).render()[0].decode())}
    seen = set()
    for title, expr in targets():
        for sel in selectors(parse(expr, VARIABLES)):
            assert sel.name in samples, f"panel {title!r}: {sel.name} is not exported"
            seen.add(sel.name)
    # the panels: KV usage per tier, prefix hits, TTFT / ITL, queue, transfer,
    # integrity
    for name in ("vllm:kv_cache_usage_perc", "kvserve_kv_tier_bytes",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "kvserve_inter_token_latency_seconds_bucket", "vllm:num_requests_waiting",
                 "vllm:request_queue_time_seconds_bucket", "kvserve_kv_transfer_bytes_total",
                 "kvserve_integrity_checks_total", "kvserve_integrity_repairs_total"):
        assert name in seen, name


def test_panels_have_data_on_a_live_server(inprocess):
    srv = inprocess()

    async def go():
        scrapes = []
        async with srv.client() as c:
            for round_ in range(2):
                for i in range(3):
                    r = await c.post("/v1/completions", json={
                        "model": MODEL_NAME, "prompt": " ".join(f"w{j}" for j in range(40)),
                        "max_tokens": 4 + i, "ignore_eos": True})
                    assert r.status_code == 200
                await asyncio.sleep(0.2)  # the engine thread publishes its snapshot
                scrapes.append((time.time() + 10 * round_,  # spread: rates over 10 s
                                scrape_samples((await c.get("/metrics")).text)))
        return scrapes

    ev = Evaluator(srv.run(go()))
    for title, expr in targets():
        series = ev.series(expr, VARIABLES)
        if any(sel.name.startswith(OPTIONAL) for sel in selectors(parse(expr, VARIABLES))):
            continue
        assert series, f"panel {title!r}: {expr} has no data"
        for pts in series.values():
            assert all(math.isfinite(v) and v >= 0 for _, v in pts), (title, expr)


def test_evaluator_against_hand_computed_answers():
    s0 = {("c_total", frozenset({("r", "a")})): 10.0, ("c_total", frozenset({("r", "b")})): 0.0,
          ("g", frozenset()): 4.0, ("h_bucket", frozenset({("le", "1.0")})): 0.0,
          ("h_bucket", frozenset({("le", "2.0")})): 0.0,
          ("h_bucket", frozenset({("le", "+Inf")})): 0.0}
    s1 = {("c_total", frozenset({("r", "a")})): 40.0, ("c_total", frozenset({("r", "b")})): 10.0,
          ("g", frozenset()): 2.0, ("h_bucket", frozenset({("le", "1.0")})): 4.0,
          ("h_bucket", frozenset({("le", "2.0")})): 8.0,
          ("h_bucket", frozenset({("le", "+Inf")})): 8.0}
    ev = Evaluator([(100.0, s0), (110.0, s1)])
    last = ev.eval(parse('rate(c_total{r="a"}[1m])'), 1)
    assert last == {frozenset({("r", "a")}): 3.0}
    assert ev.eval(parse("sum(rate(c_total[1m]))"), 1) == {frozenset(): 4.0}
    assert ev.eval(parse("sum by (r) (increase(c_total[1m]))"), 1) == {
        frozenset({("r", "a")}): 30.0, frozenset({("r", "b")}): 10.0}
    assert ev.eval(parse('rate(c_total{r=~"a|b"}[1m]) / g'), 1) == {}  # labels differ
    assert ev.eval(parse("sum(rate(c_total[1m])) / sum(g) * 2"), 1) == {frozenset(): 4.0}
    # 8 observations: 4 in (0, 1], 4 in (1, 2]; the median is 1.0, p75 1.5
    q = ev.eval(parse("histogram_quantile(0.75, sum by (le) (rate(h_bucket[1m])))"), 1)
    assert q == {frozenset(): pytest.approx(1.5)}
    q = ev.eval(parse("histogram_quantile(0.5, rate(h_bucket[1m]))"), 1)
    assert q == {frozenset(): pytest.approx(1.0)}
    assert ev.eval(parse("rate(c_total[1m])"), 0) == {}  # one point: no rate yet
    with pytest.raises(ValueError, match="unsupported function"):
        parse("irate(c_total[1m])")
    with pytest.raises(ValueError, match="unknown dashboard variable"):
        parse("g{x=~\"$nope\"}")
