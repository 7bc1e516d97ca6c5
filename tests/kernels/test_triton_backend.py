"""The engine end to end on the Triton backend (interpreter on CPU) == the torch backend."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kvserve import SamplingParams  # noqa: E402


@pytest.mark.parametrize("kv", ["fp32", "fp8", "int8", "fp8_rot"])
def test_engine_on_triton_backend_matches_torch(model_factory, make_llm, kv):
    path = model_factory("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=1)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1] + list(range(10, 28))},
               {"prompt_token_ids": [1, 5, 6, 7]}]
    ref = make_llm(path, dtype="float32", kv_cache_dtype=kv, num_blocks=16,
                   max_model_len=64).generate(prompts, sp)
    tri = make_llm(path, dtype="float32", kv_cache_dtype=kv, num_blocks=16, max_model_len=64,
                   attention_backend="triton")
    assert type(tri.engine.runner.backend).__name__ == "TritonAttentionBackend"
    got = tri.generate(prompts, sp)
    for a, b in zip(ref, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
