"""Each Triton kernel against its pure-torch twin in kvserve.kernels.reference.

On CUDA the full sweeps run. Without CUDA the kernels run under TRITON_INTERPRET=1 (set by
conftest.py before triton is imported), roughly 2000x slower than torch, so shapes are tiny
and each sweep is cut to a covering subset: every pair of the first two axes, the other axes
cycled through their values. The cache is poisoned with NaN outside the written positions
(conftest.build_paged_cache), so a kernel that reads a slot it should mask shows up as NaN.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

pytest.importorskip("triton")

from kvserve.config import KVStorage  # noqa: E402
from kvserve.kernels import reference as ref  # noqa: E402
from kvserve.kernels.triton import attention as ta  # noqa: E402
from kvserve.kernels.triton import cache as tc  # noqa: E402
from kvserve.kernels.triton import int4 as t4  # noqa: E402

# slow: Triton kernels in the interpreter
pytestmark = pytest.mark.slow

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALED = [*FP8, torch.int8]  # stored with per-row bf16 scales
ATTN_DTYPES = [torch.bfloat16, torch.float16, *SCALED]


def sweep(*axes: list) -> list[tuple]:
    """Full product on GPU; under the interpreter every pair of axes 0 and 1, the rest cycled."""
    if ON_GPU:
        return list(itertools.product(*axes))
    out = []
    for i, (a, b) in enumerate(itertools.product(axes[0], axes[1])):
        rest, div = [], 1
        for ax in axes[2:]:
            rest.append(ax[(i // div) % len(ax)])
            div *= len(ax)
        out.append((a, b, *rest))
    return out


def _q_dtype(cache_dtype: torch.dtype, group: int = 1) -> torch.dtype:
    """Model dtype: fp16 for an fp16 cache; FP8 caches are paired with fp16 models at G=2."""
    if cache_dtype == torch.float16 or (cache_dtype in SCALED and group == 2):
        return torch.float16
    return torch.bfloat16


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-2, "rtol": 1e-2}


def _ids(params: list[tuple]) -> list[str]:
    return ["-".join(str(p).replace("torch.", "") for p in combo) for combo in params]


# ---------------------------------------------------------------------------------------------
# Decode attention (split-K)
# ---------------------------------------------------------------------------------------------

DECODE = sweep(ATTN_DTYPES, [1, 2, 4], [8, 16], [64, 128])


@pytest.mark.parametrize("dtype,group,block_size,head_dim", DECODE, ids=_ids(DECODE))
def test_decode_attention(paged_cache, dtype, group, block_size, head_dim):
    seq_lens = [300, 1, 0, 129, 64, 1000, 17] if ON_GPU else [37, 1, 0, 20]
    n_kvh = 8 if ON_GPU else 2
    c = paged_cache(
        seq_lens,
        dtype=dtype,
        n_comp=2,
        block_size=block_size,
        n_kv_heads=n_kvh,
        head_dim=head_dim,
        device=DEVICE,
        seed=group,
    )
    q = torch.randn(len(seq_lens), n_kvh * group, head_dim, device=DEVICE).to(
        _q_dtype(dtype, group)
    )
    sm = head_dim**-0.5
    args = (c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, sm)
    out = ta.paged_decode_attention(q, *args)
    exp = ref.paged_decode_attention(q.float(), *args)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), exp, **_tol(q.dtype))
    assert torch.equal(out[2].float(), torch.zeros_like(exp[2]))  # seq_len 0


@pytest.mark.parametrize("num_splits,bound", [(1, None), (2, "capacity"), (5, "exact")])
def test_decode_attention_split_counts(paged_cache, num_splits, bound):
    c = paged_cache(
        [45, 3],
        dtype=torch.float8_e4m3fn,
        n_comp=2,
        block_size=8,
        n_kv_heads=1,
        head_dim=32,
        device=DEVICE,
    )
    q = torch.randn(2, 2, 32, device=DEVICE, dtype=torch.bfloat16)
    args = (c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, 0.2)
    max_seq_len = {None: None, "capacity": c.block_tables.shape[1] * 8, "exact": 45}[bound]
    out = ta.paged_decode_attention(q, *args, num_splits=num_splits, max_seq_len=max_seq_len)
    exp = ref.paged_decode_attention(q.float(), *args)
    torch.testing.assert_close(out.float(), exp, **_tol(q.dtype))
    with pytest.raises(ValueError):
        ta.paged_decode_attention(q, *args, max_seq_len=10_000)


# ---------------------------------------------------------------------------------------------
# Prefill / extend attention (ragged, causal)
# ---------------------------------------------------------------------------------------------

PREFILL = sweep(ATTN_DTYPES, [1, 2, 4], [8, 16], [64, 128])


@pytest.mark.parametrize("dtype,group,block_size,head_dim", PREFILL, ids=_ids(PREFILL))
def test_prefill_attention(paged_cache, make_qsl, dtype, group, block_size, head_dim):
    if ON_GPU:
        seq_lens, q_lens = [300, 1, 129, 64, 200, 5], [300, 1, 0, 17, 70, 5]
    else:
        seq_lens, q_lens = [37, 1, 3, 20], [5, 1, 0, 20]
    n_kvh = 4 if ON_GPU else 1
    c = paged_cache(
        seq_lens,
        dtype=dtype,
        n_comp=2,
        block_size=block_size,
        n_kv_heads=n_kvh,
        head_dim=head_dim,
        device=DEVICE,
        seed=10 + group,
    )
    q = torch.randn(sum(q_lens), n_kvh * group, head_dim, device=DEVICE).to(_q_dtype(dtype, group))
    qsl = make_qsl(q_lens, DEVICE)
    sm = head_dim**-0.5
    args = (c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, qsl, sm)
    out = ta.paged_attention(q, *args)
    exp = ref.paged_attention(q.float(), *args)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), exp, **_tol(q.dtype))
    out2 = ta.paged_attention(q, *args, max_query_len=max(q_lens))
    assert torch.equal(out, out2)


# ---------------------------------------------------------------------------------------------
# MLA decode
# ---------------------------------------------------------------------------------------------

MLA_DIMS = [(32, 16), (512, 64)] if ON_GPU else [(32, 16)]
MLA = sweep([torch.bfloat16, *FP8], [4, 20], [8, 16], MLA_DIMS)


@pytest.mark.parametrize("dtype,n_heads,block_size,dims", MLA, ids=_ids(MLA))
def test_mla_decode(paged_cache, dtype, n_heads, block_size, dims):
    lora, rope = dims
    seq_lens = [200, 1, 0, 77] if ON_GPU else [40, 1, 0, 9]
    c = paged_cache(
        seq_lens,
        dtype=dtype,
        n_comp=1,
        block_size=block_size,
        n_kv_heads=1,
        head_dim=lora + rope,
        device=DEVICE,
        seed=n_heads,
    )
    B = len(seq_lens)
    qn = torch.randn(B, n_heads, lora, device=DEVICE, dtype=torch.bfloat16)
    qr = torch.randn(B, n_heads, rope, device=DEVICE, dtype=torch.bfloat16)
    sm = (lora + rope) ** -0.5
    args = (c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, sm, lora)
    out = ta.mla_decode(qn, qr, *args)
    exp = ref.mla_decode(qn.float(), qr.float(), *args)
    assert out.shape == (B, n_heads, lora) and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), exp, **_tol(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# Fused cache write (bit-exact with the twin, checksum state included)
# ---------------------------------------------------------------------------------------------

WRITE = sweep([torch.bfloat16, torch.float16, torch.float32, *SCALED], [1, 2], [8, 16],
              [False, True])


def _write_case(dtype, n_comp, block_size, n_heads, head_dim, n_blocks, device):
    kv = torch.zeros(2, n_blocks, n_comp, block_size, n_heads, head_dim, dtype=dtype, device=device)
    sc = (torch.zeros(kv.shape[:-1], dtype=KVStorage(dtype).scale_dtype, device=device)
          if dtype in SCALED else None)
    cs = torch.zeros(2, n_blocks, 4, dtype=torch.int64, device=device)
    return kv, sc, cs


def _assert_same_cache(a, b):
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    if a[1] is not None:
        assert torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
    assert torch.equal(a[2], b[2])


@pytest.mark.parametrize("dtype,n_comp,block_size,input_fp32", WRITE, ids=_ids(WRITE))
def test_write_kv_bit_exact(dtype, n_comp, block_size, input_fp32):
    n_heads, head_dim = (2, 64) if n_comp == 2 else (1, 48)  # MLA-style 32 + 16 row
    if dtype == torch.int8 and n_comp == 2:
        n_heads = 3  # odd: a token's 1-byte scale codes straddle checksum words
    if ON_GPU:
        n_heads, head_dim = (8, 128) if n_comp == 2 else (1, 576)
    n_blocks = 40 if ON_GPU else 2
    a = _write_case(dtype, n_comp, block_size, n_heads, head_dim, n_blocks, DEVICE)
    b = _write_case(dtype, n_comp, block_size, n_heads, head_dim, n_blocks, DEVICE)
    gen = torch.Generator().manual_seed(block_size + n_comp)
    order = torch.randperm(n_blocks * block_size, generator=gen)
    chunk = 97 if ON_GPU else 11
    for part in order.split(chunk):
        slots = torch.cat([part, torch.tensor([-1])]).to(DEVICE)  # one padding slot
        T = slots.numel()
        x_dtype = torch.float32 if input_fp32 else torch.bfloat16
        k = (torch.randn(T, n_heads, head_dim, generator=gen) * 4).to(DEVICE, x_dtype)
        k[0, 0, 1] = 1e5  # an outlier
        v = torch.randn(T, n_heads, head_dim, generator=gen).to(DEVICE, x_dtype)
        v = v if n_comp == 2 else None
        ref.write_kv(a[0], a[1], 1, slots, k, v, a[2])
        tc.write_kv(b[0], b[1], 1, slots, k, v, b[2])
    _assert_same_cache(a, b)
    recomputed = ref.block_checksum_state(b[0], b[1], 1, torch.arange(n_blocks, device=DEVICE))
    assert torch.equal(b[2][1], recomputed)
    assert b[2][0].abs().sum() == 0 and b[0][0].float().abs().sum() == 0  # layer 0 untouched


def test_write_kv_static_scales_and_strided_input():
    dtype = torch.float8_e4m3fn
    a = _write_case(dtype, 2, 8, 4, 32, 2, DEVICE)
    b = _write_case(dtype, 2, 8, 4, 32, 2, DEVICE)
    qkv = torch.randn(16, 3, 4, 32, device=DEVICE, dtype=torch.bfloat16) * 3  # k, v are views
    k, v = qkv[:, 1], qkv[:, 2]
    k_scale = torch.tensor([0.01, 0.02, 0.005, 0.03], device=DEVICE)
    slots = torch.arange(16, device=DEVICE)
    ref.write_kv(a[0], a[1], 0, slots, k, v, a[2], k_scale=k_scale, v_scale=0.02)
    tc.write_kv(b[0], b[1], 0, slots, k, v, b[2], k_scale=k_scale, v_scale=0.02)
    _assert_same_cache(a, b)


def test_write_kv_int8_rounding_ties_and_clamp():
    """INT8 write: exact .5 ties round to even, the row max maps to +-127, -128 never appears,
    bit-exact with the twin (kvserve.quant.int8)."""
    a = _write_case(torch.int8, 2, 8, 1, 8, 1, DEVICE)
    b = _write_case(torch.int8, 2, 8, 1, 8, 1, DEVICE)
    # amax 127 -> scale exactly 1.0: the codes are round-half-even of the inputs
    k = torch.tensor([[[127.0, -127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5]]]).repeat(8, 1, 1)
    slots = torch.arange(8, device=DEVICE)
    ref.write_kv(a[0], a[1], 0, slots, k.to(DEVICE), -k.to(DEVICE), a[2])
    tc.write_kv(b[0], b[1], 0, slots, k.to(DEVICE), -k.to(DEVICE), b[2])
    _assert_same_cache(a, b)
    assert b[0][0, 0, 0, 0, 0].tolist() == [127, -127, 0, 2, 2, 0, -2, -126]
    with pytest.raises(ValueError, match="k_scale"):
        tc.write_kv(b[0], b[1], 0, slots, k.to(DEVICE), k.to(DEVICE), b[2], k_scale=1.0,
                    v_scale=1.0)


def test_write_kv_without_checksum():
    a = _write_case(torch.float8_e5m2, 2, 16, 2, 16, 2, DEVICE)
    b = _write_case(torch.float8_e5m2, 2, 16, 2, 16, 2, DEVICE)
    k, v = torch.randn(2, 5, 2, 16, device=DEVICE)
    slots = torch.tensor([3, -1, 17, 30, 0], device=DEVICE)
    ref.write_kv(a[0], a[1], 1, slots, k, v)
    tc.write_kv(b[0], b[1], 1, slots, k, v)
    _assert_same_cache(a, b)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_rounding_matches_torch(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    vals = codes[torch.isfinite(codes)].abs().unique()  # every non-negative finite code
    mids = (vals[1:] + vals[:-1]) / 2  # ties: round half to even
    zero, big = torch.tensor(0.0), torch.tensor(1e9)
    x = torch.cat([vals, mids, torch.nextafter(mids, zero), torch.nextafter(mids, big)])
    x = torch.cat([x, -x, torch.rand(5000) ** 8 * ref.fp8_max(dtype) * torch.randn(5000).sign()])
    x = x.clamp(-ref.fp8_max(dtype), ref.fp8_max(dtype)).to(DEVICE)
    got = tc.fp32_to_fp8_bits(x, dtype)
    assert torch.equal(got, x.to(dtype).view(torch.uint8).int())


def test_bf16_rounding_matches_torch():
    x = torch.rand(20000) * torch.logspace(-30, 30, 20000)
    x = torch.cat([x, torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1e-12 / 448])]).to(DEVICE)
    got = tc.fp32_to_bf16_bits(x)
    assert torch.equal(got, x.to(torch.bfloat16).view(torch.int16).int() & 0xFFFF)


# ---------------------------------------------------------------------------------------------
# W4A16 GEMM
# ---------------------------------------------------------------------------------------------

if ON_GPU:
    INT4 = list(
        itertools.product(
            [(1, 4096, 4096, 128), (33, 1000, 1000, 128), (128, 512, 768, 64), (5, 24, 100, 32)],
            [True, False],
            [torch.bfloat16, torch.float16],
        )
    )
else:
    INT4 = [
        ((5, 24, 100, 32), True, torch.bfloat16),
        ((17, 40, 64, 64), False, torch.float16),
        ((3, 16, 256, 128), True, torch.float16),
        ((2, 9, 72, 8), False, torch.bfloat16),
    ]


@pytest.mark.parametrize("mnkg,symmetric,dtype", INT4, ids=_ids(INT4))
def test_int4_matmul(mnkg, symmetric, dtype):
    m, n, k, g = mnkg
    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=gen)
    packed, scales, zeros = ref.quantize_int4(w.to(dtype), g, symmetric=symmetric)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    packed, scales = packed.to(DEVICE), scales.to(DEVICE)
    zeros = None if zeros is None else zeros.to(DEVICE)
    out = t4.int4_matmul(x, packed, scales, zeros, g)
    exp = ref.int4_matmul(x.float(), packed, scales, zeros, g)
    assert out.dtype == dtype and out.shape == (m, n)
    scale = exp.abs().max().item()
    torch.testing.assert_close(out.float(), exp, atol=1e-2 * scale, rtol=1e-2)
