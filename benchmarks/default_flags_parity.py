"""kvserve with default flags against transformers' fp32 model run by full forwards, and INT8 KV
against BF16 KV: one run, JSON.

    .venv/bin/python benchmarks/default_flags_parity.py [--model PATH] [--tokens 32]
        [--kv-cache-dtype int8] [--threads 2] [--json OUT]

What it shows: that what a user gets without flags (``dtype=auto``: fp32 activations, weights
kept compressed, C kernels, decode graphs; ``--gguf-activations int8x2`` on a GGUF) computes the
model, not an approximation of it that changes its choices.

1. kvserve, default flags, BF16 KV and the candidate KV (default ``int8``): 32 greedy tokens
   (EOS ignored) for each of 8 chat prompts.
2. The reference: transformers' fp32 model of the same weights (a GGUF dequantized by
   transformers' own reader; a bf16 folder upcast to fp32) decodes greedily by **full
   forwards**: every token is the argmax of the last row of a forward over the whole sequence
   so far, without a KV cache (``generate()`` with its cache differs from its own full forward
   at near-ties, so it is not the reference).
3. Per prompt and KV dtype: the tokens equal or not, and where they first differ, the
   reference's top-2 logit gap there (a near-tie if small).
4. KL(BF16 KV || candidate KV) per position, teacher-forced through kvserve's paged cache on
   the BF16 run's continuations (prompt logits of prompt + continuation), mean over every
   continuation position, and the top-1 agreement there.

The JSON records ``env.cpu`` (the CPU kind decides which kernels ran, not what they compute).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvserve.bench.common import env_info, model_label, resolve_model_path
from kvserve.bench.quality import kl_rows

CHAT = ["What is the capital of France?", "What is a list?", "Name three colors.",
        "How many legs does a spider have?", "Write a haiku about the sea.",
        "What is 2 + 2?", "Who wrote Romeo and Juliet?", "Say hello in Spanish."]


def reference_model(path: str):
    """transformers' fp32 model of ``path`` (a .gguf file, dequantized by transformers, or an
    HF folder)."""
    import os

    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def full_forward_greedy(hf, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens by full forwards (no cache); with each, the top-2 logit gap."""
    seq, gaps = list(ids), []
    for _ in range(n):
        logits = hf(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        seq.append(int(logits.argmax()))
    return seq[len(ids):], gaps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the default "
                    "model, SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--kv-cache-dtype", default="int8", help="candidate KV dtype vs bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results here (default: stdout)")
    args = ap.parse_args(argv)
    if args.tokens < 1:
        raise SystemExit("--tokens must be >= 1")
    torch.set_num_threads(args.threads)

    from kvserve import LLM, SamplingParams

    path = resolve_model_path(args.model)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    runs, prompts, logits_of = {}, None, {}
    for kv in ("bf16", args.kv_cache_dtype):
        llm = LLM(model=args.model, kv_cache_dtype=kv, progress=False)  # default flags else
        if prompts is None:
            prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        runs[kv] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                    "kv_mode": llm.engine.kv_mode,
                    "graph_steps": getattr(llm.engine.runner.graphs, "runs", None)}
        logits_of[kv] = llm
    base, cand = logits_of["bf16"], logits_of[args.kv_cache_dtype]
    kls, hits, n = [], 0, 0
    for p, toks in zip(prompts, runs["bf16"]["tokens"], strict=True):
        seq = p + toks
        a = base.engine.prompt_logits(seq)[len(p) - 1:len(seq) - 1]
        b = cand.engine.prompt_logits(seq)[len(p) - 1:len(seq) - 1]
        kls.extend(kl_rows(a, b).tolist())
        hits += int((b.argmax(-1) == torch.tensor(toks)).sum())
        n += len(toks)

    t0 = time.perf_counter()
    hf = reference_model(path)
    ref = [full_forward_greedy(hf, p, args.tokens) for p in prompts]
    ref_s = time.perf_counter() - t0
    per_prompt = []
    for i, (p, (toks, gaps)) in enumerate(zip(prompts, ref, strict=True)):
        row = {"prompt": CHAT[i], "prompt_tokens": len(p), "reference": toks}
        for kv, r in runs.items():
            ours = r["tokens"][i]
            diffs = [j for j, (x, y) in enumerate(zip(ours, toks, strict=True)) if x != y]
            first = diffs[0] if diffs else None
            row[kv] = {"equal": ours == toks, "first_difference": first,
                       "reference_top2_gap_there": None if first is None else gaps[first]}
            if first is not None:
                row[kv]["tokens"] = ours
        per_prompt.append(row)
    summary = {kv: sum(r[kv]["equal"] for r in per_prompt) for kv in runs}
    result = {
        "bench": "default_flags_parity", "model": model_label(path), "tokens": args.tokens,
        "prompts": len(prompts), "kv_modes": {kv: r["kv_mode"] for kv, r in runs.items()},
        "decode_graph_steps": {kv: r["graph_steps"] for kv, r in runs.items()},
        "greedy_equal_to_reference": {kv: f"{v} of {len(prompts)}" for kv, v in summary.items()},
        "kl_bf16_vs_candidate": {"mean": sum(kls) / len(kls), "max": max(kls),
                                 "top1_agreement": hits / n, "positions": n},
        "reference": "transformers fp32, greedy by full forwards (no KV cache)",
        "reference_seconds": ref_s, "per_prompt": per_prompt, "env": env_info(),
        "command": " ".join(sys.argv),
    }
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    kl = result["kl_bf16_vs_candidate"]
    print("greedy equal to transformers fp32 (full forwards): "
          f"{result['greedy_equal_to_reference']}; KL(bf16 || {args.kv_cache_dtype}) mean "
          f"{kl['mean']:.2e}, top-1 {kl['top1_agreement']:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
