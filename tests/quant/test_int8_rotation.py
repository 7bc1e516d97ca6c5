"""INT8 KV quantization and the q/k/v rotation: round trips, invariance, error bounds, modes."""

from __future__ import annotations

import pytest
import torch

from kvserve.cache.kv_cache import PagedKVCache, bytes_per_block
from kvserve.config import CacheConfig, KVMode, resolve_kv_mode
from kvserve.kernels import reference as ref
from kvserve.quant import int8
from kvserve.quant.rotation import KVRotation, hadamard, rotation_matrix

HEAD_DIMS = [16, 32, 64, 128, 72, 20]  # powers of two: Hadamard; others: random orthogonal


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rotation_is_orthogonal_and_round_trips(d):
    r = rotation_matrix(d, seed=3)
    torch.testing.assert_close(r @ r.t(), torch.eye(d), atol=1e-6, rtol=0)
    rot = KVRotation(d, 3)
    x = torch.randn(50, 4, d) * torch.logspace(-3, 3, 50).view(-1, 1, 1)
    y = rot.invert(rot.apply(x))
    # exact up to fp32 rounding: two D-term dot products per element
    err = (y - x).abs() / x.abs().amax(-1, keepdim=True)
    assert err.max() < 8 * d * 2**-24
    assert torch.equal(rotation_matrix(d, 3), rotation_matrix(d, 3))  # deterministic
    assert not torch.equal(rotation_matrix(d, 3), rotation_matrix(d, 4))  # the seed matters


def test_hadamard_rotation_spreads_an_outlier_channel():
    h = hadamard(8)
    assert torch.equal(h @ h.t(), 8 * torch.eye(8))
    x = torch.zeros(64)
    x[5] = 10.0  # one outlier channel: amax/rms = 8 before, 1 after
    y = KVRotation(64, 0).apply(x)
    torch.testing.assert_close(y.abs(), torch.full((64,), 10.0 / 8))
    with pytest.raises(ValueError, match="power of two"):
        hadamard(12)


@pytest.mark.parametrize("d", [16, 64, 72])
@pytest.mark.parametrize("group", [1, 3])
def test_attention_with_rotated_qkv_equals_unrotated(d, group):
    """Before quantization, attention over (qR, kR, vR) rotated back by R^T equals attention
    over (q, k, v) within fp32 tolerance (the reference paged attention, causal, GQA)."""
    torch.manual_seed(0)
    hk, bs, seq = 2, 8, 29
    hq = hk * group
    rot = KVRotation(d, 11)
    q = torch.randn(seq, hq, d)
    k = torch.randn(seq, hk, d) * 4
    v = torch.randn(seq, hk, d)
    outs = []
    for qq, kk, vv in ((q, k, v), (rot.apply(q), rot.apply(k), rot.apply(v))):
        data = torch.zeros(1, 4, 2, bs, hk, d)
        slots = torch.arange(seq)
        ref.write_kv(data, None, 0, slots, kk, vv)
        tables = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
        o = ref.paged_attention(qq, data, None, 0, tables, torch.tensor([seq]),
                                torch.tensor([0, seq]), d**-0.5)
        outs.append(o)
    torch.testing.assert_close(rot.invert(outs[1]), outs[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", [(1, 1, 8), (7, 2, 64), (33, 8, 128), (5, 1, 576)])
def test_int8_round_trip_error_bound(shape):
    """|x' - x| <= scale / 2 per element (uniform grid, round to nearest); the 1-byte scale
    2^(e/8) is the smallest step with 127 * scale >= amax (nothing clips), so scale is within
    a factor 2^(1/8) of amax / 127 and every element is within amax / 254 * 2^(1/8)."""
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-2, 3, shape[0]).view(-1, 1, 1)
    q, codes = ref.int8_quantize_dynamic(x)
    assert q.dtype == torch.int8 and codes.dtype == torch.int8 and int(q.min()) >= -127
    s = int8.code_to_scale(codes)
    amax = x.abs().amax(-1)
    assert (127 * s >= amax).all()  # rounded up: |x / s| <= 127
    assert (127 * int8.code_to_scale(codes.long() - 1) < amax).all()  # and the smallest such
    y = ref.int8_dequantize(q, codes)
    err = (y - x).abs()
    assert (err <= s.unsqueeze(-1) / 2 * (1 + 2**-20) + 1e-30).all()
    assert (err <= amax.unsqueeze(-1) / 254 * 2 ** (1 / 8) * (1 + 2**-20)).all()


def test_int8_scale_codes_range_and_table():
    """scale(e) = 2^(e/8) exactly for the 8 mantissas; codes saturate at both ends."""
    e = torch.arange(-128, 128)
    assert torch.allclose(int8.SCALE_TABLE.double(), 2.0 ** (e.double() / 8), rtol=2**-24)
    assert torch.equal(int8.SCALE_TABLE[::8], torch.exp2(e[::8].float() / 8))
    x = torch.tensor([[0.0, 0.0], [1e-9, 0.0], [1e9, 1.0], [127.0, 1.0]])
    codes = ref.int8_compute_codes(x)
    assert codes.tolist() == [-128, -128, 127, 0]
    q = ref.int8_quantize(x, int8.code_to_scale(codes))
    assert q[2, 0] == 127 and q[3, 0] == 127  # beyond the range: saturates, no wrap


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_cache_write_matches_quantizer_twin_and_bounds(kind):
    """What the cache stores (C writer where built) dequantizes to the twin's values, within
    each mode's bound: INT8 amax/254 per element, FP8 half an ulp of its mantissa."""
    torch.manual_seed(1)
    dtype = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}[kind]
    t, h, d = 24, 2, 64
    kv = PagedKVCache(1, 4, 8, h, d, 2, KVMode(dtype))
    x = torch.randn(t, h, d) * torch.logspace(-2, 2, t).view(-1, 1, 1)
    rows = torch.arange(t)
    rows = (rows // 8) * 16 + rows % 8
    kv.write(0, rows, x, x)
    if kind == "int8":
        got = ref.int8_dequantize(kv.layer_rows(0)[rows], kv.scales[0].view(-1, h)[rows])
        want = ref.int8_dequantize(*ref.int8_quantize_dynamic(x))
        bound = x.abs().amax(-1, keepdim=True) / 254 * 2 ** (1 / 8) * (1 + 2**-20)
    else:
        got = (kv.layer_rows(0)[rows].float()
               * kv.scales[0].view(-1, h)[rows].float().unsqueeze(-1))
        want = ref.fp8_dequantize(*ref.fp8_quantize_dynamic(x, dtype))
        rel = 2**-4 if dtype == torch.float8_e4m3fn else 2**-3
        bound = rel * torch.maximum(x.abs(), x.abs().amax(-1, keepdim=True) * 2**-6)
    assert torch.equal(got, want)
    assert ((got - x).abs() <= bound + 1e-30).all()


def test_int8_scale_overhead_and_capacity():
    """INT8 stores 1 scale byte per head_dim-wide row (FP8: 2): <= 3% at head_dim 64."""
    for d in (64, 128):
        i8 = bytes_per_block(30, 16, 3, d, 2, KVMode(torch.int8))
        f8 = bytes_per_block(30, 16, 3, d, 2, KVMode(torch.float8_e4m3fn))
        b16 = bytes_per_block(30, 16, 3, d, 2, KVMode(torch.bfloat16))
        assert i8 == 30 * 2 * 16 * 3 * (d + 1) and f8 == 30 * 2 * 16 * 3 * (d + 2)
        assert (i8 - b16 / 2) / i8 == 1 / (d + 1)  # 1.54% at 64, 0.78% at 128
        assert b16 / i8 >= 1.96
    kv = PagedKVCache(2, 3, 16, 3, 64, 2, KVMode(torch.int8))
    assert kv.scales.dtype == torch.int8 and kv.bytes_per_token == 2 * 2 * 3 * 65
    assert "1-byte" in kv.describe()
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(1, 2, 3, 1, 64, 1, KVMode(torch.int8))


def test_kv_modes_and_errors():
    assert resolve_kv_mode("int8", torch.float32) == KVMode(torch.int8, True)
    assert resolve_kv_mode("int8_plain", torch.float32) == KVMode(torch.int8, False)
    assert resolve_kv_mode("fp8_rot", torch.float32) == KVMode(torch.float8_e4m3fn, True)
    assert resolve_kv_mode("fp8", torch.float32) == KVMode(torch.float8_e4m3fn, False)
    assert resolve_kv_mode("auto", torch.bfloat16).name == "bf16"
    names = [resolve_kv_mode(m, torch.float32).name
             for m in ("int8", "int8_plain", "fp8", "fp8_rot", "fp8_e5m2", "fp8_e5m2_rot")]
    assert names == ["int8_rot", "int8_plain", "fp8_e4m3_plain", "fp8_e4m3_rot",
                     "fp8_e5m2_plain", "fp8_e5m2_rot"]  # 8-bit names say their rotation
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_mode("int8_rotated", torch.float32)
    with pytest.raises(ValueError, match="kv_rotation_seed"):
        CacheConfig(kv_cache_dtype="int8", kv_rotation_seed=-1)
    with pytest.raises(ValueError, match="head_dim"):
        PagedKVCache(1, 2, 4, 1, 15, 2, KVMode(torch.int8))
    # the mode says whether the cache rotates; the seed comes with a rotated mode only
    with pytest.raises(ValueError, match="rotation_seed"):
        PagedKVCache(1, 2, 4, 1, 16, 2, KVMode(torch.int8, rotate=True))
    with pytest.raises(ValueError, match="rotation_seed"):
        PagedKVCache(1, 2, 4, 1, 16, 2, KVMode(torch.int8), rotation_seed=0)
    rotated = PagedKVCache(1, 2, 4, 1, 16, 2, KVMode(torch.int8, rotate=True), rotation_seed=0)
    assert rotated.mode.name == "int8_rot" and rotated.rotation is not None
