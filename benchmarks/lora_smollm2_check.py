"""LoRA correctness on SmolLM2-135M-Instruct (the default model): greedy output of kvserve with
a random PEFT adapter over the packed Q4_1 GGUF equals transformers + peft with the adapter
merged into the same GGUF dequantized to fp32 (full forwards), for several chat prompts, and
the base rows of the same batch equal transformers without it. One run, JSON out.

    .venv/bin/python benchmarks/lora_smollm2_check.py [--prompts 4] [--tokens 24] [--rank 16]
        [--std 0.02] [--json docs/bench/lora_smollm2_check.json]

Method: a rank ``--rank`` LoRA on every attention and MLP projection, lora_A and lora_B drawn
from N(0, std^2) (seeded; B non-zero, so the adapter changes the answers), saved with peft's
``save_pretrained`` (adapter_config.json + adapter_model.safetensors). kvserve serves the GGUF
with fp32 activations (``--gguf-activations fp32``) and fp32 KV, the adapter's and the base's
copy of every prompt in one batch. Exit status 1 when any continuation differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from kvserve.bench.common import env_info, log, write_json

CHAT = ["What is the capital of France?", "What is a list?", "Name three colors.",
        "How many legs does a spider have?", "Write a haiku about the sea.",
        "What is 2 + 2?", "Who wrote Romeo and Juliet?", "Say hello in Spanish."]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()


def _greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def random_adapter(path: str, rank: int, std: float):
    """A peft model over ``path``'s HF twin with a rank-``rank`` adapter on every projection,
    A and B drawn from N(0, std^2), seed 0 (B non-zero, so the adapter changes the answers)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(_hf(path), LoraConfig(r=rank, lora_alpha=2 * rank,
                                                      target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return peft_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Llama-family GGUF (default: SmolLM2)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from peft import PeftModel

    from kvserve import LLM, LoRARequest, SamplingParams
    from kvserve.model.default_model import default_model_path

    path = a.model or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        adapter = os.path.join(tmp, "adapter")
        peft_model = random_adapter(path, a.rank, a.std)
        peft_model.save_pretrained(adapter)
        log(f"adapter rank {a.rank} saved; serving {path}")
        llm = LLM(path, dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="64MiB",
                  gguf_activations="fp32", progress=False, lora_modules=[f"rand={adapter}"],
                  max_lora_rank=a.rank)
        prompts = [llm.apply_chat_template([{"role": "user", "content": c}])
                   for c in CHAT[: a.prompts]]
        params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in range(2)],
                            params, lora_request=[LoRARequest("rand"), None] * len(prompts))
        merged = PeftModel.from_pretrained(_hf(path), adapter).merge_and_unload().eval()
        base = _hf(path)
        tok = llm.get_tokenizer()
        rows = []
        for i, ids in enumerate(prompts):
            got_lora = outs[2 * i].outputs[0].token_ids
            got_base = outs[2 * i + 1].outputs[0].token_ids
            want_lora, want_base = _greedy(merged, ids, a.tokens), _greedy(base, ids, a.tokens)
            rows.append({"prompt": CHAT[i], "lora_equal": got_lora == want_lora,
                         "base_equal": got_base == want_base,
                         "adapter_changes_output": want_lora != want_base,
                         "lora_text": tok.decode(got_lora)})
            log(f"{CHAT[i]!r}: lora {got_lora == want_lora}, base {got_base == want_base}")
    ok = all(r["lora_equal"] and r["base_equal"] for r in rows)
    write_json(a.json, {"benchmark": "lora_smollm2_check", "model": path, "rank": a.rank,
                        "std": a.std, "tokens": a.tokens, "all_equal": ok, "prompts": rows,
                        "env": env_info()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
