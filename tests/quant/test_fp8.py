"""FP8 KV quantization: round-trip bounds, outliers, the fast read path, capacity arithmetic."""

from __future__ import annotations

import pytest
import torch

from kvserve.cache.kv_cache import PagedKVCache, bytes_per_block
from kvserve.config import KVMode
from kvserve.kernels import reference as ref
from kvserve.quant import fp8

DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
BF16, FP8 = KVMode(torch.bfloat16), KVMode(torch.float8_e4m3fn)  # KV cache modes
# Relative error bound per element: half an ulp at the top binade (3 / 2 mantissa bits),
# plus the bf16 rounding of the scale that we quantize with (exact, so not added).
REL = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 8), (7, 2, 64), (33, 8, 128), (5, 1, 576)])
def test_round_trip_error_bound(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[0]).view(-1, 1, 1)
    q, s = ref.fp8_quantize_dynamic(x, dtype)
    y = ref.fp8_dequantize(q, s)
    amax = x.abs().amax(-1, keepdim=True)
    # Elements near the row max are within REL relatively; small ones within REL * amax.
    err = (y - x).abs()
    assert (err <= REL[dtype] * torch.maximum(x.abs(), amax * 2**-6) + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_outliers_never_nan_or_inf(dtype):
    x = torch.tensor([[[1e6, -3e7, 1e-20, 0.0] * 16]])
    q, s = ref.fp8_quantize_dynamic(x, dtype)
    y = ref.fp8_dequantize(q, s)
    assert torch.isfinite(y).all()
    # Static scale too small for the data: clamped to +-FP8_MAX, never NaN.
    q2 = ref.fp8_quantize(x, torch.tensor([[1e-3]], dtype=torch.bfloat16), dtype)
    assert torch.isfinite(q2.float()).all()
    assert q2.float().abs().max() == fp8.FP8_MAX[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_half_bits_path_equals_torch_cast(dtype):
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = torch.isfinite(every.float())
    out = torch.empty(256, dtype=torch.int16)
    fast = fp8.fp8_to_half_bits(every, out).float() * fp8.HALF_BITS_FACTOR[dtype]
    assert torch.equal(fast[finite], every.float()[finite])


def test_capacity_arithmetic_hand_worked():
    # 2 layers, block 16, 2 KV heads, head_dim 64, K+V.
    # bf16: 2*2*16*2*64*2 B = 16384 B/block. fp8: payload 8192 + scales 2*2*16*2*2 = 256 B.
    assert bytes_per_block(2, 16, 2, 64, 2, BF16) == 16384
    assert bytes_per_block(2, 16, 2, 64, 2, FP8) == 8192 + 256
    budget = 1 << 20
    assert budget // 16384 == 64 and budget // 8448 == 124
    # ratios the FP8 issue asks for: >= 1.90 at head_dim 64, >= 1.94 at head_dim 128
    for d, need in ((64, 1.90), (128, 1.94)):
        r = bytes_per_block(1, 16, 8, d, 2, BF16) / bytes_per_block(1, 16, 8, d, 2, FP8)
        assert r >= need


def test_cache_write_uses_stored_scale():
    kv = PagedKVCache(1, 4, 4, 2, 8, 2, FP8)
    k = torch.randn(3, 2, 8) * 5
    v = torch.randn(3, 2, 8)
    rows = torch.tensor([0, 1, 9])  # block 0 offsets 0,1; block 1 offset 1 (row 1*2*4+1)
    kv.write(0, rows, k, v)
    flat = kv.layer_rows(0)
    sc = kv.scales[0].view(-1, 2)
    back = ref.fp8_dequantize(flat[rows], sc[rows])
    assert torch.allclose(back, k, rtol=2**-4, atol=1e-6 * 5)
    backv = ref.fp8_dequantize(flat[rows + 4], sc[rows + 4])
    assert torch.allclose(backv, v, rtol=2**-4, atol=1e-6)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_engine_agrees_with_bf16(tiny_llama, make_llm, kv):
    """Teacher-forced next-token agreement and KL, FP8 KV vs BF16 KV, on an HF-reference model.

    (Free-running greedy on a random-init tiny model diverges at the first near-tie and never
    re-converges, so it measures luck; the trained demo model's greedy agreement is measured by
    ``kvserve bench quality``.)"""
    ids = [1] + [(37 * i) % 500 + 3 for i in range(200)]
    ref = make_llm(tiny_llama, dtype="float32", kv_cache_dtype="bf16").engine.prompt_logits(ids)
    got = make_llm(tiny_llama, dtype="float32", kv_cache_dtype=kv).engine.prompt_logits(ids)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert agree >= (0.85 if kv == "fp8" else 0.75), agree
    assert kl.mean() < (0.02 if kv == "fp8" else 0.05), kl.mean()


def test_fp8_gets_about_twice_the_blocks(tiny_llama, make_llm):
    a = make_llm(tiny_llama, dtype="float32", kv_cache_dtype="bf16", kv_cache_memory="4MiB")
    b = make_llm(tiny_llama, dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="4MiB")
    # tiny model head_dim 16: fp8 row = 16 + 2 B vs 32 B -> 1.78x
    assert b.engine.capacity_tokens / a.engine.capacity_tokens == pytest.approx(32 / 18, 0.02)
