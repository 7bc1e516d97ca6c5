"""gpu_check step (5): tensor parallelism on CUDA with NCCL (needs >= 2 GPUs).

A tiny fp32 Llama (GQA 4/2 heads) runs with tensor_parallel_size=1 and =2 on CUDA; prompt
logits must agree within 1e-3 and greedy tokens for 32 steps must be equal. Writes
``$OUT/tp.json``; on a machine with fewer than 2 GPUs it records "skipped" and exits 0.

    python scripts/gpu_check_tp.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main(out: str) -> int:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    result: dict = {"gpus": n}
    if n < 2:
        result["status"] = "skipped (needs 2 GPUs)"
        print("[gpu_check_tp]", result["status"])
        _write(out, result)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from kvserve import LLM, SamplingParams
    from tests.conftest import make_tiny_model

    path = make_tiny_model(tempfile.mkdtemp(prefix="kvserve-tp-"), "llama")
    prompt = list(range(3, 60))
    outs = {}
    for tp in (1, 2):
        t0 = time.perf_counter()
        llm = LLM(path, dtype="float32", kv_cache_dtype="fp32", num_blocks=64, device="cuda",
                  progress=False, tensor_parallel_size=tp, distributed_timeout_s=120,
                  enforce_eager=True)
        logits = llm.engine.prompt_logits(prompt)
        toks = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=32, ignore_eos=True))[0].outputs[0].token_ids
        outs[tp] = (logits, toks, time.perf_counter() - t0)
        llm.engine.shutdown()
    diff = float((outs[1][0] - outs[2][0]).abs().max())
    same = outs[1][1] == outs[2][1]
    result.update(status="ok" if diff <= 1e-3 and same else "FAILED", max_logit_diff=diff,
                  greedy_equal=same, seconds={str(k): round(v[2], 1) for k, v in outs.items()})
    print("[gpu_check_tp]", result)
    _write(out, result)
    return 0 if result["status"] == "ok" else 1


def _write(out: str, result: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tp.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out/gpu_check"))
