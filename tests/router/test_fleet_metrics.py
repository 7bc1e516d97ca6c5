"""The router's /metrics repeats each replica's KV tier and transfer metrics (from its last
/metrics scrape) with a ``replica`` label: one scrape covers the fleet."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.metrics import RouterMetrics
from kvserve.router.prefix_index import PrefixIndex
from kvserve.router.replicas import Replica, scrape

REPLICA_TEXT = """\
# HELP kvserve_num_requests_running Running.
# TYPE kvserve_num_requests_running gauge
kvserve_num_requests_running 2.0
# HELP kvserve_kv_tier_hits_total Blocks restored.
# TYPE kvserve_kv_tier_hits_total counter
kvserve_kv_tier_hits_total{tier="disk"} %d.0
kvserve_kv_tier_hits_total{tier="memory"} 1.0
# HELP kvserve_kv_restore_seconds Restore time.
# TYPE kvserve_kv_restore_seconds histogram
kvserve_kv_restore_seconds_bucket{le="0.01"} 1.0
kvserve_kv_restore_seconds_bucket{le="+Inf"} 2.0
kvserve_kv_restore_seconds_sum 0.5
kvserve_kv_restore_seconds_count 2.0
# HELP kvserve_kv_transfer_outstanding Offered transfers.
# TYPE kvserve_kv_transfer_outstanding gauge
kvserve_kv_transfer_outstanding 4.0
"""


def test_router_metrics_label_each_replicas_tier_metrics() -> None:
    reps = {}
    for i, hits in enumerate((3, 7)):
        r = Replica(f"r{i}", f"http://h{i}")
        m, r.fleet = scrape(REPLICA_TEXT % hits)
        assert m["kvserve_num_requests_running"] == 2.0
        assert [f.name for f in r.fleet] == ["kvserve_kv_tier_hits", "kvserve_kv_restore_seconds",
                                             "kvserve_kv_transfer_outstanding"]
        reps[r.name] = r
    state = SimpleNamespace(pool=SimpleNamespace(replicas=reps), index=PrefixIndex(),
                            prefill_pool=None)
    body, _ = RouterMetrics(state).render()
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    hits = {(s.labels["replica"], s.labels["tier"]): s.value
            for s in fams["kvserve_kv_tier_hits"].samples if s.name.endswith("_total")}
    assert hits == {("r0", "disk"): 3, ("r0", "memory"): 1, ("r1", "disk"): 7,
                    ("r1", "memory"): 1}
    assert fams["kvserve_kv_restore_seconds"].type == "histogram"
    counts = {s.labels["replica"]: s.value for s in fams["kvserve_kv_restore_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"r0": 2.0, "r1": 2.0}
    assert {s.labels["replica"] for s in fams["kvserve_kv_transfer_outstanding"].samples} == {
        "r0", "r1"}
    # the replica's own running count is not repeated (the router has its own gauge for it)
    assert "kvserve_num_requests_running" not in fams
