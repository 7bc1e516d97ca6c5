"""Write tiny GGUF files with the ``gguf`` package, the way llama.cpp's converter lays them out.

``write_gguf(hf_folder, out, types)`` takes a (tiny, random) HF checkpoint made by
``tests.conftest.make_tiny_model`` and writes it as GGUF: arch metadata, a byte-level BPE
tokenizer (trained here on a few sentences; tokens, merges, token types, BOS/EOS ids, a chat
template), and every tensor under its GGUF name in the ggml type ``types`` picks (Q4_0, Q4_1,
Q8_0, F16, F32). Llama / Mistral q/k rows are permuted as ``convert_hf_to_gguf.py`` does;
Gemma 3's norms are stored as (1 + w), its local window as ``gemma3.attention.sliding_window``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = ("The capital of France is Paris. A list holds items in order. Python is a language. "
        "What is the weather today? The quick brown fox jumps over the lazy dog. ") * 4
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows per head: halves -> interleaved)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [None] * vocab_size
    for t, i in vocab.items():
        tokens[i] = t
    for i in range(vocab_size):  # the trainer may stop short of vocab_size: pad
        if tokens[i] is None:
            tokens[i] = f"<pad{i}>"
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges


def write_gguf(hf_folder: str, out: str, types: Callable[[str], str],
               data: Callable[[str, np.ndarray, str], np.ndarray] | None = None) -> str:
    """Write ``hf_folder``'s model as GGUF to ``out``; ``types(gguf_name)`` -> ggml type name.
    ``data(gguf_name, fp32 array, type name)`` -> the tensor's bytes (raw blocks, or the
    float array for F32 / F16): replaces ``gguf.quants.quantize`` (hand-packed blocks)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    with open(os.path.join(hf_folder, "config.json")) as f:
        cfg = json.load(f)
    arch = {"mistral": "llama", "gemma3_text": "gemma3"}.get(cfg["model_type"],
                                                              cfg["model_type"])  # llama.cpp's
    n_layers = cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # gemma3: the global layers' (llama.cpp's base)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    tokens, merges = _tokenizer(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    tmap = gguf.get_tensor_name_map(arch_id, n_layers)
    state = load_file(os.path.join(hf_folder, "model.safetensors"))
    for name, t in state.items():
        base, _, suffix = name.rpartition(".")
        gname = f"{tmap.get_name(base)}.{suffix}"
        arr = t.float().numpy()
        if arch in ("llama", "mistral") and base.endswith("q_proj"):
            arr = _permute(arr, heads)
        elif arch in ("llama", "mistral") and base.endswith("k_proj"):
            arr = _permute(arr, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1  # convert_hf_to_gguf.py's Gemma3Model stores (1 + w)
        kind = types(gname) if arr.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        if data is not None and arr.ndim == 2:
            raw = data(gname, arr, kind)
            if kind in ("F32", "F16"):
                w.add_tensor(gname, raw)
            else:
                w.add_tensor(gname, raw, raw_dtype=qtype)
        elif kind == "F32":
            w.add_tensor(gname, arr.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_hf(gguf_path: str):
    """transformers' own reading of the file: every tensor dequantized, fp32."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()
