"""kvserve on a GGUF file against transformers' fp32 model of the same file: greedy tokens.

    .venv/bin/python benchmarks/gguf_parity.py --model FILE.gguf [--tokens 32] [--prompts 8]
        [--gguf-activations int8x2] [--threads 2] [--json OUT]

1. kvserve loads the file with default flags (weights kept packed where ``GGML_TYPES`` has a
   kernel, ``--gguf-activations`` int8x2 by default, fp32 KV for a clean comparison) and
   decodes ``--tokens`` greedy tokens (EOS ignored) for each prompt: chat prompts through the
   file's chat template when it has one, plain completion prompts when not (a base model).
2. The reference: transformers' fp32 model of the same file, every tensor dequantized exactly
   (transformers' own GGUF reader; the types it lacks, Q5_0 / Q5_1, registered with
   ``gguf.quants.dequantize`` by ``kvserve.model.gguf.register_with_transformers``), greedy by
   **full forwards** (no KV cache: each token the argmax of a forward over the whole sequence).
3. Per prompt: equal, or the first difference and the reference's top-2 logit gap there. A
   divergence where that gap is below ``--near-tie`` (0.01) counts as equal (the two argmaxes
   are within rounding of each other; after it the sequences are different texts).

JSON (default ``docs/bench/gguf_parity_<file stem>.json``) with ``env.cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

CHAT = ["What is the capital of France?", "What is a list?", "Name three colors.",
        "How many legs does a spider have?", "Write a haiku about the sea.",
        "What is 2 + 2?", "Who wrote Romeo and Juliet?", "Say hello in Spanish."]
TEXT = ["The capital of France is", "A list in Python is", "The three primary colors are",
        "A spider has eight legs, and", "The sea at night", "Two plus two equals",
        "Romeo and Juliet was written by", "In Spanish, hello is"]


def reference_model(path: str):
    """transformers' fp32 model of a .gguf, every tensor dequantized (gguf's dequantizer for
    the types transformers lacks)."""
    from transformers import AutoModelForCausalLM

    from kvserve.model.gguf import register_with_transformers

    register_with_transformers()
    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()


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


def compare(ours: list[int], ref: list[int], gaps: list[float], near_tie: float) -> dict:
    """One prompt's verdict: equal, equal up to a near-tie divergence, or different."""
    diffs = [j for j, (x, y) in enumerate(zip(ours, ref, strict=True)) if x != y]
    if not diffs:
        return {"equal": True, "verdict": "equal"}
    first = diffs[0]
    tie = gaps[first] < near_tie
    return {"equal": tie, "verdict": "near-tie" if tie else "different",
            "first_difference": first, "reference_top2_gap_there": gaps[first],
            "tokens": ours}


def run(path: str, tokens: int = 32, n_prompts: int = 8, activations: str = "int8x2",
        near_tie: float = 0.01, reference=None) -> dict:
    """The comparison as a dict (``reference``: an already loaded transformers model)."""
    from kvserve import LLM, SamplingParams
    from kvserve.model.loader import weight_bytes

    llm = LLM(model=path, kv_cache_dtype="fp32", gguf_activations=activations,
              progress=False)
    tok = llm.get_tokenizer()
    chat = bool(getattr(tok, "chat_template", None))
    texts = (CHAT if chat else TEXT)[:n_prompts]
    prompts = ([llm.apply_chat_template([{"role": "user", "content": c}]) for c in texts]
               if chat else [tok.encode(t) for t in texts])
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    ours_s = time.perf_counter() - t0
    model = llm.engine.model
    packed = sorted({type(m).__name__ for m in model.modules()
                     if type(m).__name__ in ("GGUFLinear", "KqLinear", "Q8Linear", "Int4Linear",
                                             "Q8Embedding")})
    held, _ = weight_bytes(model)
    graphs = getattr(llm.engine.runner.graphs, "runs", None)
    del llm
    t0 = time.perf_counter()
    hf = reference if reference is not None else reference_model(path)
    ref = [full_forward_greedy(hf, p, tokens) for p in prompts]
    ref_s = time.perf_counter() - t0
    per_prompt = []
    for text, p, ours, (want, gaps) in zip(texts, prompts, outs, ref, strict=True):
        per_prompt.append({"prompt": text, "prompt_tokens": len(p), "reference": want,
                           **compare(ours, want, gaps, near_tie)})
    equal = sum(r["equal"] for r in per_prompt)
    from kvserve.model.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(path)
    types: dict[str, int] = {}
    for t in ckpt.tensors.values():
        types[t.type] = types.get(t.type, 0) + 1
    return {
        "bench": "gguf_parity", "model": os.path.basename(path), "tokens": tokens,
        "prompts": len(prompts), "prompt_kind": "chat template" if chat else "completion",
        "gguf_activations": activations, "near_tie_gap": near_tie,
        "greedy_equal": f"{equal} of {len(prompts)}",
        "exact": sum(r["verdict"] == "equal" for r in per_prompt),
        "near_ties": sum(r["verdict"] == "near-tie" for r in per_prompt),
        "file_types": types, "kvserve_packed_modules": packed,
        "resident_weight_bytes": held, "file_tensor_bytes": ckpt.tensor_bytes(),
        "decode_graph_steps": graphs,
        "reference": "transformers fp32 of the same file dequantized, greedy by full forwards",
        "kvserve_seconds": ours_s, "reference_seconds": ref_s, "per_prompt": per_prompt,
    }


def main(argv: list[str] | None = None) -> int:
    from kvserve.bench.common import env_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gguf-activations", default="int8x2", choices=("int8x2", "int8", "fp32"))
    ap.add_argument("--near-tie", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tokens < 1 or not 1 <= args.prompts <= len(CHAT):
        raise SystemExit(f"--tokens must be >= 1 and --prompts in 1..{len(CHAT)}")
    torch.set_num_threads(args.threads)
    result = run(args.model, args.tokens, args.prompts, args.gguf_activations, args.near_tie)
    result["env"] = env_info()
    result["command"] = " ".join(sys.argv)
    stem = os.path.splitext(os.path.basename(args.model))[0]
    out = args.json or os.path.join("docs", "bench", f"gguf_parity_{stem}.json")
    with open(out, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
    print(f"{result['model']}: greedy equal to transformers fp32 (full forwards) "
          f"{result['greedy_equal']} ({result['near_ties']} at near-ties); -> {out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
