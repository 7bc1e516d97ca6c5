"""vLLM decode latency on an HF folder: the payload's prompts per batch size, only all-decode
steps timed (``kvserve bench latency --peer vllm``)."""

# ruff: noqa: E402, E702, E741, F841 - a standalone script (its payload is read before the heavy
# imports) in the compact style of a peer harness

import json
import os
import statistics
import sys
import time

cfg = json.load(sys.stdin)
threads = int(cfg.get("threads") or os.cpu_count() or 1)
# Before torch / vllm load: the engine core in this process (no extra busy processes on a
# small CPU), the same thread count as kvserve, a small KV space, no per-step stats.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["OMP_NUM_THREADS"] = str(threads)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.get("kv_cache_gb") or 1))
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
import torch
import vllm
from vllm import LLM, SamplingParams

max_b = max(cfg["batch_sizes"])
inp, out_len = cfg["input_len"], cfg["output_len"]
max_len = inp + out_len
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_num_seqs=max_b, seed=0,
          max_model_len=max_len, max_num_batched_tokens=max(max_b * inp, max_len, 2048),
          enable_prefix_caching=False, enforce_eager=True, skip_tokenizer_init=True,
          disable_log_stats=True)
eng = llm.llm_engine
n = 0


def run_round(prompts, n_out):
    global n
    b = len(prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, detokenize=False)
    ids = []
    for p in prompts:
        ids.append(str(n)); eng.add_request(ids[-1], {"prompt_token_ids": p}, sp); n += 1
    counts = dict.fromkeys(ids, 0)
    toks = {}
    steps, t_start, first_all = [], time.perf_counter(), None
    while eng.has_unfinished_requests():
        before = dict(counts)
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        for o in outs:
            counts[o.request_id] = len(o.outputs[0].token_ids)
            toks[o.request_id] = list(o.outputs[0].token_ids)
        if min(before.values()) >= 1 and all(counts[i] == before[i] + 1 for i in ids):
            steps.append(dt)  # every sequence decoded exactly one token
        if first_all is None and min(counts.values()) >= 1:
            first_all = time.perf_counter()
    return steps, (first_all or t_start) - t_start, [toks[i] for i in ids]


res = []
for b in cfg["batch_sizes"]:
    rounds_prompts = cfg["prompts"][str(b)]
    run_round([p[:16] for p in rounds_prompts[0]], 3)  # warmup
    tps, step_ms, prefill, tokens, nsteps = [], [], [], None, 0
    for prompts in rounds_prompts:
        steps, pf, gen = run_round(prompts, out_len)
        if steps:
            tps.append(b * len(steps) / sum(steps))
            step_ms.append(1e3 * statistics.median(steps))
        prefill.append(pf)
        nsteps = len(steps)
        tokens = tokens or gen
    res.append({"batch_size": b,
                "decode_tokens_per_s": statistics.median(tps) if tps else None,
                "decode_tokens_per_s_rounds": tps,
                "decode_step_ms_median": statistics.median(step_ms) if step_ms else None,
                "prefill_s_median": statistics.median(prefill),
                "decode_steps_per_round": nsteps, "tokens": tokens})
print(json.dumps({"peer": "vllm", "version": vllm.__version__, "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "dtype": cfg["dtype"],
                  "kv_cache_gb": os.environ["VLLM_CPU_KVCACHE_SPACE"], "results": res}))
