"""benchmarks/router.py: its pieces (workload, statistics, plot) and one tiny run (demo model,
2 replicas behind the router, prefix policy, 2 short conversations)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import pytest

from kvserve.engine.arg_utils import demo_model_path

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "router.py"
_spec = importlib.util.spec_from_file_location("router_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["router_bench"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def test_workload_and_statistics() -> None:
    turns = bench.conversation_turns(3, 4, 300)
    assert len(turns) == 4 and turns[0].startswith("Document 3:")
    assert bench.document(3, 300) == bench.document(3, 300) != bench.document(4, 300)
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert bench.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    rates = [{"kvserve_prefix_cache_hit_rate": 0.5, "kvserve_prompt_tokens_total": 300.0},
             {"kvserve_prefix_cache_hit_rate": 0.0, "kvserve_prompt_tokens_total": 100.0}]
    assert bench.weighted_hit_rate(rates) == pytest.approx(0.375)
    assert bench.weighted_hit_rate([]) == 0.0


def test_plot(tmp_path) -> None:
    rows = [{"label": x, "prefix_cache_hit_rate": h, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2,
             "output_tokens_per_s": 10.0} for x, h in (("1 replica", 0.5), ("prefix", 0.7))]
    bench.plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(os.path.join(demo_model_path(), "model.safetensors")),
                    reason="demo model not present")
def test_tiny_run(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--model", "demo", "--conversations", "2", "--turns", "2",
                       "--doc-tokens", "90", "--answer-tokens", "2", "--policies", "prefix",
                       "--no-baseline", "--kv-cache-memory", "16MiB", "--out", str(out),
                       "--startup-timeout", "300",
                       # a second turn sent at once: the router knows where the first turn
                       # ran from the prompt it routed, whether or not the replica's KV events
                       # have arrived yet (they may not have on a loaded host)
                       "--think-time", "0"]) == 0
    doc = json.loads(out.read_text())
    (r,) = doc["results"]
    assert doc["env"]["cpu"] and r["requests"] == 4 and r["output_tokens"] >= 4
    assert r["replicas"] == 2 and 0.0 <= r["prefix_cache_hit_rate"] <= 1.0
    # the second turn of each conversation resends its document: routed by prefix
    assert any("prefix" in k for k in r["routing_decisions"])
