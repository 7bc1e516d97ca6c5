"""Static checks of the shipped demo model folder (kvserve/demo_model). Fast: no weights are run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "kvserve" / "demo_model"
REQUIRED = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
]
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]

pytestmark = pytest.mark.skipif(not DEMO.is_dir(), reason="demo model not built")


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((DEMO / "config.json").read_text())


@pytest.fixture(scope="module")
def tok_config() -> dict:
    return json.loads((DEMO / "tokenizer_config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEMO / "tokenizer.json"))


def test_files_present():
    missing = [f for f in REQUIRED if not (DEMO / f).is_file()]
    assert not missing, f"missing from {DEMO}: {missing}"


def test_config_is_small_gqa_llama(config):
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    h, nq, nkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    assert config["head_dim"] == 64
    assert nq * 64 == h
    assert nkv < nq and nq % nkv == 0, "must be GQA"
    assert config["max_position_embeddings"] >= 2048
    rope = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    assert rope == 10000.0
    assert 4096 <= config["vocab_size"] <= 8192
    assert config["bos_token_id"] != config["eos_token_id"]


def test_safetensors_bf16_and_size(config):
    from safetensors import safe_open

    path = DEMO / "model.safetensors"
    assert path.stat().st_size <= 30 * 1024 * 1024
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_dtype() == "BF16"
        assert emb.get_shape() == [config["vocab_size"], config["hidden_size"]]
        k = f.get_slice("model.layers.0.self_attn.k_proj.weight")
        assert k.get_shape() == [config["num_key_value_heads"] * 64, config["hidden_size"]]
    n_layers = config["num_hidden_layers"]
    assert sum(k.endswith("self_attn.q_proj.weight") for k in keys) == n_layers
    if config.get("tie_word_embeddings"):
        assert "lm_head.weight" not in keys


def test_special_tokens_match_config(config, tok_config, tokenizer):
    for t in SPECIALS:
        assert tokenizer.token_to_id(t) is not None, t
    assert tokenizer.token_to_id(tok_config["bos_token"]) == config["bos_token_id"]
    assert tokenizer.token_to_id(tok_config["eos_token"]) == config["eos_token_id"]
    gen = json.loads((DEMO / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"]
    assert gen["bos_token_id"] == config["bos_token_id"]
    assert tokenizer.get_vocab_size() == config["vocab_size"]


@pytest.mark.parametrize(
    "text",
    [
        "The Python interpreter has a number of functions built into it.",
        "def f(x):\n    return x ** 2  # square\n",
        "Unicode: café, naïve, Ελληνικά, 日本語, emoji 🐍, tabs\tand\r\nnewlines",
        "",
    ],
)
def test_tokenizer_round_trips(tokenizer, config, text):
    enc = tokenizer.encode(text)
    assert enc.ids[0] == config["bos_token_id"], "tokenizer should prepend <|bos|>"
    assert tokenizer.decode(enc.ids, skip_special_tokens=True) == text
    plain = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(plain.ids) == text


def test_chat_template_renders(tok_config, tokenizer):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = tok_config["chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    s = env.from_string(template).render(
        messages=msgs, add_generation_prompt=True, bos_token=tok_config["bos_token"],
        eos_token=tok_config["eos_token"],
    )
    assert s.startswith("<|bos|>")
    assert "<|system|>" in s and "<|user|>" in s and "hi" in s
    assert s.rstrip("\n").endswith("<|assistant|>")
    ids = tokenizer.encode(s, add_special_tokens=False).ids
    assert ids.count(tokenizer.token_to_id("<|bos|>")) == 1
    assert tokenizer.token_to_id("<|assistant|>") in ids
    no_gen = env.from_string(template).render(
        messages=msgs, add_generation_prompt=False, bos_token="<|bos|>", eos_token="<|eos|>"
    )
    assert not no_gen.rstrip("\n").endswith("<|assistant|>")


def test_transformers_tokenizer_chat_template():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(DEMO))
    s = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert s == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\n"
    assert tok.eos_token == "<|eos|>" and tok.bos_token == "<|bos|>"


def test_model_card_reports_metrics():
    card = (DEMO / "README.md").read_text()
    needles = ("perplexity", "unigram", "Python Software Foundation", "train_demo_model.py")
    for needle in needles:
        assert needle.lower() in card.lower(), needle
