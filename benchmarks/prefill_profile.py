"""Where a prefill's time goes (GEMM / attention / other) with fp32 dot products and with the
bf16 dot products (AMX tiles where the CPU has them, else vdpbf16ps), per step token budget;
the GEMMs' rate against the CPU's measured ceilings. One run, JSON out.

    .venv/bin/python benchmarks/prefill_profile.py [--model .bench/smollm2-bf16] [--batch 16]
        [--input-len 128] [--rows 0,1] [--budgets 512,2048] [--repeats 3] [--threads 2]
        [--json OUT]

For each (``--cpu-bf16-dot-rows`` value in ``--rows``, step token budget
``max_num_batched_tokens`` in ``--budgets``) one engine of the model is built (prefix caching
off, so every repeat computes its prompts). Each repeat submits ``--batch`` random prompts of
``--input-len`` tokens (one output token each) and runs the engine until they finish, with
wall-clock timers around the parts:

    gemm       every dense linear forward (Linear / MergedLinear / Q8 / INT4: the GEMMs, the
               LM head's last rows included)
    attention  the C paged-attention kernel
    other      the rest of the steps (embedding, norms, rope, KV writes, sampling, scheduling)

Configs run round-robin per repeat (rotating who goes first); medians are reported, with the
GEMMs' GFLOP/s (2 x dense weights x prompt tokens / gemm time) beside two ceilings measured in
the same run: torch's fp32 GEMM and torch's bf16 GEMM (oneDNN; AMX where present) on a hot
1024^3 problem (wall time). ``--clock cpu`` times the parts in process CPU seconds
instead. ``rows`` 0 is the exact fp32 path; 1 is bf16 dots for every GEMM. ``--amx-block-rows`` (AMX
CPUs, rows > 0) adds configs with that threshold of the cache-blocked AMX GEMM (0: the build's
default; 1000000000: the in-place 4 x 16 tiles for every GEMM, the path before it; the same
bits either way), e.g. ``--amx-block-rows 0,1000000000`` for a before / after.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

from kvserve.bench.common import (
    env_info,
    log,
    model_label,
    random_prompts,
    resolve_model_path,
    write_json,
)
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kernels.cpu import w16_gemm as w16
from kvserve.sampling_params import SamplingParams


def _step_profile():
    """benchmarks/step_profile.py (its Timers and class timers), loaded by path."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_profile.py")
    spec = importlib.util.spec_from_file_location("kvserve_bench_step_profile", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def _ceiling(dtype: torch.dtype) -> float:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 1024, generator=g).to(dtype)
    b = torch.randn(1024, 1024, generator=g).to(dtype)
    a @ b
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    return 2 * 1024**3 / statistics.median(ts) / 1e9


def _dense_params(eng: LLMEngine) -> int:
    """Weights the prompt tokens' GEMMs multiply (dense linears, LM head excluded)."""
    from kvserve.quant.w16 import tiles_of

    model = eng.executor.driver.model_runner.model
    n = 0
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if w is None or "lm_head" in name or "embed" in name or w.dim() != 2:
            continue
        t = tiles_of(w)
        n += w.numel() if t is None else t.rows * t.cols
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=".bench/smollm2-bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--rows", default="0,1", help="--cpu-bf16-dot-rows values (0: fp32 dots)")
    ap.add_argument("--budgets", default="512,2048", help="max_num_batched_tokens values")
    ap.add_argument("--amx-block-rows", default="0",
                    help="AMX blocked-GEMM thresholds to compare (rows > 0 on AMX CPUs; 0: the "
                         "build's default, 1000000000: the in-place tiles only)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU seconds (all threads) instead of wall time; on a "
                         "busy shared host with --threads 1 that is the run's own time")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sp = _step_profile()
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    timers = sp.Timers(clock)
    undo = sp.install_class_timers(timers)
    try:
        return _run(a, timers)
    finally:
        undo()
        w16.set_bf16_dot_rows(None)


def _run(a: argparse.Namespace, timers) -> int:
    model = resolve_model_path(a.model)
    rows = [int(v) for v in a.rows.split(",")]
    budgets = [int(v) for v in a.budgets.split(",")]
    blocks = [int(v) for v in a.amx_block_rows.split(",")]
    lib = w16.w16_library()
    if lib is None or not w16.has_amx(lib):
        blocks = blocks[:1]
    configs = [(r, b, ab) for r in rows for b in budgets for ab in (blocks if r else blocks[:1])]
    engines = {}
    for r, b, _ in configs:
        if (r, b) in engines:
            continue
        eng = LLMEngine(EngineArgs(model=model, progress=False, seed=a.seed,
                                   enable_prefix_caching=False, max_num_batched_tokens=b,
                                   max_num_seqs=max(a.batch, 1), cpu_bf16_dot_rows=r,
                                   kv_cache_memory=max(64 * 2**20, 2 * a.batch * (
                                       a.input_len + 16) * 2**13)))
        engines[r, b] = eng
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: dict = {c: [] for c in configs}
    for rep in range(a.repeats + 1):  # repeat 0 warms up
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for r, b, ab in order:
            eng = engines[r, b]
            w16.set_bf16_dot_rows(r)  # what each engine's worker set at its start
            if lib is not None:
                w16.set_amx_block_rows(lib, ab)
            prompts = random_prompts(a.batch, a.input_len, eng.model_config.vocab_size,
                                     a.seed + 1000 * rep + r + b)
            for i, p in enumerate(prompts):
                eng.add_request(f"p{rep}_{i}", p, params)
            timers.current.clear()
            t0 = timers.clock()
            while eng.has_unfinished_requests():
                eng.step()
            total = timers.clock() - t0
            if rep:
                times[r, b, ab].append({"total": total, "gemm": timers.current["linear"],
                                    "attention": timers.current["attention"]})
    ceil32, ceil16 = _ceiling(torch.float32), _ceiling(torch.bfloat16)
    tokens = a.batch * a.input_len
    unit = "AMX tiles" if lib is not None and w16.has_amx(lib) else (
        "vdpbf16ps" if lib is not None and w16.has_bf16_dot(lib) else "twin/none")
    results = []
    for r, b, ab in configs:
        med = {k: statistics.median(t[k] for t in times[r, b, ab])
               for k in times[r, b, ab][0]}
        flops = 2 * _dense_params(engines[r, b]) * tokens
        row = {"bf16_dot_rows": r, "dots": unit if r else "fp32", "budget": b,
               "amx_block_rows": ab if r and unit == "AMX tiles" else None,
               "total_s": med["total"], "gemm_s": med["gemm"], "attention_s": med["attention"],
               "other_s": med["total"] - med["gemm"] - med["attention"],
               "prompt_tok_per_s": tokens / med["total"],
               "gemm_gflops": flops / med["gemm"] / 1e9}
        results.append(row)
        log(f"rows={r} ({row['dots']}"
            + (f", block rows {ab}" if row["amx_block_rows"] is not None else "")
            + f") budget={b}: {row['total_s']:.3f} s "
            f"({row['prompt_tok_per_s']:.0f} tok/s): gemm {row['gemm_s']:.3f} s "
            f"({row['gemm_gflops']:.0f} GFLOP/s), attention {row['attention_s']:.3f} s, "
            f"other {row['other_s']:.3f} s")
    log(f"ceilings (torch, hot 1024^3): fp32 {ceil32:.0f} GFLOP/s, bf16 {ceil16:.0f} GFLOP/s")
    write_json(a.json, {"bench": "prefill_profile", "model": model_label(a.model),
                        "batch": a.batch, "input_len": a.input_len, "threads": a.threads,
                        "clock": a.clock,
                        "repeats": a.repeats, "results": results,
                        "ceiling_gflops_torch_fp32": ceil32, "ceiling_gflops_torch_bf16": ceil16,
                        "env": env_info()})
    if lib is not None:
        w16.set_amx_block_rows(lib, 0)
    for eng in engines.values():
        del eng
    return 0


if __name__ == "__main__":
    sys.exit(main())
