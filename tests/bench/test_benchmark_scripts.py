"""The stand-alone benchmark scripts (benchmarks/*.py) run end to end on tiny settings and write
what they promise. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import pytest

from kvserve.kernels.cpu import paged_attention as cpu_kernel
from kvserve.layers import linear

# slow: runs the benchmark scripts
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(name: str):
    spec = importlib.util.spec_from_file_location(
        f"benchmarks_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"benchmarks_{name}"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler")
def test_step_profile_tiny(tmp_path):
    from kvserve.quant.rotation import KVRotation

    sp = _script("step_profile")
    before = (cpu_kernel.paged_attention, linear.Linear.forward, linear.MergedLinear.forward,
              KVRotation.apply)
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert sp.main(["--model", "demo", "--configs", "bf16@2,int8@3", "--context", "24",
                    "--steps", "2", "--repeats", "2", "--threads", "1", "--json", str(out),
                    "--plot", str(png)]) == 0
    # its timers are gone again
    assert (cpu_kernel.paged_attention, linear.Linear.forward,
            linear.MergedLinear.forward, KVRotation.apply) == before
    r = json.loads(out.read_text())
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert [(c["kv_cache_dtype"], c["batch"]) for c in r["configs"]] == [("bf16", 2), ("int8", 3)]
    # the rotated mode's q/k/v and output rotations are timed as their own part
    assert r["configs"][0]["parts_ms"]["rotation"] == 0 < r["configs"][1]["parts_ms"]["rotation"]
    for c in r["configs"]:
        assert len(c["windows"]) == 2
        assert set(c["parts_ms"]) == set(r["parts"])
        assert c["parts_ms"]["attention"] > 0 and c["parts_ms"]["linear"] > 0
        # the parts partition the step (engine = step - forward - sampling, so they add up)
        assert sum(c["parts_ms"].values()) == pytest.approx(c["step_ms"], rel=0.25)
        assert c["prefill_us_per_token"] > 0 and c["projected_tokens_per_s"] > 0
    assert r["summary"]["baseline"] == "bf16@2" and r["summary"]["candidate"] == "int8@3"
    assert all(c["graph_kernels_ms"] is None for c in r["configs"])  # eager: no graph
    with pytest.raises(ValueError, match="DTYPE@BATCH"):
        sp.main(["--configs", "fp8"])
    # decode graphs: the replay's time per kernel, from the recorded forward's own calls
    assert sp.main(["--model", "demo", "--configs", "bf16@2", "--context", "24", "--steps",
                    "2", "--repeats", "2", "--threads", "1", "--graphs", "--json",
                    str(out)]) == 0
    split = json.loads(out.read_text())["configs"][0]["graph_kernels_ms"]
    calls = split["calls"]
    assert calls["all"] == sum(n for k, n in calls.items() if k != "all")
    assert {"kvs_paged_attention", "kvs_write_kv"} <= set(calls) and set(split["ms"]) == set(calls)
    assert all(ms > 0 for ms in split["ms"].values())


@pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler")
def test_attention_kernel_tiny(tmp_path):
    ak = _script("attention_kernel")
    out = tmp_path / "a.json"
    assert ak.main(["--batch", "3", "--context", "40", "--layers", "1", "--repeats", "3",
                    "--budget-mib", "1", "--threads", "1", "--json", str(out),
                    "--baseline-source",
                    os.path.join(ROOT, "kvserve", "csrc", "paged_attention.c")]) == 0
    r = json.loads(out.read_text())
    assert [x["kv_cache_dtype"] for x in r["results"]] == ["bf16", "fp8_e4m3", "fp8_e5m2",
                                                          "int8", "fp32"]
    for x in r["results"]:
        assert x["evicted_bytes_before_each_call"] >= 64 * 2**20
        for path in ("kernel", "kernel_portable", "torch_twin", "baseline"):
            assert x[path]["ms_per_step"] > 0
        assert x["kv_bytes_per_step"] == 3 * 40 * x["kv_bytes_per_token"]


def test_w16_gemm_tiny(tmp_path):
    from kvserve.kernels.cpu import w16_gemm as w16

    if w16.w16_library() is None:
        pytest.skip("no C compiler")
    wg = _script("w16_gemm")
    # the baseline is the current source built a second time: the script must build it
    out = tmp_path / "g.json"
    assert wg.main(["--threads", "1", "--rounds", "1", "--rows", "1,5", "--layers", "1",
                    "--baseline-source", os.path.join(ROOT, "kvserve", "csrc", "w16_gemm.c"),
                    "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["rows"] for x in r["results"]] == [1, 5]
    for x in r["results"]:
        for impl in ("kvserve", "torch_fp32", "baseline"):
            assert x[impl]["layers_gflops"] > 0 and x[impl]["head_gflops"] > 0
    assert r["ceiling_gflops_torch_fp32_hot"] > 0 and r["env"]["cpu"]


def test_wq_gemm_tiny(tmp_path):
    """The GGUF GEMM benchmark replays recorded graphs of both builds and says whether their
    outputs agree (the same source twice: they must)."""
    from kvserve.kernels.cpu import graph
    from kvserve.kernels.cpu import wq_gemm as wq_cpu

    if wq_cpu.wq_library() is None or not graph.available():
        pytest.skip("no C compiler")
    wg = _script("wq_gemm")
    out = tmp_path / "q.json"
    assert wg.main(["--threads", "1", "--rounds", "1", "--rows", "1,3", "--layers", "1",
                    "--bandwidth-mib", "64",
                    "--baseline-source", os.path.join(ROOT, "kvserve", "csrc", "wq_gemm.c"),
                    "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["rows"] for x in r["results"]] == [1, 3]
    assert r["layer_bytes"] > 0 and r["head_bytes"] > r["layer_bytes"]  # one layer vs the head
    for x in r["results"]:
        assert x["identical_to_baseline"] is True
        for impl in ("kvserve", "baseline"):
            assert x[impl]["layers_gbs"] > 0 and x[impl]["head_ms"] > 0
            assert x[impl]["pass_over_floor"] > 0
    assert r["read_bandwidth"]["read_gbs"] > 0 and r["env"]["cpu"]


def test_omp_contention_tiny(tmp_path):
    """The busy-core benchmark builds the static and the work-stealing kernels, times them
    alone and beside its burner, and says that their outputs agree (they must)."""
    from kvserve.kernels.cpu import graph
    from kvserve.kernels.cpu import wq_gemm as wq_cpu

    if wq_cpu.wq_library() is None or not graph.available():
        pytest.skip("no C compiler")
    out = tmp_path / "c.json"
    assert _script("omp_contention").main(
        ["--threads", "2", "--rounds", "1", "--replays", "2", "--rows", "1,16", "--layers", "1",
         "--chunks", "8", "--busy-us", "100", "--period-us", "1000", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["rows"] for x in r["results"]] == [1, 16]
    for x in r["results"]:
        assert x["identical"] is True and x["gemm_rows"] == 2 * x["rows"]
        for name in ("static", "steal_c8"):
            assert x[name]["alone"]["mean_ms"] > 0 and x[name]["contended"]["mean_ms"] > 0
    assert r["burner_cpu_share"] >= 0 and r["env"]["cpu"]  # (clock ticks: 0 in a short run)


def test_wq_gemm_amx_tiny(tmp_path):
    """--amx times the VNNI pass and the AMX-INT8 tiles on the same tables (the head alone with
    --layers 0) and finds their outputs bit for bit the same."""
    from kvserve.kernels.cpu import graph
    from kvserve.kernels.cpu import wq_gemm as wq_cpu

    lib = wq_cpu.wq_library()
    if lib is None or not graph.available():
        pytest.skip("no C compiler")
    if not wq_cpu.amx_rows(lib):
        pytest.skip("this CPU (or its native build, or Linux) has no AMX-INT8 tiles")
    rows = wq_cpu.amx_rows(lib)
    out = tmp_path / "a.json"
    assert _script("wq_gemm").main(["--threads", "1", "--rounds", "1", "--rows", "2,17",
                                    "--layers", "0", "--head", "1024,640", "--amx",
                                    "--bandwidth-mib", "64", "--json", str(out)]) == 0
    assert wq_cpu.amx_rows(lib) == rows  # the kernel's threshold is back
    r = json.loads(out.read_text())
    assert r["shape_list"][-1] == ["lm_head", 1024, 640] and r["layer_bytes"] == 0
    for x in r["results"]:
        assert x["identical_amx"] is True and set(x["amx_speedup"]) == {"head"}
        assert x["kvserve"]["head_ms"] > 0 and x["kvserve_amx"]["head_ms"] > 0


def test_kq_gemm_tiny(tmp_path):
    """The K-quant GEMM benchmark times every type it is given against the 16-bit GEMM and the
    memory floor, and records env.cpu."""
    from kvserve.kernels.cpu import graph
    from kvserve.kernels.cpu import kq_gemm as kq_cpu

    if kq_cpu.kq_library() is None or not graph.available():
        pytest.skip("no C compiler")
    kg = _script("kq_gemm")
    out = tmp_path / "k.json"
    assert kg.main(["--threads", "1", "--rounds", "1", "--rows", "1,3", "--layers", "1",
                    "--hidden", "256", "--inter", "512", "--types", "Q4_K,Q6_K,Q5_0",
                    "--bandwidth-mib", "64", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [(x["type"], x["rows"]) for x in r["results"]] == [
        ("Q4_K", 1), ("Q4_K", 3), ("Q6_K", 1), ("Q6_K", 3), ("Q5_0", 1), ("Q5_0", 3)]
    for x in r["results"]:
        assert x["ms"] > 0 and x["over_floor"] > 0 and x["vs_w16"] > 0
        assert 1.0 <= x["resident_over_file"] <= 1.1
    assert r["read_bandwidth"]["read_gbs"] > 0 and r["env"]["cpu"]


def test_kq_gemm_baseline_tiny(tmp_path):
    """--baseline-source builds another kq_gemm.c (here this one again) and replays the same
    calls on it: its times, the speedup and bit for bit the same outputs; --no-w16 skips the
    16-bit GEMM."""
    from kvserve.kernels.cpu import graph
    from kvserve.kernels.cpu import kq_gemm as kq_cpu

    if kq_cpu.kq_library() is None or not graph.available():
        pytest.skip("no C compiler")
    out = tmp_path / "k.json"
    assert _script("kq_gemm").main([
        "--threads", "1", "--rounds", "1", "--rows", "1,3", "--layers", "1", "--hidden", "256",
        "--inter", "512", "--types", "Q4_K,Q5_1", "--no-w16", "--bandwidth-mib", "64",
        "--baseline-source", os.path.join(ROOT, "kvserve", "csrc", "kq_gemm.c"),
        "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["baseline_source"].endswith("kq_gemm.c") and r["env"]["cpu"]
    for x in r["results"]:
        assert x["identical_to_baseline"] is True and x["baseline_ms"] > 0 and x["speedup"] > 0
        assert x["w16_ms"] is None and x["vs_w16"] is None


def test_kq_gemm_amx_tiny(tmp_path):
    """--amx times the VNNI pass and the AMX-INT8 tiles per type and finds their outputs bit for
    bit the same; the kernel's threshold is restored."""
    from kvserve.kernels.cpu import graph
    from kvserve.kernels.cpu import kq_gemm as kq_cpu
    from kvserve.kernels.cpu import wq_gemm as wq_cpu

    lib = kq_cpu.kq_library()
    if lib is None or not graph.available():
        pytest.skip("no C compiler")
    rows = wq_cpu.amx_rows(lib)
    if not rows:
        pytest.skip("this CPU (or its native build, or Linux) has no AMX-INT8 tiles")
    out = tmp_path / "k.json"
    assert _script("kq_gemm").main(["--threads", "1", "--rounds", "1", "--rows", "2,17",
                                    "--layers", "1", "--hidden", "256", "--inter", "512",
                                    "--types", "Q4_K,Q5_0", "--amx", "--bandwidth-mib", "64",
                                    "--json", str(out)]) == 0
    assert wq_cpu.amx_rows(lib) == rows
    r = json.loads(out.read_text())
    assert r["amx"] is True and r["amx_rows_default"] == rows
    for x in r["results"]:
        assert x["identical_amx"] is True and x["vnni_ms"] > 0 and x["amx_ms"] > 0


def test_kv_tiers_tiny(tmp_path):
    kt = _script("kv_tiers")
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    # the remote store alone needs redis-server (.ci/run installs it; elsewhere it may be absent)
    redis = bool(shutil.which("redis-server") or shutil.which("valkey-server")
                 or os.environ.get("CI") == "true")
    configs = ["off", "memory", "disk", "disk_restart"] + ["redis"] * redis
    assert kt.main(["--model", "demo", "--conversations", "3", "--turns", "2", "--doc", "40",
                    "--question", "4", "--answer", "3", "--concurrency", "2",
                    "--noreuse-requests", "2", "--threads", "1", "--json", str(out),
                    "--plot", str(png), "--configs", ",".join(configs)]) == 0
    r = json.loads(out.read_text())
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert r["env"]["cpu"]["model"] is not None or "cpu" in r["env"]
    assert list(r["chat"]) == configs
    assert r["outputs_identical"]
    for name, c in r["chat"].items():
        assert c["requests"] == 6 and c["ttft_p90_ms"] >= c["ttft_p50_ms"] > 0
        assert (c["kv_tiers"] is None) == (name == "off")
    # the pool holds a quarter of the working set: later turns come back from the tiers
    assert r["chat"]["memory"]["restored_tokens"] > 0
    assert r["chat"]["disk"]["kv_tiers"]["tiers"]["disk"]["hits"] > 0
    # after the restart even the first turns' documents come from disk
    assert r["chat"]["disk_restart"]["restored_tokens"] > r["chat"]["disk"]["restored_tokens"]
    # the remote store alone (a private redis-server the script starts and stops)
    assert not redis or r["chat"]["redis"]["restored_tokens"] > 0
    assert r["noreuse"]["throughput_ratio"] > 0
    with pytest.raises(ValueError, match="disk_restart"):
        kt.main(["--model", "demo", "--configs", "off,disk_restart"])


def test_bf16_dot_kl_tiny(tmp_path):
    """The accuracy-cost script on a tiny bf16 folder: the bf16-dot run differs from the fp32
    one (KL > 0: the kernel, or its twin where the CPU lacks AVX512-BF16) and the module's
    functions are restored afterwards."""
    from kvserve.kernels.cpu import w16_gemm as w16
    from tests.conftest import make_tiny_model

    if w16.w16_library() is None:
        pytest.skip("no C compiler")
    import torch

    before = (w16.linear_w16, w16.bf16_dot_rows)
    model = make_tiny_model(str(tmp_path / "m"), "llama", save_dtype=torch.bfloat16)
    bk = _script("bf16_dot_kl")
    out = tmp_path / "k.json"
    assert bk.main(["--model", model, "--prompts", "2", "--len", "24", "--rows", "8",
                    "--threads", "1", "--json", str(out)]) == 0
    assert (w16.linear_w16, w16.bf16_dot_rows) == before
    r = json.loads(out.read_text())
    assert r["positions"] == 2 * 24 and r["kl_mean"] > 0 and 0 < r["top1_agreement"] <= 1
    assert r["ran"] == ("kernel" if w16.has_bf16_dot(w16.w16_library()) else
                        "twin (this CPU lacks AVX512-BF16)")


def test_prefill_profile_tiny(tmp_path):
    """The prefill breakdown on a tiny bf16 folder: one row per (rows, budget) config, its
    parts within its total, the GEMMs' rate and both ceilings positive, and the engine's
    bf16-dot setting put back afterwards."""
    from kvserve.kernels.cpu import w16_gemm as w16
    from tests.conftest import make_tiny_model

    if w16.w16_library() is None:
        pytest.skip("no C compiler")
    import torch

    model = make_tiny_model(str(tmp_path / "m"), "llama", save_dtype=torch.bfloat16)
    pp = _script("prefill_profile")
    out = tmp_path / "p.json"
    assert pp.main(["--model", model, "--batch", "2", "--input-len", "16", "--budgets", "16,64",
                    "--rows", "0,1", "--repeats", "1", "--threads", "1", "--clock", "cpu",
                    "--json", str(out)]) == 0
    assert w16._engine_rows is None
    r = json.loads(out.read_text())
    assert [(x["bf16_dot_rows"], x["budget"]) for x in r["results"]] == [
        (0, 16), (0, 64), (1, 16), (1, 64)]
    for x in r["results"]:
        assert x["total_s"] > 0 and x["gemm_gflops"] > 0
        assert 0 <= x["gemm_s"] + x["attention_s"] <= x["total_s"]
    assert r["ceiling_gflops_torch_fp32"] > 0 and r["ceiling_gflops_torch_bf16"] > 0
    assert r["env"]["cpu"]["kind"]


def test_structured_outputs_tiny(tmp_path):
    so = _script("structured_outputs")
    out = tmp_path / "so.json"
    assert so.main(["--model", "demo", "--batch", "1", "2", "--output-len", "6", "--repeats",
                    "1", "--compile-repeats", "1", "--kv-cache-memory", "16MiB",
                    "--json-out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["schema_fields"] == 20
    assert [row["batch"] for row in r["results"]] == [1, 2]
    for row in r["results"]:
        for mode in ("unconstrained", "json_schema"):
            assert row[mode]["tokens_per_s"] > 0 and row[mode]["answers"] == row["batch"]
        assert row["json_schema"]["example"].startswith("{")
    c = r["compile"]
    assert c["compile_cold_ms"] > 0 and c["compile_cached_ms"] > 0


def test_grammar_backends_tiny(tmp_path):
    from kvserve.engine.arg_utils import demo_model_path

    gb = _script("grammar_backends")
    out = tmp_path / "gb.json"
    gb.main(["--tokenizer", demo_model_path(), "--backend", "llguidance", "--json-out",
             str(out)])
    r = json.loads(out.read_text())
    (res,) = r["results"]
    assert res["backend"].startswith("llguidance") and res["tokens"] > 50
    assert res["text_head"].startswith('{"id": 1042, "name": "Ada Lovelace"')
    assert r["env"]["cpu"]["kind"] and r["versions"]["llguidance"] == res["backend"].split()[1]


def test_default_flags_parity_tiny(tmp_path):
    """The default-flags parity script on the demo model: 8 chat prompts, both KV runs, the
    full-forward reference, and where a run differs, the reference's top-2 gap there."""
    dp = _script("default_flags_parity")
    out = tmp_path / "p.json"
    assert dp.main(["--model", "demo", "--tokens", "3", "--threads", "1", "--json",
                    str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["prompts"] == 8 and r["kv_modes"] == {"bf16": "bf16", "int8": "int8_rot"}
    assert set(r["greedy_equal_to_reference"]) == {"bf16", "int8"}
    kl = r["kl_bf16_vs_candidate"]
    assert kl["positions"] == 8 * 3 and 0 <= kl["mean"] <= kl["max"]
    assert 0 <= kl["top1_agreement"] <= 1
    assert r["env"]["cpu"]["kind"]
    for row in r["per_prompt"]:
        assert len(row["reference"]) == 3
        for kv in ("bf16", "int8"):
            d = row[kv]
            assert d["equal"] == (d["first_difference"] is None)
            if not d["equal"]:
                assert d["tokens"][d["first_difference"]] != row["reference"][d["first_difference"]]
                assert d["reference_top2_gap_there"] >= 0
    with pytest.raises(SystemExit):
        dp.main(["--tokens", "0"])


def test_served_vs_offline_tiny(tmp_path):
    """The served / offline script on the demo model: both sides run the same prompts to the
    same token count, the ratio is theirs, and the JSON records the CPU."""
    so = _script("served_vs_offline")
    out = tmp_path / "so.json"
    assert so.main(["--model", "demo", "--threads", "1", "--input-len", "12", "--output-len",
                    "5", "--num-prompts", "3", "--concurrency", "2", "--warmup", "1",
                    "--warmup-tokens", "2", "--timeout", "300", "--json", str(out),
                    "--serve-args", "--output-handoff step",
                    "--engine-args", "--kv-cache-memory", "16MiB"]) == 0
    r = json.loads(out.read_text())
    (rd,) = r["rounds"]
    assert rd["offline"]["total_output_tokens"] == rd["served"]["total_output_tokens"] == 3 * 5
    assert rd["offline"]["torch_threads"] == 1
    # every request's 5 tokens take 5 steps at least, on both sides (the server's: its metric)
    assert rd["offline"]["steps"] >= 5 and rd["served"]["steps"] >= 5
    assert r["served_over_offline"] == pytest.approx(
        rd["served"]["output_throughput"] / rd["offline"]["output_throughput"])
    assert r["env"]["cpu"]["kind"] and r["config"]["engine_args"] == ["--kv-cache-memory",
                                                                    "16MiB"]
    assert r["config"]["serve_args"] == "--output-handoff step"
