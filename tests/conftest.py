"""Shared fixtures: tiny random-init HF models saved with save_pretrained, built once per
session, and a leak check after every test that used an engine."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

_ENGINES: list = []


def make_tiny_model(path: str, arch: str = "llama", save_dtype: torch.dtype = torch.float32,
                    **overrides) -> str:
    """Random-init tiny HF model + a tokenizer, saved to ``path`` (tensors and config dtype in
    ``save_dtype``)."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[arch]
    cfg = cfg_cls(**common)
    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.float32)
    # Sharper logits than the default init so greedy decoding is not knife-edge.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.to(save_dtype).save_pretrained(path)
    save_tiny_tokenizer(path, common["vocab_size"])
    return path


def save_tiny_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over a fixed vocabulary (no network, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    vocab = {t: i for i, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    cache: dict = {}

    def make(arch: str, **overrides) -> str:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture
def make_llm():
    """Build kvserve LLMs; after the test, every engine must have all blocks free."""
    from kvserve import LLM

    made = []

    def make(model: str, **kw):
        kw.setdefault("progress", False)
        kw.setdefault("kv_cache_memory", "8MiB")
        llm = LLM(model, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.check_no_leaks()
