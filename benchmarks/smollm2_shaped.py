"""A random-weight Llama folder with SmolLM2-135M's shapes, for tensor-parallel checks.

SmolLM2-135M (the default model) has 9 attention heads / 3 KV heads, so tp can only be 1, 3
or 9. This folder keeps every other shape (hidden 576, 30 layers, intermediate 1536, vocab
49,152, tied embeddings, bf16) with 8 query heads of 72 and 2 KV heads, so tp=2 splits it:

    PYTHONPATH=. python benchmarks/smollm2_shaped.py /tmp/smollm2-shaped
    PYTHONPATH=. python benchmarks/tp_decode.py --model /tmp/smollm2-shaped --batches 1,16

The weights are random (N(0, 0.02)): speed and memory only, its text is meaningless.
"""

from __future__ import annotations

import argparse


def make(out: str) -> str:
    import torch
    import transformers as tf

    from tests.conftest import save_tiny_tokenizer

    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=72, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         rope_theta=100000.0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else
                    torch.randn_like(p) * 0.02)
    model.save_pretrained(out)
    save_tiny_tokenizer(out, cfg.vocab_size)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    print(make(p.parse_args().out))
