"""What bf16 adapter weights (``--lora-dtype auto`` on CPU) change against fp32 ones, on
SmolLM2-135M-Instruct (the default model) with a random rank-16 PEFT adapter on every
projection. One run (~1 minute on 2 cores), JSON out.

    python benchmarks/lora_dtype_agreement.py [--prompts 8] [--tokens 32] [--rank 16]
        [--std 0.02] [--json OUT]

Two measures:

- ``teacher_forced``: transformers + peft, the adapter merged into the GGUF dequantized to fp32
  (full forwards), once with the adapter's fp32 weights and once with them rounded to bf16 --
  what kvserve computes with bf16 slots (its C kernel widens bf16 exactly;
  tests/engine/test_lora.py checks its greedy output against that merge). Over each prompt and
  the fp32 model's greedy continuation: the KL divergence KL(fp32 || bf16) of every
  continuation position's next-token distribution (mean, max) and how often the two argmaxes
  agree.
- ``kvserve_greedy``: kvserve itself, ``lora_dtype=float32`` vs ``auto`` (bf16), the packed GGUF
  with fp32 activations and KV: the greedy continuations token by token (identical sequences,
  and the tokens before the first difference).

The adapter is as in benchmarks/lora_smollm2_check.py: lora_A and lora_B drawn from
N(0, std^2), so it changes the answers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_smollm2_check import CHAT, _hf, random_adapter  # noqa: E402

from kvserve.bench.common import env_info, log, write_json  # noqa: E402


def _rounded_copy(src: str, dst: str) -> str:
    """The PEFT folder ``src`` with every weight rounded to bf16 (stored fp32)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = os.path.join(dst, "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16).float() for k, v in load_file(f).items()}, f)
    return dst


def _teacher_forced(path: str, exact: str, rounded: str, prompts: list[list[int]],
                    tokens: int) -> dict:
    from peft import PeftModel

    ref = PeftModel.from_pretrained(_hf(path), exact).merge_and_unload().eval()
    low = PeftModel.from_pretrained(_hf(path), rounded).merge_and_unload().eval()
    kls, agree = [], []
    with torch.no_grad():
        for ids in prompts:
            out = ref.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            span = slice(len(ids) - 1, out.shape[1] - 1)  # positions predicting the output
            p = torch.log_softmax(ref(out).logits[0, span].double(), -1)
            q = torch.log_softmax(low(out).logits[0, span].double(), -1)
            kls += (p.exp() * (p - q)).sum(-1).tolist()
            agree += (p.argmax(-1) == q.argmax(-1)).tolist()
    return {"positions": len(kls), "kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
            "argmax_agreement": sum(agree) / len(agree)}


def _kvserve_greedy(path: str, adapter: str, prompts: list[list[int]], tokens: int) -> dict:
    from kvserve import LLM, LoRARequest, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    got = {}
    for dtype in ("float32", "auto"):
        llm = LLM(path, dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="64MiB",
                  gguf_activations="fp32", progress=False, lora_modules=[f"rand={adapter}"],
                  max_lora_rank=16, lora_dtype=dtype)
        slot = next(iter(llm.engine.runner.lora.wrapped.values())).lora_a
        log(f"lora_dtype={dtype}: slots hold {slot.dtype}")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=LoRARequest("rand"))
        got[dtype] = [o.outputs[0].token_ids for o in outs]
        del llm
    prefix = []
    for a, b in zip(got["float32"], got["auto"], strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix.append(n)
    return {"sequences": len(prompts), "tokens_each": tokens,
            "identical_sequences": sum(n == tokens for n in prefix),
            "tokens_before_first_difference": prefix}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Llama-family GGUF (default: SmolLM2)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from kvserve.model.default_model import default_model_path
    from kvserve.model.loader import load_tokenizer

    path = a.model or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        exact = os.path.join(tmp, "fp32")
        peft_model = random_adapter(path, a.rank, a.std)
        peft_model.save_pretrained(exact)
        rounded = _rounded_copy(exact, os.path.join(tmp, "bf16"))
        tok = load_tokenizer(path)
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": c}],
                                                tokenize=True, add_generation_prompt=True,
                                                return_dict=False))
                   for c in CHAT[: a.prompts]]
        tf = _teacher_forced(path, exact, rounded, prompts, a.tokens)
        log(f"teacher-forced: {tf}")
        kv = _kvserve_greedy(path, exact, prompts, a.tokens)
        log(f"kvserve greedy fp32 vs auto (bf16): {kv}")
    write_json(a.json, {"benchmark": "lora_dtype_agreement", "model": path, "rank": a.rank,
                        "std": a.std, "teacher_forced": tf, "kvserve_greedy": kv,
                        "env": env_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
