"""Tensor parallel (tp=2, one thread per rank) vs one process (one thread): decode tok/s and
per-rank weight memory through ``LLM``, JSON out.

    PYTHONPATH=. python benchmarks/tp_decode.py --model demo --json docs/bench/tp_decode.json

Per (tp, batch): B prompts of 8 tokens are prefilled, one decode step warms up, then
``--repeats`` windows of ``--steps`` decode steps are timed through ``LLMEngine.step``;
tok/s = B x steps / seconds, median window reported; also each step's min and p10 ms
(robust on a busy host: compare two trees with ``--tps 2`` and PYTHONPATH at each). The
engines are built one after the other (tp=2 spawns its worker), each with
``torch.set_num_threads(1)`` per rank. The host load average is recorded: on a shared machine,
compare runs only at similar load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _bench(model: str, tp: int, batches: list[int], steps: int, repeats: int) -> dict:
    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.model.loader import weight_bytes

    torch.set_num_threads(1)
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory="256MiB", progress=False,
              max_num_seqs=max(batches))
    eng = llm.engine
    held, _ = weight_bytes(eng.model)
    out: dict = {"tp": tp, "rank0_weight_bytes": held, "batches": {}}
    try:
        for b in batches:
            sp = SamplingParams(max_tokens=steps * repeats + 2, ignore_eos=True)
            for i in range(b):
                eng.add_request(f"{b}-{i}", {"prompt_token_ids": [5 + (i + j) % 200
                                                                   for j in range(8)]}, sp)
            eng.step()  # prefill
            eng.step()  # warm-up decode
            windows, step_ms = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(steps):
                    t1 = time.perf_counter()
                    eng.step()
                    step_ms.append((time.perf_counter() - t1) * 1e3)
                windows.append(b * steps / (time.perf_counter() - t0))
            eng.abort_request([f"{b}-{i}" for i in range(b)])
            step_ms.sort()  # the fastest steps are the least disturbed by a busy host
            out["batches"][str(b)] = {"tok_s_median": statistics.median(windows),
                                      "windows": windows, "step_ms_min": step_ms[0],
                                      "step_ms_p10": step_ms[len(step_ms) // 10]}
            print(f"tp={tp} batch={b}: {statistics.median(windows):.1f} tok/s, step min "
                  f"{step_ms[0]:.2f} ms, p10 {step_ms[len(step_ms) // 10]:.2f} ms", flush=True)
    finally:
        eng.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tps", default="1,2", help="tensor-parallel sizes to run, in order")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    load0 = os.getloadavg()
    tps = [int(x) for x in a.tps.split(",")]
    runs = [_bench(a.model, tp, batches, a.steps, a.repeats) for tp in tps]
    from kvserve.bench.common import env_info

    res = {"model": a.model, "cpus": os.cpu_count(), "threads_per_rank": 1,
           "loadavg_before": load0, "loadavg_after": os.getloadavg(), "runs": runs,
           "env": env_info()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps({r["tp"]: {b: round(v["tok_s_median"], 1) for b, v in r["batches"].items()}
                      for r in runs}))


if __name__ == "__main__":
    main()
