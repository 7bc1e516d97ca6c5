"""benchmarks/pd_disagg.py: its pieces (workload, per-token gaps, statistics, plot) and one
tiny run of both configurations (demo model, 2 replicas each, a few short requests)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import pytest

from kvserve.engine.arg_utils import demo_model_path

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "pd_disagg.py"
_spec = importlib.util.spec_from_file_location("pd_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["pd_bench"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def test_pieces() -> None:
    assert bench.long_prompt(1, 300) == bench.long_prompt(1, 300) != bench.long_prompt(2, 300)
    # chunks at 0 (1 token: TTFT), 1.0 (1 token), 3.0 (2 tokens): gaps 1.0, 1.0, 1.0
    assert bench.token_gaps([(0.0, 1), (1.0, 1), (3.0, 2)]) == [1.0, 1.0, 1.0]
    assert bench.token_gaps([(0.0, 1)]) == []
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    s = [bench.Stream("chat", 0.5, 3, [0.1, 0.2]), bench.Stream("long", 2.0, 1, [])]
    row = bench.summarize("x", s, 2.0)
    assert row["chat_itl_p50_s"] == pytest.approx(0.15) and row["long_ttft_p50_s"] == 2.0
    assert row["output_tokens_per_s"] == 2.0


def test_plot(tmp_path) -> None:
    keys = ["chat_itl_p50_s", "chat_itl_p90_s", "chat_itl_p99_s", "chat_ttft_p50_s",
            "chat_ttft_p90_s", "long_ttft_p50_s", "long_ttft_p90_s", "output_tokens_per_s"]
    rows = [{"label": lab, **dict.fromkeys(keys, 0.1)} for lab in ("a", "b")]
    bench.plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(os.path.join(demo_model_path(), "model.safetensors")),
                    reason="demo model not present")
def test_tiny_run(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--model", demo_model_path(), "--chats", "2", "--chat-tokens", "6",
                       "--longs", "1", "--long-tokens", "120", "--long-start", "0.2",
                       "--kv-cache-memory", "16MiB", "--startup-timeout", "240",
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "cpu" in doc["env"]
    colo, pd = doc["results"]
    assert colo["requests"] == pd["requests"] == 3
    assert pd["output_tokens"] == colo["output_tokens"] == 2 * 6 + 4
    assert pd["transfer"]["kvserve_kv_transfer_blocks_installed_total"] > 0
