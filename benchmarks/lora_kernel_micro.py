"""The grouped LoRA GEMM alone at a decode step's shapes: one step's kernel calls (4 per layer:
q/k/v, o, gate/up, down) recorded as a CPU graph tape and replayed, min and median of
``--repeats`` (a few seconds; the host may be shared: min-of-N is the figure to compare).

    python benchmarks/lora_kernel_micro.py [--rows 16] [--adapters 4] [--rank 16]
        [--layers 30] [--threads 1 2] [--lora-dtype float32 bfloat16] [--repeats 50]
        [--json OUT]

Shapes default to SmolLM2-135M's (hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64),
every projection targeted, ``--rows`` rows spread over ``--adapters`` slots (row i on slot
i mod N), each layer with its own adapter buffers (as a model has: a step streams all of them).
``cold`` replays evict the caches first (a 64 MiB sweep, not timed), like a real step where
the base weights ran in between; ``warm`` replays follow each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvserve.bench.common import env_info, log
from kvserve.kernels.cpu import graph
from kvserve.kernels.cpu import lora_gemm as cl


def _linears(hidden: int, inter: int, q: int, kv: int) -> list[tuple[int, tuple[int, ...]]]:
    """(K, shard widths) of one layer's wrapped linears."""
    return [(hidden, (q, kv, kv)), (q, (hidden,)), (hidden, (inter, inter)), (inter, (hidden,))]


def record(a, threads: int, dtype: torch.dtype) -> tuple[graph.Tape, int]:
    """A tape of one step's LoRA calls; returns it and the adapter bytes one step reads."""
    torch.set_num_threads(threads)
    lib = cl.load()
    assert lib is not None, "no C compiler"
    g = torch.Generator().manual_seed(0)
    idx = torch.arange(a.rows, dtype=torch.int64) % a.adapters
    nbytes = 0
    bufs = []
    for _ in range(a.layers):
        for k, shards in _linears(a.hidden, a.intermediate, a.q, a.kv):
            h, n = len(shards), sum(shards)
            r = h * a.rank
            wa = (torch.randn(a.adapters, r, k, generator=g) * 0.02).to(dtype)
            wb = (torch.randn(a.adapters, r, n, generator=g) * 0.02).to(dtype)
            noff = torch.tensor([0, *torch.tensor(shards).cumsum(0).tolist()],
                                dtype=torch.int64)
            x = torch.randn(a.rows, k, generator=g)
            y = torch.zeros(a.rows, n)
            scale = torch.full((a.adapters,), 2.0)
            bufs.append((y, x, wa, wb, idx, scale, noff))
            nbytes += wa.nbytes + a.adapters * a.rank * n * wa.element_size()  # B: shards' blocks
    with graph.recording() as tape:
        for y, x, wa, wb, i, scale, noff in bufs:
            cl.lora_gemm_(lib, y, x, wa, wb, i, scale, noff)
    return tape, nbytes


def _time(tape: graph.Tape, rows: int, repeats: int, cold: bool, clock) -> list[float]:
    sweep = torch.empty(16 << 20) if cold else None
    out = []
    tape.replay(rows)
    for _ in range(repeats):
        if sweep is not None:
            sweep.add_(1.0)
        t0 = clock()
        tape.replay(rows)
        out.append((clock() - t0) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--q", type=int, default=576, help="q_proj width (heads * head_dim)")
    p.add_argument("--kv", type=int, default=192, help="k_proj / v_proj width")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--lora-dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the process's CPU time (a busy host's waits left out; with "
                   "--threads 1 only, as it sums the threads)")
    p.add_argument("--json", default=None, help="JSON results file")
    a = p.parse_args(argv)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    results = []
    for dt in a.lora_dtype:
        for th in a.threads:
            tape, nbytes = record(a, th, getattr(torch, dt))
            for cold in (False, True):
                ms = _time(tape, a.rows, a.repeats, cold, clock)
                row = {"lora_dtype": dt, "threads": th, "cache": "cold" if cold else "warm",
                       "calls": len(tape), "min_ms": min(ms), "median_ms": statistics.median(ms),
                       "adapter_mb_read": nbytes / 1e6}
                results.append(row)
                log(f"{dt:9s} threads={th} {row['cache']:4s}: min {row['min_ms']:.2f} ms, "
                    f"median {row['median_ms']:.2f} ms ({len(tape)} calls, "
                    f"{nbytes / 1e6:.1f} MB of adapters)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "lora_kernel_micro", "env": env_info(), "config": vars(a),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
