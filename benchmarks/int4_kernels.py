"""INT4 weight-only GEMV/GEMM on CPU: dense bf16 / fp32 vs Int4Linear's paths.

    .venv/bin/python benchmarks/int4_kernels.py [--threads 1] [--repeats 7] [--ms 1 32 64]

Columns (median ms per call, activations bf16 [M, K], weight [N, K], group 128 symmetric):
  dense-bf16   F.linear with a bf16 weight
  dense-fp32   F.linear with an fp32 weight (x cast to fp32 and back; the cast is included)
  int4-op      Int4Linear forced onto aten._weight_int4pack_mm_for_cpu
  int4-deq     Int4Linear forced onto chunked dequantize -> fp32 GEMM
  int4-auto    Int4Linear with the default M threshold (what the engine gets)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.layers.int4.layouts import int4pack_layout
from kvserve.layers.int4.linear import Int4Linear
from kvserve.layers.int4.methods import DEQUANT_MIN_M
from kvserve.quant import int4


def bench(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _row(x: torch.Tensor, w: torch.Tensor, w_bf16: torch.Tensor,
         lins: tuple[Int4Linear, Int4Linear, Int4Linear], r: int) -> dict[str, float]:
    lin_op, lin_deq, lin_auto = lins
    return {
        "dense-bf16": bench(lambda: F.linear(x, w_bf16), r),
        "dense-fp32": bench(lambda: F.linear(x.float(), w).bfloat16(), r),
        "int4-op": bench(lambda: lin_op(x), r),
        "int4-deq": bench(lambda: lin_deq(x), r),
        "int4-auto": bench(lambda: lin_auto(x), r),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {args.threads}, int4pack layout {int4pack_layout()}, "
          f"DEQUANT_MIN_M {DEQUANT_MIN_M}")
    cols = ["dense-bf16", "dense-fp32", "int4-op", "int4-deq", "int4-auto"]
    print(f"{'K=N':>6} {'M':>5} " + " ".join(f"{c:>11}" for c in cols) + "   (ms, median)")
    for size in args.sizes:
        w = torch.randn(size, size) * 0.02
        w_bf16 = w.bfloat16()
        q = int4.quantize_rtn(w_bf16, args.group_size, True)
        lin_op = Int4Linear(q, dequant_min_m=1 << 30)
        lin_deq = Int4Linear(q, dequant_min_m=1)
        lin_auto = Int4Linear(q)
        for m in args.ms:
            x = torch.randn(m, size).bfloat16()
            r = args.repeats if size * m < 4096 * 64 else max(3, args.repeats // 2)
            t = _row(x, w, w_bf16, (lin_op, lin_deq, lin_auto), r)
            print(f"{size:>6} {m:>5} " + " ".join(f"{t[c]:>11.2f}" for c in cols), flush=True)
        print(f"{'':>6} bytes: bf16 {w_bf16.numel() * 2 / 2**20:.1f} MiB, "
              f"int4 {lin_auto.weight_bytes() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
