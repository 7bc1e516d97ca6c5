"""llama.cpp's quantized KV cache (q8_0, q4_0) against its own F16 KV, measured the way
``kvserve bench quality`` measures kvserve's modes, for the peer rows of docs/benchmarks.md.

Run with a python that has llama-cpp-python (no kvserve import: numpy only)::

    PEER/bin/python benchmarks/llamacpp_kv_quality.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text kvserve/demo_model/heldout.txt --kv q8_0,q4_0 --threads 1 \\
        --json docs/bench/llamacpp_kv_quality.json

Same protocol as kvserve's bench (kvserve/bench/quality.py): the text's first
``--ppl-max-tokens`` tokens (llama.cpp's tokenizer of the same GGUF, no BOS) as windows of 256
for perplexity; ``--num-prompts`` prompts of 32 tokens evenly spaced over the stream, greedy
``--gen-len`` tokens with the baseline (F16 KV), then KL(baseline || candidate) and top-1
agreement teacher-forced on prompt + the baseline's continuation (the ``gen_len`` predicting
positions). Quantized V in llama.cpp needs flash attention: every config, baseline included,
runs with ``flash_attn=True``. Note the weights are the GGUF's (Q4_1), not the bf16 folder
kvserve's rows use: each engine is compared with its own 16-bit KV.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import llama_cpp as L
import numpy as np

KV_TYPES = {"f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0, "q4_0": L.GGML_TYPE_Q4_0}


def make(model: str, kv: str, threads: int, n_ctx: int) -> L.Llama:
    t = KV_TYPES[kv]
    return L.Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                   n_threads_batch=threads, logits_all=True, flash_attn=True, type_k=t,
                   type_v=t, verbose=False, seed=0)


def logits_of(llm: L.Llama, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] fp32 logits, a fresh context each call."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def greedy(llm: L.Llama, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    llm._ctx.kv_cache_clear()
    out: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(int(tok))
        if len(out) == n:
            break
    return out


def prompt_windows(ids: list[int], n: int, length: int) -> list[list[int]]:
    span = max(1, len(ids) - length)
    starts = [round(i * span / max(1, n - 1)) if n > 1 else 0 for i in range(n)]
    return [ids[s:s + length] for s in starts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--kv", default="q8_0,q4_0")
    ap.add_argument("--ppl-max-tokens", type=int, default=8960)
    ap.add_argument("--ppl-window", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    t0 = time.time()
    n_ctx = max(a.ppl_window, a.prompt_len + a.gen_len)
    base = make(a.model, "f16", a.threads, n_ctx)
    with open(a.text, encoding="utf-8", errors="replace") as f:
        text = f.read()
    need = max(a.ppl_max_tokens, a.num_prompts * (a.prompt_len + a.gen_len)) * 8
    ids = base.tokenize(text[:need].encode(), add_bos=False, special=False)
    windows = [ids[i:i + a.ppl_window] for i in range(0, min(len(ids), a.ppl_max_tokens),
                                                       a.ppl_window)]
    windows = [w for w in windows if len(w) >= 2]
    prompts = prompt_windows(ids, a.num_prompts, a.prompt_len)

    def nll(llm: L.Llama) -> tuple[float, int]:
        tot, n = 0.0, 0
        for w in windows:
            lp = log_softmax(logits_of(llm, w)[:-1])
            tot -= float(lp[np.arange(len(w) - 1), w[1:]].sum())
            n += len(w) - 1
        return tot, n

    base_nll, n_tok = nll(base)
    conts = [greedy(base, p, a.gen_len) for p in prompts]
    seqs = [p + c for p, c in zip(prompts, conts, strict=True)]
    base_lp = [log_softmax(logits_of(base, s)[a.prompt_len - 1:-1]) for s in seqs]
    del base
    results = {"bench": "llamacpp_kv_quality", "model": a.model.rsplit("/", 1)[-1],
               "llama_cpp_python": L.__version__, "baseline_kv": "f16",
               "text": a.text, "windows": len(windows), "tokens_scored": n_tok,
               "baseline_perplexity": math.exp(base_nll / n_tok), "candidates": {}}
    for kv in a.kv.split(","):
        llm = make(a.model, kv, a.threads, n_ctx)
        c_nll, _ = nll(llm)
        kls, hits, n = [], 0, 0
        for s, lpb in zip(seqs, base_lp, strict=True):
            lpc = log_softmax(logits_of(llm, s)[a.prompt_len - 1:-1])
            kls.extend((np.exp(lpb) * (lpb - lpc)).sum(-1).tolist())
            hits += int((lpb.argmax(-1) == lpc.argmax(-1)).sum())
            n += lpb.shape[0]
        ident = sum(greedy(llm, p, a.gen_len) == c for p, c in zip(prompts, conts, strict=True))
        kl = np.array(kls)
        results["candidates"][kv] = {
            "perplexity": math.exp(c_nll / n_tok),
            "perplexity_ratio": math.exp((c_nll - base_nll) / n_tok),
            "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "teacher_forced_top1_agreement": hits / n, "kl_positions": n,
            "identical_continuations": ident,
        }
        print(kv, json.dumps(results["candidates"][kv]), flush=True)
        del llm
    results["seconds"] = time.time() - t0
    results["env"] = env_info(a.threads)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def env_info(threads: int) -> dict:
    """The machine, in the shape of kvserve.bench.common.env_info (no torch here)."""
    name, flags = platform.processor() or None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = val.strip()
                elif key.strip() == "flags":
                    flags = set(val.split())
                    break
    except OSError:
        pass
    return {"python": platform.python_version(), "numpy": np.__version__,
            "threads": threads, "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "cpu": {"model": name, "isa": [f for f in _ISA_FLAGS if f in flags]},
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


if __name__ == "__main__":
    main()
