"""Benchmark harnesses on tiny random models: they run, write what they promise, and the quality
metrics are exact for identical configurations. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from kvserve.bench.common import (
    model_label,
    parse_kv_pairs,
    parse_list,
    percentile,
    random_llama_spec,
    rotated,
)
from kvserve.cli import main

# slow: runs whole benchmarks, an HF peer included
pytestmark = pytest.mark.slow

# head_dim 64 (hidden 128, 2 heads): FP8 rows are 64 B + 2 B of scale vs 128 B in BF16.
HD64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture(autouse=True)
def _no_peer_installed(tmp_path, monkeypatch):
    """No peer interpreter found by default: not this machine's KVSERVE_*_PYTHON, nor the venvs
    of scripts/setup_peers.sh (a test asks for a peer it means to find missing)."""
    from kvserve.bench.peers import PEER_PYTHON_ENV

    for var in PEER_PYTHON_ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVSERVE_PEERS_DIR", str(tmp_path / "no-peers"))


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on a shared, oversubscribed CPU two spinning threads cost far more than
    they give (and nothing here measures speed)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hd64(model_factory) -> str:
    return model_factory("llama", **HD64)


def test_helpers():
    assert parse_list("1, 2,2,4", int, "x") == [1, 2, 4]
    with pytest.raises(ValueError, match="--concurrency"):
        parse_list("1,a", int, "--concurrency")
    assert rotated([1, 2, 3], 4) == [2, 3, 1]
    assert percentile([0, 10], 50) == 5.0
    s = random_llama_spec("hidden=512,layers=8,heads=8,kv_heads=2,vocab=32000")
    assert s["ffn"] == 1536 and s["max_pos"] == 4096
    with pytest.raises(ValueError, match="unknown key"):
        random_llama_spec("hiden=5")


def test_model_label_carries_no_machine_path(tmp_path, monkeypatch):
    import os

    from kvserve.engine.arg_utils import demo_model_path

    assert model_label(demo_model_path()) == "kvserve/demo_model"
    assert model_label(os.path.join(demo_model_path(), "heldout.txt")) == \
        "kvserve/demo_model/heldout.txt"
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_label(str(tmp_path / "m")) == "m"
    assert model_label("/elsewhere/model") == "/elsewhere/model"


def test_quality_identical_candidate_is_exact(tiny_llama, tmp_path):
    out = tmp_path / "q.json"
    rc = main(["bench", "quality", "--model", tiny_llama, "--kv-cache-dtype", "bf16",
               "--ppl-max-tokens", "512", "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["num_prompts"] >= 16 and r["gen_len"] >= 256
    assert r["text_source"]["kind"] == "generated"
    assert r["greedy_agreement"] == 1.0
    assert r["first_divergence_fraction"] == 1.0
    assert r["divergence_margin_max"] is None
    assert all(p["divergence_margin"] is None for p in r["per_prompt"])
    assert r["kl_mean"] < 1e-9 and r["kl_p99"] < 1e-9
    assert r["perplexity_ratio"] == pytest.approx(1.0, abs=1e-12)
    assert r["baseline"]["perplexity"] > 1.0
    assert r["kl_positions"] == r["num_prompts"] * r["gen_len"]
    for key in ("baseline", "candidate"):
        assert r[key]["kv_cache_dtype"] == "bf16"


def test_quality_fp8_candidate_differs_a_little(tiny_llama, tmp_path):
    from kvserve.bench.quality import QualityConfig, run_quality
    from kvserve.engine.arg_utils import EngineArgs

    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{(i * 7) % 300}" for i in range(2000)))
    r = run_quality(QualityConfig(base=EngineArgs(model=tiny_llama), text=str(text),
                                  num_prompts=4, gen_len=32, ppl_max_tokens=512,
                                  progress=False))
    assert r["text_source"]["kind"] == "file"
    assert r["candidate"]["kv_cache_dtype"] == "fp8_e4m3_plain"
    assert 0.0 < r["kl_mean"] < 0.1
    assert 0.9 < r["perplexity_ratio"] < 1.1
    gaps = r["baseline_top2_gap"]
    assert 0.0 <= gaps["p1"] <= gaps["p5"] <= gaps["p10"] <= gaps["p50"]
    for p in r["per_prompt"]:  # the baseline's own token is its argmax: the gap is >= 0
        assert (p["divergence_margin"] is None) == (p["first_divergence"] is None)
        assert p["divergence_margin"] is None or p["divergence_margin"] >= 0.0


def test_throughput_two_levels_bf16_fp8(hd64, tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = main(["bench", "throughput", "--model", hd64, "--kv-cache-dtype", "bf16,fp8",
               "--concurrency", "2,4", "--input-len", "16", "--output-len", "8",
               "--num-prompts-per-level", "6", "--warmup-requests", "2",
               "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert [c["kv_cache_dtype"] for c in r["configs"]] == ["bf16", "fp8_e4m3_plain"]
    for cfg in r["configs"]:
        assert cfg["kv_bytes_per_token"] > 0 and cfg["capacity_tokens"] > 0
        assert cfg["leak_check"] == "ok"
        assert [lv["concurrency"] for lv in cfg["levels"]] == [2, 4]
        for lv in cfg["levels"]:
            for k in ("output_tokens_per_s", "max_concurrent_seqs", "mean_running_batch",
                      "mean_step_ms", "ttft_ms_median", "itl_ms_median", "preemptions"):
                assert k in lv
            assert lv["output_tokens_per_s"] > 0
            assert lv["max_concurrent_seqs"] == lv["concurrency"]
            assert lv["requests_completed"] >= 6  # a step may finish several
        assert cfg["decode_step_ms_by_batch"]
    # auto32: BF16 holds exactly 32 sequences of 16 + 8 tokens (two 16-token blocks each)
    assert r["configs"][0]["capacity_tokens"] == 32 * 32
    s = r["summary"]
    assert s["capacity_ratio"] >= 1.9
    assert s["peak_ratio"] > 0
    assert s["decode_peak_ratio"] > 0
    assert s["equal_batch_size"] in (2, 4) and s["equal_batch_overhead"] is not None
    assert r["peer"] == "not requested"


def test_integrity_alias_overheads(tiny_llama, tmp_path):
    out = tmp_path / "i.json"
    rc = main(["bench", "integrity", "--model", tiny_llama, "--kv-integrity", "off,on",
               "--concurrency", "2", "--input-len", "16", "--output-len", "4",
               "--num-prompts-per-level", "4", "--warmup-requests", "0",
               "--peer", "vllm", "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["command"] == "integrity"
    assert [c["name"] for c in r["configs"]] == ["fp8_e4m3_plain/off", "fp8_e4m3_plain/on"]
    ov = r["summary"]["integrity_overhead"]["fp8_e4m3_plain"]["on"]
    assert set(ov["by_concurrency"]) == {"2"}
    # input 16 = one full block per request: sealed (and timed) in the measured runs
    assert ov["seconds_by_kind"]["seal"] > 0 and 0 < ov["time_fraction"] < 1
    assert r["peer"] == "not installed"  # none given nor found (_no_peer_installed)


def test_latency_batch_1_2_with_hf_peer(tiny_llama, tmp_path):
    out = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", tiny_llama, "--batch-sizes", "1,2",
               "--input-len", "8", "--output-len", "6", "--rounds", "2", "--peer", "hf",
               "--peer", "llamacpp", "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [x["batch_size"] for x in r["kvserve"]] == [1, 2]
    for x in r["kvserve"]:
        assert x["decode_tokens_per_s"] > 0
        assert x["decode_steps_per_round"] == 5  # output_len - 1: the first token is prefill
        assert len(x["decode_tokens_per_s_rounds"]) == 2
    hf = r["peers"]["hf"]
    assert [x["batch_size"] for x in hf["results"]] == [1, 2]
    assert all(x["decode_tokens_per_s"] > 0 for x in hf["results"])
    assert r["peers"]["llamacpp"] == "not installed"
    assert set(r["summary"]["kvserve_over_hf"]) == {"1", "2"}


def test_latency_hf_peer_reads_a_gguf(tiny_llama, tmp_path):
    """--peer hf on a GGUF: transformers dequantizes the same file (not a config.json error)."""
    from tests.model.gguf_writer import write_gguf

    gguf = write_gguf(tiny_llama, str(tmp_path / "llama.gguf"), lambda g: "F32")
    out = tmp_path / "g.json"
    rc = main(["bench", "latency", "--model", gguf, "--batch-sizes", "1", "--input-len", "8",
               "--output-len", "4", "--rounds", "1", "--peer", "hf", "--bandwidth-probe-mib",
               "64", "--json", str(out), "--no-progress"])
    assert rc == 0
    hf = json.loads(out.read_text())["peers"]["hf"]
    assert [x["batch_size"] for x in hf["results"]] == [1]
    assert hf["results"][0]["decode_tokens_per_s"] > 0


def test_latency_compare_model_and_memory(tiny_llama, model_factory, tmp_path):
    """--compare-model: a second kvserve engine in the same run (rounds rotated), with its
    table, memory and greedy agreement; every engine reports its memory."""
    other = model_factory("llama", tie_word_embeddings=True)
    out = tmp_path / "c.json"
    rc = main(["bench", "latency", "--model", tiny_llama, "--compare-model", other,
               "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "4", "--rounds", "1",
               "--bandwidth-probe-mib", "64", "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    bw = r["env"]["read_bandwidth"]
    assert bw["read_gbs"] > 0 and bw["buffer_mib"] == 64 and "cpu" in r["env"]
    assert r["env"]["cpu"]["kind"] in ("amx", "avx512_bf16", "avx512", "avx2", "portable")
    fl = r["memory_floor"]
    # untied tiny Llama: the embedding table (512 x 64 fp32) is not read by a decode step
    assert fl["weight_bytes_per_step"] == r["memory"]["weights_mib"] * 2**20 - 512 * 64 * 4
    assert fl["mean_context_tokens"] == 8 + 4 / 2 and fl["kv_bytes_per_token"] > 0
    for x in r["kvserve"]:
        want = ((fl["weight_bytes_per_step"] + x["batch_size"] * fl["kv_bytes_per_token"] * 10)
                / (bw["read_gbs"] * 1e9) * 1e3)
        assert x["floor_ms"] == pytest.approx(want)
        assert x["step_over_floor"] == pytest.approx(x["decode_step_ms_median"] / x["floor_ms"])
    cmp_ = r["peers"]["kvserve_compare"]
    assert [x["batch_size"] for x in cmp_["results"]] == [1, 2]
    assert all(x["decode_tokens_per_s"] > 0 for x in cmp_["results"])
    for mem in (r["memory"], cmp_["memory"]):
        assert mem["weights_mib"] > 0 and mem["kv_pool_mib"] > 0
        assert mem["weights_bf16_mib"] <= mem["weights_mib"]  # fp32 weights: 2x bf16
    assert r["memory"]["weights_mib"] > cmp_["memory"]["weights_mib"]  # tied head: fewer
    assert set(r["summary"]["kvserve_over_compare"]) == {"1", "2"}


def test_make_random_llama_spec_errors_name_the_option():
    assert parse_kv_pairs("a=1, b=2", "x") == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="--make-random-llama"):
        random_llama_spec("hidden=100,heads=3")


def test_decode_peak_hand_worked():
    from kvserve.bench.throughput import decode_peak

    by_batch = {1: [0.01] * 5, 4: [0.02] * 5, 8: [0.05, 0.01]}  # batch 8: too few samples
    assert decode_peak(by_batch, 3) == {"batch": 4, "tokens_per_s": 200.0}
    assert decode_peak(by_batch, 6) is None


def test_placeholder_spm_runner_writes_the_expected_model(tmp_path):
    """The llama.cpp converter's placeholder vocab is built by sentencepiece's own protobuf in
    the peer's interpreter (no hand-written encoder); these are the bytes of 10 pieces."""
    pytest.importorskip("sentencepiece")
    import hashlib
    import subprocess
    import sys

    from kvserve.bench.peers import script_path

    out = tmp_path / "tokenizer.model"
    subprocess.run([sys.executable, script_path("placeholder_spm")], check=True, text=True,
                   input=json.dumps({"vocab": 10, "out": str(out)}), capture_output=True)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == (
        "239df34aebf4a37bb2245876b1dd70dad9b1482845485d2408e8b476b3b153d2")


def test_decode_weight_bytes_counts_a_tied_table_once_and_an_untied_one_not(model_factory,
                                                                              make_llm):
    from kvserve.bench.latency import decode_weight_bytes
    from kvserve.model.loader import weight_bytes

    tied = make_llm(model_factory("llama", tie_word_embeddings=True)).engine.model
    untied = make_llm(model_factory("llama")).engine.model
    assert decode_weight_bytes(tied) == weight_bytes(tied)[0]  # the head reads the table
    emb = untied.model.embed_tokens.weight
    assert decode_weight_bytes(untied) == weight_bytes(untied)[0] - emb.numel() * 4
