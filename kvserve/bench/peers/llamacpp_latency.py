"""llama.cpp (llama-cpp-python) decode latency on a GGUF: the payload's prompts per batch size,
only all-decode steps timed (``kvserve bench latency --peer llamacpp``)."""

# ruff: noqa: E402, E702, E741, F841 - a standalone script (its payload is read before the heavy
# imports) in the compact style of a peer harness

import json
import os
import statistics
import sys
import time

cfg = json.load(sys.stdin)
import llama_cpp as L
import numpy as np

L.llama_backend_init()
threads = int(cfg.get("threads") or os.cpu_count() or 1)
mp = L.llama_model_default_params()
model = L.llama_model_load_from_file(cfg["gguf"].encode(), mp)
if not model:
    raise SystemExit(f"llama.cpp could not load {cfg['gguf']}")
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
inp, out_len = cfg["input_len"], cfg["output_len"]


def new_context(b, n_tokens):
    cp = L.llama_context_default_params()
    cp.n_ctx = b * (inp + out_len)
    cp.n_batch = max(n_tokens, b)
    cp.n_ubatch = min(512, cp.n_batch)
    cp.n_seq_max = b
    cp.n_threads = threads
    cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit(f"llama.cpp could not make a context for batch {b}")
    return ctx


def fill(batch, entries):
    """entries: (token, pos, seq, want_logits)."""
    for i, (tok, pos, seq, want) in enumerate(entries):
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if want else 0
    batch.n_tokens = len(entries)


def argmax_rows(ctx, rows):
    return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
            for i in rows]


def run_round(ctx, batch, prompts, n_out):
    b = len(prompts)
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    entries, last = [], []
    for s, p in enumerate(prompts):
        entries += [(t, j, s, j == len(p) - 1) for j, t in enumerate(p)]
        last.append(len(entries) - 1)
    fill(batch, entries)
    t0 = time.perf_counter()
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        raise SystemExit(f"llama_decode (prefill, batch {b}) returned {rc}")
    toks = argmax_rows(ctx, last)
    prefill = time.perf_counter() - t0
    gen = [[t] for t in toks]
    steps = []
    for k in range(n_out - 1):
        t0 = time.perf_counter()
        fill(batch, [(toks[s], len(prompts[s]) + k, s, True) for s in range(b)])
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode (decode, batch {b}) returned {rc}")
        toks = argmax_rows(ctx, range(b))
        steps.append(time.perf_counter() - t0)
        for s in range(b):
            gen[s].append(toks[s])
    return steps, prefill, gen


res = []
for b in cfg["batch_sizes"]:
    rounds_prompts = cfg["prompts"][str(b)]
    n_tokens = max(len(p) for rp in rounds_prompts for p in rp) * b
    ctx = new_context(b, n_tokens)
    batch = L.llama_batch_init(max(n_tokens, b), 0, 1)
    try:
        w = [p[: min(len(p), 16)] for p in rounds_prompts[0]]
        run_round(ctx, batch, w, 3)  # warmup: graph allocation, page faults
        tps, step_ms, prefill, tokens = [], [], [], None
        for prompts in rounds_prompts:
            steps, pf, gen = run_round(ctx, batch, prompts, out_len)
            tps.append(b * len(steps) / sum(steps))
            step_ms.append(1e3 * statistics.median(steps))
            prefill.append(pf)
            tokens = tokens or gen
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    res.append({"batch_size": b, "decode_tokens_per_s": statistics.median(tps),
                "decode_tokens_per_s_rounds": tps,
                "decode_step_ms_median": statistics.median(step_ms),
                "prefill_s_median": statistics.median(prefill),
                "decode_steps_per_round": out_len - 1, "tokens": tokens})
weights_bytes = L.llama_model_size(model)
L.llama_model_free(model)
import resource

print(json.dumps({"peer": "llamacpp", "version": L.__version__, "threads": threads,
                  "weights": os.path.basename(cfg["gguf"]),
                  "memory": {"weights_mib": weights_bytes / 2**20,
                             "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF)
                             .ru_maxrss / 1024},
                  "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
                  "results": res}))
