"""The CPU attention kernel per query-row count: the AMX-BF16 job vs the AVX-512 (FMA) job, one
run, JSON out.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/attention_rows.py [--rows 1,2,3,4,6,8]
        [--batch 16] [--context 400] [--layers 30] [--kv-heads 3] [--group 3]
        [--head-dim 64] [--kv bf16] [--repeats 40] [--threads 2] [--json OUT]

Shapes default to the default model's (SmolLM2-135M) decode / verify step: R consecutive query
rows of ONE request (a speculative verify step: lens context - R + 1 .. context; as the
engine plans it, the request's table repeated per row: the AMX job tiles the rows, the AVX-512
job runs each alone), for each R of ``--rows``, and ``--batch`` requests of one row each, over
``--layers`` layers (one call per layer, each layer's own KV; blocks of 16 scattered at
random). Per shape the two jobs are timed interleaved (the kernel's AMX switch flipped
between calls); medians of ms per step (all layers). Needs a CPU with AMX-BF16 for the AMX
column (else it reports the FMA job only).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.bench.common import env_info, log, write_json
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.config import KVMode
from kvserve.kernels.cpu import paged_attention as cpu_kernel

KV = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8,
      "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv", default="bf16", choices=sorted(KV))
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dll = cpu_kernel.load()
    if dll is None:
        raise SystemExit("the C kernel did not build here (no compiler?)")
    was = cpu_kernel.has_amx(dll)
    amx = cpu_kernel.set_amx(dll, True)
    bs, hk, d = 16, a.kv_heads, a.head_dim
    mb = -(-a.context // bs)
    nb = a.batch * mb + 1
    kv = PagedKVCache(a.layers, nb, bs, hk, d, 2, KVMode(KV[a.kv]))
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(nb * 2 * bs).view(nb, 2, bs)[:, 0].reshape(-1)
    for layer in range(a.layers):
        x = torch.randn(slots.numel(), hk, d, generator=g)
        kv.write(layer, slots, x, torch.randn(x.shape, generator=g))
    perm = torch.randperm(nb, generator=g)
    tables = perm[:a.batch * mb].view(a.batch, mb).contiguous()
    shapes = [(f"rows{r}", r) for r in map(int, a.rows.split(","))] + [(f"batch{a.batch}", 0)]
    results = []
    for name, rows in shapes:
        # as the engine plans them (kvserve.attention.metadata.plan_rows): one table per row
        if rows:  # R verify rows of request 0: its table repeated
            rt = tables[:1].repeat(rows, 1).contiguous()
            lens = torch.arange(a.context - rows + 1, a.context + 1, dtype=torch.int64)
        else:  # one decode row per request
            rt = tables
            lens = torch.full((a.batch,), a.context, dtype=torch.int64)
        n = lens.numel()
        q = torch.randn(n, hk * a.group, d, generator=g)
        outs = {k: torch.empty_like(q) for k in ("amx", "fma")}

        def step(out: torch.Tensor, q=q, rt=rt, lens=lens) -> None:
            for layer in range(a.layers):
                cpu_kernel.paged_attention(kv.data[layer],
                                           kv.scales[layer] if kv.has_scales else None, q,
                                           rt, None, lens, d**-0.5, out, dll=dll)

        paths = ["amx", "fma"] if amx else ["fma"]
        times: dict[str, list[float]] = {k: [] for k in paths}
        for r in range(a.repeats + 3):
            for k in paths[r % len(paths):] + paths[:r % len(paths)]:
                cpu_kernel.set_amx(dll, k == "amx")
                t0 = time.perf_counter()
                step(outs[k])
                if r >= 3:  # warm-up
                    times[k].append(time.perf_counter() - t0)
        row = {"shape": name, "rows": n, "requests": 1 if rows else a.batch,
               "ms_per_step": {k: statistics.median(ts) * 1e3 for k, ts in times.items()}}
        if amx:
            row["max_abs_diff"] = float((outs["amx"] - outs["fma"]).abs().max())
        results.append(row)
        log(f"{name:>8}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["ms_per_step"].items()))
    cpu_kernel.set_amx(dll, was)
    write_json(a.json, {"bench": "attention_rows", "args": vars(a), "amx": amx,
                        "results": results, "env": env_info()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
