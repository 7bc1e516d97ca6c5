"""Gemma 3 from a GGUF file (architecture ``gemma3``): a tiny random HF folder written as GGUF the
way llama.cpp's converter does ((1 + w) norms, the window in the metadata, tied head), then read
by kvserve: logits and greedy tokens equal transformers' fp32 model of the folder, the local
layers get their window, and the file's chat template is used. The real Gemma 3 270M Q4_K_M
file is checked when it is present (KVSERVE_GEMMA3_GGUF or $KVSERVE_REAL_GGUF_DIR)."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve import SamplingParams
from tests.model.gguf_writer import write_gguf
from tests.model.parity import assert_greedy_equal, assert_logits_close

# six layers: llama.cpp's pattern makes layer 5 global, layers 0-4 local (window 8)
CONFIG = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, tie_word_embeddings=True,
              num_hidden_layers=6, max_position_embeddings=256)
PROMPTS = [list(range(1, 41)), [1, 17, 33, 101, 5], [1] + [(13 * j) % 500 + 3 for j in range(22)]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.conftest import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3hf")), "gemma3", **CONFIG)


@pytest.fixture(scope="module")
def f32_gguf(folder, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gemma3gguf") / "tiny-gemma3-f32.gguf")
    return write_gguf(folder, out, lambda name: "F32")


def test_gguf_logits_and_greedy_match_transformers(folder, f32_gguf, make_llm, monkeypatch,
                                                   tmp_path):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a fresh metadata conversion
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    assert hf.config.layer_types[5] == "full_attention"
    from transformers import AutoConfig

    from kvserve.model.gemma3 import Gemma3ForCausalLM
    from kvserve.model.gguf import GGUFCheckpoint

    config = AutoConfig.from_pretrained(GGUFCheckpoint(f32_gguf).metadata_dir)
    spec = Gemma3ForCausalLM.spec_for(config)
    assert spec.layer_windows == (8, 8, 8, 8, 8, 0) and spec.scale == 16 ** -0.5
    llm = make_llm(f32_gguf, dtype="float32", block_size=4)
    assert_logits_close(llm, hf, PROMPTS[:2], atol=2e-3, rtol=1e-3)
    assert_greedy_equal(llm, hf, PROMPTS, max_tokens=12)


def test_gguf_chat_template_is_used(f32_gguf, make_llm):
    from tests.model.gguf_writer import CHAT_TEMPLATE

    llm = make_llm(f32_gguf, dtype="float32")
    assert llm.get_tokenizer().chat_template == CHAT_TEMPLATE
    out = llm.chat([{"role": "user", "content": "The capital of France"}],
                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def _real_file() -> str | None:
    real_dir = os.environ.get("KVSERVE_REAL_GGUF_DIR",
                              os.path.expanduser("~/.cache/kvserve/real-gguf"))
    for p in (os.environ.get("KVSERVE_GEMMA3_GGUF"),
              os.path.join(real_dir, "gemma-3-270m-q4_k_m.gguf")):
        if p and os.path.isfile(p):
            return p
    return None


def _readable(path: str) -> bool:
    """False while this build's GGUF reader cannot read one of the file's types (its Q5_0
    tensors need the full type coverage of kvserve/model/gguf.py)."""
    from kvserve.model.gguf import GGUFCheckpoint

    try:
        GGUFCheckpoint(path)
    except ValueError as e:
        if "ggml type" in str(e) or "not supported" in str(e):
            return False
        raise
    return True


@pytest.mark.slow
@pytest.mark.skipif(_real_file() is None, reason="Gemma 3 270M Q4_K_M GGUF not present")
def test_real_gemma3_270m_generates(make_llm):
    """The public 270M base model: loads, its 15 local layers get window 512 (3 global), and it
    completes text (no chat template in the file: plain completion). Its greedy tokens against
    transformers are benchmarks/gguf_parity.py's (docs/benchmarks.md)."""
    if not _readable(_real_file()):
        pytest.skip("this build cannot read the file's GGUF types yet")
    from transformers import AutoConfig

    from kvserve.model.gemma3 import Gemma3ForCausalLM
    from kvserve.model.gguf import GGUFCheckpoint

    config = AutoConfig.from_pretrained(GGUFCheckpoint(_real_file()).metadata_dir)
    windows = Gemma3ForCausalLM.spec_for(config).layer_windows
    assert windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    llm = make_llm(_real_file(), kv_cache_memory="64MiB")
    assert not getattr(llm.get_tokenizer(), "chat_template", None)
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=8))[0]
    text = out.outputs[0].text
    assert len(out.outputs[0].token_ids) == 8
    assert "if n" in text or "return" in text, text  # greedy: "\n    if n == 0:\n ..."
