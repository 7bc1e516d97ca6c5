"""benchmarks/tracing_overhead.py end to end on tiny settings (demo model): both modes ran
every round without a failure, the JSON holds the machine, the medians and the overhead, and
the collector process received exactly the traced server's spans (4 per request: the
request, queue, prefill, decode) -- the untraced server sent none. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from tests.bench.test_benchmark_scripts import _script

pytest.importorskip("opentelemetry.sdk")
pytestmark = pytest.mark.slow


def test_tracing_overhead_tiny(tmp_path) -> None:
    out = tmp_path / "t.json"
    mod = _script("tracing_overhead")
    assert mod.main(["--model", "demo", "--concurrency", "4", "--requests", "8",
                     "--max-tokens", "6", "--rounds", "2", "--serve-args",
                     "--max-num-seqs 4 --kv-cache-memory 16MiB", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "tracing_overhead" and doc["env"]["cpu"]["model"]
    (res,) = doc["results"]
    assert [(r["round"], r["mode"]) for r in res["runs"]] == [
        (0, "off"), (0, "on"), (1, "on"), (1, "off")]  # rotated
    assert all(r["failed"] == 0 and r["output_tok_s"] > 0 for r in res["runs"])
    assert set(res["median"]) == {"off", "on"} and "output_tok_s" in res["overhead_pct"]
    assert res["collector"]["spans"] == 4 * (4 + 2 * 8)  # warm-up + 2 rounds, traced server
