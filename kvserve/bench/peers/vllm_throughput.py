"""vLLM closed-loop throughput sweep: per KV dtype and concurrency, the payload's requests
(``kvserve bench throughput --peer vllm``)."""

# ruff: noqa: E402, E702, E741, F841 - a standalone script (its payload is read before the heavy
# imports) in the compact style of a peer harness

import gc
import json
import os
import sys
import time

cfg = json.load(sys.stdin)
# Before torch / vllm load: the engine core in this process (vLLM's spawned core cannot start
# from a stdin script, and extra busy processes distort a small CPU), kvserve's thread count.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["OMP_NUM_THREADS"] = str(cfg["threads"])
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
import torch
from vllm import LLM, SamplingParams


def prompts(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()

results = []
for kv in cfg["kv_cache_dtypes"]:
    kw = dict(model=cfg["model"], dtype=cfg["dtype"], kv_cache_dtype=kv,
              max_num_seqs=max(cfg["concurrency"]), seed=0, enable_prefix_caching=False,
              enforce_eager=True, disable_log_stats=True,
              max_model_len=cfg["input_len"] + cfg["output_len"])
    try:
        try:
            llm = LLM(**kw, kv_cache_memory_bytes=cfg["kv_cache_memory_bytes"])
            budget = "kv_cache_memory_bytes"
        except TypeError:
            llm = LLM(**kw)
            budget = "vllm default (no kv_cache_memory_bytes in this vLLM)"
    except Exception as e:
        results.append({"kv_cache_dtype": kv, "error": repr(e)})
        continue
    eng = llm.llm_engine
    try:
        cc = eng.vllm_config.cache_config
        capacity = int(cc.num_gpu_blocks) * int(cc.block_size)
    except Exception:
        capacity = None
    vocab = llm.get_tokenizer().vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
    levels, seq = [], 0
    for li, c in enumerate(cfg["concurrency"]):
        target = cfg["requests_per_level"][str(c)]
        ps = prompts(target + c, cfg["input_len"], vocab, cfg["seed"] + 1000 * li)
        issued = done = 0
        inflight = set()
        t0 = time.perf_counter()
        for _ in range(c):
            eng.add_request(str(seq), {"prompt_token_ids": ps[issued]}, sp)
            inflight.add(str(seq)); seq += 1; issued += 1
        counts = {}
        while done < target:
            for out in eng.step():
                counts[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    done += 1
                    inflight.discard(out.request_id)
                    if done < target:
                        eng.add_request(str(seq), {"prompt_token_ids": ps[issued]}, sp)
                        inflight.add(str(seq)); seq += 1; issued += 1
        dt = time.perf_counter() - t0
        ntok = sum(counts.values())
        eng.abort_request(list(inflight))
        levels.append({"concurrency": c, "output_tokens_per_s": ntok / dt})
    results.append({"kv_cache_dtype": kv, "budget": budget, "capacity_tokens": capacity,
                    "levels": levels,
                    "peak_output_tokens_per_s": max(l["output_tokens_per_s"] for l in levels)})
    del llm, eng
    gc.collect()
import vllm

print(json.dumps({"peer": "vllm", "version": vllm.__version__, "configs": results}))
