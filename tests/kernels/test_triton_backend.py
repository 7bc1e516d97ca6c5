"""The engine end to end on the Triton backend (interpreter on CPU) == the torch backend."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvserve import SamplingParams  # noqa: E402

# slow: Triton backend in the interpreter
pytestmark = pytest.mark.slow

# On a GPU the Triton kernels need CUDA tensors; without one they run in the interpreter on CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
                   attention_backend="triton", device=DEVICE)
    assert type(tri.engine.runner.backend).__name__ == "TritonAttentionBackend"
    got = tri.generate(prompts, sp)
    for a, b in zip(ref, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn", "int8"])
def test_cache_write_runs_the_fused_kernel_bit_exact(dtype):
    """``PagedKVCache.write`` is the one write path: built with ``writer="triton"`` it runs the
    Triton kernel (slots from rows when none are given), bit-exact with the reference write."""
    import torch

    from kvserve.cache.kv_cache import PagedKVCache
    from kvserve.config import KVMode
    from kvserve.kernels import reference as ref

    dt = getattr(torch, dtype)
    kv = PagedKVCache(2, 4, 4, 2, 8, 2, KVMode(dt), device=DEVICE, checksums=True, writer="triton")
    state = kv.csum_state
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    k, v = k.to(DEVICE), v.to(DEVICE)
    slots = torch.tensor([0, 3, 5, 9, 14], device=DEVICE)
    rows = slots // 4 * 8 + slots % 4  # component-0 rows: (block * C) * bs + offset
    kv.write(1, rows, k, v)
    data, scales = torch.zeros_like(kv.data), None if kv.scales is None else \
        torch.zeros_like(kv.scales)
    twin_state = torch.zeros_like(state)
    ref.write_kv(data, scales, 1, slots, k, v, twin_state)
    assert torch.equal(kv.data.view(torch.uint8), data.view(torch.uint8))
    assert scales is None or torch.equal(kv.scales.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(state, twin_state)
