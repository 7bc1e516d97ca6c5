"""The CPU attention read path per KV dtype: C kernel vs its pure-torch twin, one run, JSON out.

    .venv/bin/python benchmarks/attention_kernel.py [--batch 32] [--context 192] [--layers 4]
        [--kv-heads 2] [--group 2] [--head-dim 64] [--budget-mib 16] [--repeats 30]
        [--threads 2] [--baseline-source OLD.c] [--window W] [--json OUT]

Shapes default to the demo model's decode step at the throughput benchmark's KV limit: B
sequences of ``context`` tokens in blocks of 16, scattered at random over a cache of
``budget-mib`` (BF16 16 MiB = 8,192 tokens), 4 layers, 2 KV heads x 2 query heads of 64. Before
every timed call a buffer of twice the last-level cache is rewritten, so the KV comes from
memory as it does between the GEMMs of a real step (not from a warm cache). Per dtype: the C
kernel's best job on this CPU (AVX-512 / AVX2, else the portable one), the portable job forced,
the twin (gather into a workspace, widen FP8 with the integer trick, fp32 matmuls) and, with
``--baseline-source``, the kernel built from another source file; interleaved, medians.
Reported: ms per step (all layers), KV bytes read per step and the effective GB/s.
``--window W``: every layer a sliding-window layer (Gemma 3's local layers) reading the last W
keys of each sequence only (the KV bytes counted are then those of the blocks it reads).
"""

from __future__ import annotations

import argparse
import glob
import statistics
import tempfile
import time

import torch

from kvserve.attention.cpu_backend import CpuAttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.bench.common import env_info, log, write_json
from kvserve.cache.kv_cache import PagedKVCache, bytes_per_block
from kvserve.cbuild import build_source
from kvserve.config import KVMode
from kvserve.kernels.cpu import paged_attention as cpu_kernel

# unrotated: the kernel reads what is stored ("int8" is int8_plain)
MODES = {name: KVMode(dtype) for name, dtype in (
    ("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn),
    ("fp8_e5m2", torch.float8_e5m2), ("int8", torch.int8))}


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (0 where it cannot be read)."""
    best = 0
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index) as f:
                text = f.read().strip()
        except OSError:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best


def setup(mode: KVMode, a) -> tuple[PagedKVCache, AttentionMetadata, torch.Tensor]:
    bs = 16
    per_block = bytes_per_block(a.layers, bs, a.kv_heads, a.head_dim, 2, mode)
    nb = max(a.budget_mib * 2**20 // per_block, a.batch * -(-a.context // bs))
    kv = PagedKVCache(a.layers, nb, bs, a.kv_heads, a.head_dim, 2, mode)
    g = torch.Generator().manual_seed(0)
    rows = torch.arange(nb * 2 * bs).view(nb, 2, bs)[:, 0].reshape(-1)
    for layer in range(a.layers):
        x = torch.randn(rows.numel(), a.kv_heads, a.head_dim, generator=g)
        kv.write(layer, rows, x, torch.randn(x.shape, generator=g))
    perm = torch.randperm(nb, generator=g).tolist()
    mb = -(-a.context // bs)
    tables = [perm[i * mb:(i + 1) * mb] for i in range(a.batch)]
    meta = AttentionMetadata(num_tokens=a.batch, query_start_loc=list(range(a.batch + 1)),
                             query_lens=[1] * a.batch, seq_lens=[a.context] * a.batch,
                             block_tables=tables, write_rows=torch.empty(0, dtype=torch.int64),
                             slot_mapping=torch.empty(0, dtype=torch.int64))
    q = torch.randn(a.batch, a.kv_heads * a.group, a.head_dim, generator=g)
    return kv, meta, q


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--budget-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3,fp8_e5m2,int8,fp32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--window", type=int, default=0,
                    help="sliding window of every layer (0: full causal attention)")
    ap.add_argument("--baseline-source", default=None,
                    help="also time the kernel built from this paged_attention.c (e.g. the "
                         "version before a change: git show REV:kvserve/csrc/paged_attention.c)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if cpu_kernel.load() is None:
        raise SystemExit("the C kernel did not build here (no compiler?)")
    # written before every timed call: twice the last-level cache (>= 64 MiB), so no KV block
    # is left in any cache level (a 64 MiB buffer did not evict a 260 MiB L3)
    base = (cpu_kernel.bind(build_source(a.baseline_source, tempfile.mkdtemp(prefix="kvs-pa-")))
            if a.baseline_source else None)
    evict = torch.empty(max(16 * 2**20, 2 * last_level_cache_bytes() // 4))
    empty = torch.empty(0, a.kv_heads, a.head_dim)
    rows = []
    for name in a.dtypes.split(","):
        kv, meta, q = setup(MODES[name], a)
        be = CpuAttentionBackend(kv, a.kv_heads * a.group, a.kv_heads, a.head_dim,
                                   a.head_dim**-0.5, 4096,
                                   layer_windows=(a.window,) * a.layers if a.window else ())
        plan = be._plan(meta).kernel
        out = torch.empty_like(q)

        def kernel(force_scalar: bool, kv=kv, plan=plan, q=q, out=out, dll=None) -> None:
            for layer in range(a.layers):
                cpu_kernel.paged_attention(kv.data[layer],
                                           kv.scales[layer] if kv.has_scales else None, q,
                                           plan[1], plan[0], plan[2], a.head_dim**-0.5, out,
                                           window=a.window, force_scalar=force_scalar,
                                           dll=dll)

        def twin(be=be, meta=meta, q=q) -> None:
            be.use_kernel = False
            meta.cache.clear()
            for layer in range(a.layers):
                be.forward(layer, q, empty, empty, meta)
            be.use_kernel = True

        paths = {"kernel": lambda: kernel(False), "kernel_portable": lambda: kernel(True),
                 "torch_twin": twin}
        if base is not None:
            paths["baseline"] = lambda kernel=kernel: kernel(False, dll=base)
        times: dict[str, list[float]] = {k: [] for k in paths}
        for r in range(a.repeats):
            for k in list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]:
                evict.add_(1.0)
                t0 = time.perf_counter()
                paths[k]()
                times[k].append(time.perf_counter() - t0)
        bs = kv.block_size  # a window reads the blocks holding its keys
        read = a.context if not a.window or a.window >= a.context else min(
            a.context, (a.context - 1) // bs * bs + bs - (a.context - a.window) // bs * bs)
        kv_bytes = a.batch * read * kv.bytes_per_token
        row = {"kv_cache_dtype": name, "kv_bytes_per_token": kv.bytes_per_token,
               "kv_bytes_per_step": kv_bytes, "simd": cpu_kernel.simd_level(),
               "evicted_bytes_before_each_call": evict.numel() * 4,
               "baseline_source": a.baseline_source}
        for k, ts in times.items():
            t = statistics.median(ts)
            row[k] = {"ms_per_step": t * 1e3, "gb_per_s": kv_bytes / t / 1e9}
        rows.append(row)
        log(f"{name:>9}: " + ", ".join(f"{k} {row[k]['ms_per_step']:.3f} ms "
                                      f"({row[k]['gb_per_s']:.1f} GB/s)" for k in paths))
    result = {"bench": "attention_kernel", "args": vars(a), "results": rows, "env": env_info()}
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
