"""The whole engine on the AVX-512 kernels, on any AVX2 machine (issue 31): a child process runs
with KVSERVE_CPU_BUILD=bf16_emu, so every C kernel is the AVX-512 + VNNI + BF16 build with the
512-bit intrinsics emulated (kvserve/csrc/emu/avx512_simde.h). It loads a bf16 folder (its
tables packed 4 x 16 for AVX-512) and a Q4_1 / Q8_0 GGUF (the vpdpbusd GEMM), records the CPU
decode graph, and generates; the tokens equal this process's native build and the logprobs
agree within the noise of adding in another vector width.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvserve.cbuild import can_run_variant, kernel_build
from kvserve.kernels.cpu.w16_gemm import w16_library
from tests.conftest import require_simde

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(w16_library() is None, reason="no C compiler"),
              pytest.mark.skipif(not can_run_variant("bf16_emu"), reason="needs AVX2"),
              pytest.mark.skipif(kernel_build() != "native",
                                 reason="compares with this process's native build")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[5, 9, 17, 33], [100, 7, 250, 3, 8, 41, 77, 90, 11, 4, 300], [400, 401]]
MAX_TOKENS = [6, 10, 14]


def _run_all(cases: list[tuple[str, str, str]], bf16_dot_rows: int = 0) -> dict:
    """Each (name, model, kv_cache_dtype): graph state, tokens and chosen-token logprobs, and
    the start-up log's CPU path line. ``bf16_dot_rows``: 0 pins the exact fp32 dots (auto
    would pick bf16 dots on an AVX512-BF16 / AMX host: AMX tiles natively, vdpbf16ps in the
    emulated build, which round differently); else the bf16 dot products from that many rows,
    with the CPU's flags reporting AVX512-BF16 (as tests/conftest.py's simulate_cpu does)."""
    import logging

    from kvserve import cbuild

    if bf16_dot_rows:
        from tests.conftest import SIMULATED_CPUS

        cbuild.cpu_flags = lambda: SIMULATED_CPUS["avx512_bf16"][0]
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    logger = logging.getLogger("kvserve")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return _generate_all(cases, bf16_dot_rows, lines)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _generate_all(cases, bf16_dot_rows, lines: list[str]) -> dict:
    from kvserve import LLM, SamplingParams
    from kvserve.cbuild import kernel_build
    from kvserve.kernels.cpu import paged_attention, w16_gemm

    out = {"build": kernel_build(), "packing": list(w16_gemm.packing(w16_gemm.w16_library())),
           "attention_simd": paged_attention.simd_level(), "runs": {}}
    for name, model, kv in cases:
        lines.clear()
        llm = LLM(model, progress=False, kv_cache_memory="8MiB", kv_cache_dtype=kv,
                  cpu_bf16_dot_rows=bf16_dot_rows)
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=1)
                  for m in MAX_TOKENS]
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        g = llm.engine.runner.graphs
        out["runs"][name] = {
            "graph": g is not None and g.refused is None, "replays": g.runs if g else 0,
            "tokens": [list(o.token_ids) for o in outs],
            "logprobs": [[lp[t] for t, lp in zip(o.token_ids, o.logprobs, strict=True)]
                         for o in outs],
            "cpu_path": next((x for x in lines if x.startswith("CPU path:")), "")}
        llm.engine.debug.check_no_leaks()
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[tuple[str, str, str]]:
    from tests.conftest import make_tiny_model
    from tests.model.gguf_writer import write_gguf

    d = tmp_path_factory.mktemp("emu_engine")
    # head_dim 64: the AVX-512 attention's register path for decode rows
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True)
    folder = make_tiny_model(str(d / "bf16"), "llama", save_dtype=torch.bfloat16, **shape)
    hf = make_tiny_model(str(d / "hf"), "llama", **shape)
    gguf = write_gguf(hf, str(d / "q4.gguf"),
                      lambda g: "Q8_0" if g.startswith("token_embd") else "Q4_1")
    return [("bf16", folder, "auto"), ("bf16_int8kv", folder, "int8"), ("q4", gguf, "auto")]


def _emulated(cases, bf16_dot_rows: int = 0) -> dict:
    """_run_all in a child process on the bf16_emu build."""
    require_simde()
    code = ("import json, sys; from tests.engine.test_emulated_avx512_engine import _run_all; "
            "print('RESULT' + json.dumps(_run_all(*json.loads(sys.argv[1]))))")
    env = dict(os.environ, KVSERVE_CPU_BUILD="bf16_emu")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([cases, bf16_dot_rows])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line[6:] for line in proc.stdout.splitlines()
                           if line.startswith("RESULT")))


def test_engine_on_emulated_avx512_kernels_matches_native(cases):
    emu = _emulated(cases)
    native = _run_all(cases)
    assert emu["build"] == "bf16_emu" and native["build"] == "native"
    assert emu["packing"] == [4, 16] and emu["attention_simd"] == 2  # the AVX-512 code ran
    for name, want in native["runs"].items():
        got = emu["runs"][name]
        assert got["graph"] and got["replays"] > 0, name  # the decode graph recorded, replayed
        assert got["tokens"] == want["tokens"], name
        # different vector widths add in different orders (~1e-6); a bf16 KV entry or an int8
        # activation code can then round the other way (measured: up to 9e-4 / 3e-4)
        for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
            assert a == pytest.approx(b, abs=3e-3), name


def test_opt_in_bf16_dot_products_in_the_engine(cases):
    """``cpu_bf16_dot_rows=4`` on an AVX512-BF16 CPU (flags simulated, the bf16_emu build): the
    log names the path, the tables are packed (the dot products read the tiles), and the
    prompts' GEMMs (>= 4 rows) take bf16-rounded activations: logprobs move off the fp32
    ones, by about bf16's rounding, not more."""
    folder = [c for c in cases if c[0] == "bf16"]
    dots = _emulated(folder, bf16_dot_rows=4)
    fp32 = _emulated(folder)
    assert "bf16 dot products (vdpbf16ps) for GEMMs of >= 4 rows" in dots["runs"]["bf16"][
        "cpu_path"]
    assert "bf16 dot products available" in fp32["runs"]["bf16"]["cpu_path"] or \
        "fp32 dot products" in fp32["runs"]["bf16"]["cpu_path"]
    assert dots["packing"] == [4, 16]
    got, want = dots["runs"]["bf16"], fp32["runs"]["bf16"]
    assert got["graph"] and got["replays"] > 0  # decode rows (< 4 per step) keep fp32 dots
    first = [(a[0], b[0]) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)]
    assert max(abs(a - b) for a, b in first) > 1e-5  # the prompt's GEMMs took the bf16 path
    assert [t[0] for t in got["tokens"]] == [t[0] for t in want["tokens"]]
    for a, b in first:
        assert a == pytest.approx(b, abs=5e-2)
