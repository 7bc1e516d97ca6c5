"""The pure-torch twins (kvserve.kernels.reference) against plain dense math. CPU, fast."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import KVStorage
from kvserve.kernels import reference as ref

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
STORAGE = [torch.float32, torch.bfloat16, torch.float16, *FP8, torch.int8]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Dense causal attention of the LAST q_len positions: q[q_len, Hq, D], k/v[S, Hkv, D]."""
    q_len, n_qh, _ = q.shape
    seq_len, n_kvh, _ = k.shape
    g = n_qh // n_kvh
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    ctx = seq_len - q_len
    allowed = torch.arange(seq_len)[None, :] <= (ctx + torch.arange(q_len))[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=allowed,
        scale=sm_scale,
    )
    return out.transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_sdpa(paged_cache, make_qsl, dtype, group, block_size):
    seq_lens, q_lens = [37, 1, 20, 9], [5, 1, 20, 0]
    c = paged_cache(
        seq_lens,
        dtype=dtype,
        n_comp=2,
        block_size=block_size,
        n_kv_heads=2,
        head_dim=16,
        seed=group,
    )
    n_qh = 2 * group
    q = torch.randn(sum(q_lens), n_qh, 16)
    qsl = make_qsl(q_lens)
    out = ref.paged_attention(
        q, c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, qsl, sm_scale=0.3
    )
    assert out.shape == q.shape and torch.isfinite(out).all()
    for b in range(len(seq_lens)):
        if q_lens[b] == 0:
            continue
        exp = _sdpa(q[qsl[b] : qsl[b + 1]], c.dense[b][0], c.dense[b][1], 0.3)
        torch.testing.assert_close(out[qsl[b] : qsl[b + 1]], exp, atol=1e-5, rtol=1e-5)


def test_decode_is_q_len_one(paged_cache, make_qsl):
    c = paged_cache(
        [13, 1, 40], dtype=torch.bfloat16, n_comp=2, block_size=8, n_kv_heads=2, head_dim=32
    )
    q = torch.randn(3, 8, 32, dtype=torch.bfloat16)
    a = ref.paged_decode_attention(
        q, c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, 0.2
    )
    b = ref.paged_attention(
        q, c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, make_qsl([1, 1, 1]), 0.2
    )
    assert a.dtype == torch.bfloat16
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    exp = torch.stack([_sdpa(q[i : i + 1], c.dense[i][0], c.dense[i][1], 0.2)[0] for i in range(3)])
    torch.testing.assert_close(a.float(), exp, atol=1e-2, rtol=1e-2)


def test_empty_sequence_gives_zeros(paged_cache):
    c = paged_cache([5, 0], dtype=torch.float32, n_comp=2, block_size=4, n_kv_heads=1, head_dim=8)
    q = torch.randn(2, 2, 8)
    out = ref.paged_decode_attention(q, c.kv_data, None, c.layer, c.block_tables, c.seq_lens, 1.0)
    assert torch.equal(out[1], torch.zeros(2, 8))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_mla_decode_matches_unabsorbed_attention(paged_cache, dtype):
    """Absorbed MLA over the latent cache == plain MHA on up-projected K/V."""
    lora, rope, d_nope, d_v, n_qh = 32, 16, 24, 20, 3
    c = paged_cache(
        [29, 1, 8], dtype=dtype, n_comp=1, block_size=8, n_kv_heads=1, head_dim=lora + rope, seed=3
    )
    w_uk = torch.randn(n_qh, d_nope, lora) / lora**0.5
    w_uv = torch.randn(n_qh, d_v, lora) / lora**0.5
    q_nope, q_rope = torch.randn(3, n_qh, d_nope), torch.randn(3, n_qh, rope)
    q_abs = torch.einsum("bhn,hnl->bhl", q_nope, w_uk)
    sm = (d_nope + rope) ** -0.5
    lat = ref.mla_decode(
        q_abs, q_rope, c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, sm, lora
    )
    out = torch.einsum("bhl,hvl->bhv", lat, w_uv)
    for b in range(3):
        row = c.dense[b][0, :, 0]  # [S, lora + rope]
        c_kv, k_rope = row[:, :lora], row[:, lora:]
        k = torch.cat(
            [torch.einsum("sl,hnl->shn", c_kv, w_uk), k_rope[:, None].expand(-1, n_qh, -1)], dim=-1
        )
        v = torch.einsum("sl,hvl->shv", c_kv, w_uv)
        q = torch.cat([q_nope[b], q_rope[b]], dim=-1)[None]
        exp = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=sm
        ).transpose(0, 1)[0]
        torch.testing.assert_close(out[b], exp, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Cache write and FP8 quantisation
# ---------------------------------------------------------------------------------------------


def _empty_cache(dtype, n_comp=2, blocks=6, bs=4, heads=2, dim=16, layers=2):
    kv = torch.zeros(layers, blocks, n_comp, bs, heads, dim, dtype=dtype)
    sd = KVStorage(dtype).scale_dtype
    sc = torch.zeros(kv.shape[:-1], dtype=sd) if sd is not None else None
    return kv, sc, torch.zeros(layers, blocks, 4, dtype=torch.int64)


@pytest.mark.parametrize("dtype", STORAGE)
def test_write_kv_round_trip(dtype):
    kv, sc, _ = _empty_cache(dtype)
    T = 12
    slots = torch.randperm(24)[:T]
    k = torch.randn(T, 2, 16) * torch.logspace(-3, 3, 16)  # wide dynamic range inside a row
    v = torch.randn(T, 2, 16)
    ref.write_kv(kv, sc, 1, slots, k, v)
    blocks, offs = slots // 4, slots % 4
    for c, x in enumerate([k, v]):
        scales = None if sc is None else sc[1, blocks, c, offs]
        got = ref.dequantize_rows(kv[1, blocks, c, offs], scales)
        if dtype == torch.float32:
            assert torch.equal(got, x)
        elif dtype == torch.int8:  # half a step; step <= 2^(1/8) amax / 127 (1-byte scale)
            amax = x.abs().amax(-1, keepdim=True)
            assert ((got - x).abs() <= amax / 254 * 2 ** (1 / 8) * (1 + 2**-20)).all()
        elif not KVStorage(dtype).is_fp8:
            assert torch.equal(got, x.to(dtype).float())
        else:
            amax = x.abs().amax(-1, keepdim=True)
            # e4m3: 3 mantissa bits -> rel 2^-4; e5m2: 2 bits -> 2^-3. Plus the subnormal step
            # (amax/FP8_MAX * 2^-(MANT+BIAS-1)) and the clamp after bf16-rounding the scale.
            rel = 2.0**-4 if dtype == torch.float8_e4m3fn else 2.0**-3
            bound = rel * x.abs() + amax * 2.0**-7 + 1e-30
            assert ((got - x).abs() <= bound).all()
    assert kv[0].float().abs().sum() == 0  # other layer untouched


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_scale_formula_and_outliers(dtype):
    fmax = ref.fp8_max(dtype)
    assert fmax == (448.0 if dtype == torch.float8_e4m3fn else 57344.0)
    kv, sc, cs = _empty_cache(dtype, blocks=2)
    k = torch.randn(4, 2, 16)
    k[0, 0, 3] = 1e6  # outlier
    k[1, 1] = 0.0  # all-zero row
    k[2, 0, 0] = -3e38  # near fp32 max
    v = torch.randn(4, 2, 16).bfloat16()
    ref.write_kv(kv, sc, 0, torch.arange(4), k, v, cs)
    amax = k.abs().amax(-1)
    exp_scale = (amax.clamp_min(1e-12) / fmax).to(torch.bfloat16)
    assert torch.equal(sc[0, 0, 0, :4], exp_scale)
    deq = ref.dequantize_rows(kv[0, 0, 0, :4], sc[0, 0, 0, :4])
    assert torch.isfinite(deq).all() and torch.isfinite(kv.float()).all()
    assert abs(deq[0, 0, 3].item() - 1e6) <= 1e6 * 2**-3
    assert torch.equal(deq[1, 1], torch.zeros(16))
    assert (kv[0, 0, 0, :4].float().abs() <= fmax).all()
    assert torch.equal(cs[0, 0], ref.block_checksum_state(kv, sc, 0, torch.tensor([0]))[0])


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_static_scales(per_head):
    kv, sc, _ = _empty_cache(torch.float8_e4m3fn)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16) * 100
    k_scale = torch.tensor([0.01, 0.02]) if per_head else 0.01
    v_scale = torch.tensor([1.0, 3.0]) if per_head else 0.5
    ref.write_kv(kv, sc, 1, torch.tensor([0, 5, -1]), k, v, k_scale=k_scale, v_scale=v_scale)
    for c, s in enumerate([k_scale, v_scale]):
        exp = torch.as_tensor(s, dtype=torch.float32).to(torch.bfloat16).expand(2)
        assert torch.equal(sc[1, 0, c, 0], exp) and torch.equal(sc[1, 1, c, 1], exp)
        x = [k, v][c][0]
        q = (x / exp.float()[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(kv[1, 0, c, 0].view(torch.uint8), q.view(torch.uint8))
    assert sc[1, 0, :, 1:].float().abs().sum() == 0  # untouched slots stay zero


def test_padding_slots_skipped():
    kv, sc, cs = _empty_cache(torch.bfloat16)
    ref.write_kv(
        kv, sc, 0, torch.tensor([-1, -1]), torch.randn(2, 2, 16), torch.randn(2, 2, 16), cs
    )
    assert kv.float().abs().sum() == 0 and cs.abs().sum() == 0


def test_mla_write_needs_no_v():
    kv, sc, cs = _empty_cache(torch.float8_e5m2, n_comp=1, heads=1, dim=24)
    ref.write_kv(kv, sc, 0, torch.arange(4), torch.randn(4, 1, 24), None, cs)
    assert torch.equal(cs[0, 0], ref.block_checksum_state(kv, sc, 0, torch.tensor([0]))[0])
    with pytest.raises(ValueError):
        ref.write_kv(kv, sc, 0, torch.arange(4), torch.randn(4, 1, 24), torch.randn(4, 1, 24))


# ---------------------------------------------------------------------------------------------
# Checksum state
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("n_comp", [1, 2])
def test_checksum_accumulated_equals_recomputed(dtype, n_comp):
    kv, sc, cs = _empty_cache(dtype, n_comp=n_comp, blocks=5, bs=4, heads=3, dim=6)
    kv[0].view(torch.uint8).random_(0, 256)  # the other layer's bytes must not matter
    order = torch.randperm(20)
    for chunk in order.split(6):  # several calls, random order, with padding slots mixed in
        slots = torch.cat([chunk, torch.tensor([-1])])[torch.randperm(len(chunk) + 1)]
        k = torch.randn(len(slots), 3, 6) * 10
        v = torch.randn(len(slots), 3, 6) if n_comp == 2 else None
        ref.write_kv(kv, sc, 1, slots, k, v, cs)
    state = ref.block_checksum_state(kv, sc, 1, torch.arange(5))
    assert torch.equal(cs[1], state)
    assert cs[0].abs().sum() == 0
    assert (state[:, :2] != 0).any()
    if sc is None:
        assert state[:, 2:].abs().sum() == 0


def test_checksum_is_linear_in_tokens():
    """Each token's contribution is independent of the others: sum over tokens == block."""
    kv, sc, _ = _empty_cache(torch.float8_e4m3fn, blocks=2, bs=4, heads=2, dim=8)
    ref.write_kv(kv, sc, 0, torch.arange(8), torch.randn(8, 2, 8), torch.randn(8, 2, 8))
    contrib = ref.token_checksum_contrib(kv, sc, 0, torch.arange(8))
    state = ref.block_checksum_state(kv, sc, 0, torch.tensor([0, 1]))
    assert torch.equal(contrib[:4].sum(0), state[0]) and torch.equal(contrib[4:].sum(0), state[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_every_single_bit_flip_is_detected(dtype):
    kv, sc, _ = _empty_cache(dtype, blocks=1, bs=2, heads=2, dim=4, layers=1)
    ref.write_kv(kv, sc, 0, torch.arange(2), torch.randn(2, 2, 4), torch.randn(2, 2, 4))
    base = ref.block_checksum_state(kv, sc, 0, torch.tensor([0]))
    targets = [kv.view(torch.int16)] + ([sc.view(torch.int16)] if sc is not None else [])
    for t in targets:
        flat = t.view(-1)
        for i in range(flat.numel()):
            for bit in range(16):
                old = flat[i].clone()
                mask = torch.tensor(1 << bit if bit < 15 else -(1 << 15), dtype=torch.int16)
                flat[i] = old ^ mask
                state = ref.block_checksum_state(kv, sc, 0, torch.tensor([0]))
                assert not torch.equal(state, base), (i, bit)
                flat[i] = old
    assert torch.equal(ref.block_checksum_state(kv, sc, 0, torch.tensor([0])), base)


def test_double_flip_that_cancels_s1_changes_s2():
    kv, _, _ = _empty_cache(torch.bfloat16, blocks=1, layers=1)
    words = kv.view(torch.int16).view(-1)
    words.copy_(torch.randint(-30000, 30000, words.shape, dtype=torch.int16))
    # word 3 gains +2^4 (bit 4 set from 0), word 40 loses 2^4 (bit 4 cleared from 1)
    words[3] = words[3] & ~16
    words[40] = words[40] | 16
    before = ref.block_checksum_state(kv, None, 0, torch.tensor([0]))[0]
    words[3] = words[3] | 16
    words[40] = words[40] & ~16
    after = ref.block_checksum_state(kv, None, 0, torch.tensor([0]))[0]
    assert after[0] == before[0]  # S1 blind to this pair
    assert after[1] - before[1] == 16 * (4 - 41)  # S2: (i+1) weights differ


def test_word_swap_changes_s2_only():
    kv, sc, _ = _empty_cache(torch.float8_e5m2, blocks=1, layers=1)
    ref.write_kv(kv, sc, 0, torch.arange(4), torch.randn(4, 2, 16), torch.randn(4, 2, 16))
    base = ref.block_checksum_state(kv, sc, 0, torch.tensor([0]))[0]
    for t, col in [(kv.view(torch.int16).view(-1), 0), (sc.view(torch.int16).view(-1), 2)]:
        i, j = 1, t.numel() - 2
        assert t[i] != t[j]
        ti, tj = t[i].clone(), t[j].clone()
        t[i], t[j] = tj, ti
        st = ref.block_checksum_state(kv, sc, 0, torch.tensor([0]))[0]
        assert st[col] == base[col] and st[col + 1] != base[col + 1]
        t[i], t[j] = ti, tj


def test_checksum_exact_for_large_blocks():
    """Worst-case words in a large block: int64 sums stay exact (no wrap-around)."""
    kv = torch.empty((1, 1, 2, 64, 8, 128), dtype=torch.float32)
    kv.view(torch.int16).fill_(-32768)
    st = ref.block_checksum_state(kv, None, 0, torch.tensor([0]))[0]
    n = kv.numel() * 2
    assert st[0].item() == -32768 * n
    assert st[1].item() == -32768 * n * (n + 1) // 2


# ---------------------------------------------------------------------------------------------
# INT4
# ---------------------------------------------------------------------------------------------


def test_int4_packing_layout():
    u = torch.randint(0, 16, (3, 20))
    padded = F.pad(u, (0, 4))
    words = torch.zeros(3, 3, dtype=torch.int64)
    for k in range(24):
        words[:, k // 8] |= padded[:, k] << (4 * (k % 8))  # low nibble first
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(ref.unpack_int4(packed, 20), u)
    # symmetric: stored q + 8
    scale = torch.rand(3, 1) + 0.5
    w = ref.dequantize_int4(packed, scale, None, group_size=32, k=20)
    torch.testing.assert_close(w, (u.float() - 8) * scale)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("mnkg", [(5, 24, 100, 32), (4, 16, 256, 128), (1, 9, 64, 64)])
def test_int4_matmul(symmetric, mnkg):
    m, n, k, g = mnkg
    w = torch.randn(n, k)
    packed, scales, zeros = ref.quantize_int4(w, g, symmetric=symmetric)
    assert packed.shape == (n, -(-k // 8)) and scales.shape == (n, -(-k // g))
    wd = ref.dequantize_int4(packed, scales, zeros, g, k)
    step = scales.float().repeat_interleave(g, 1)[:, :k]
    assert ((wd - w).abs() <= 0.5 * step + 1e-6).all()
    x = torch.randn(m, k)
    torch.testing.assert_close(ref.int4_matmul(x, packed, scales, zeros, g), x @ wd.T)
    if zeros is not None:  # the dim-0-packed zero-point form gives the same weights
        zw = F.pad(zeros.long(), (0, 0, 0, (-n) % 8)).view(-1, 8, zeros.shape[1])
        zp = (zw << (torch.arange(8) * 4)[None, :, None]).sum(1)
        zp = torch.where(zp >= 2**31, zp - 2**32, zp).to(torch.int32)  # [ceil(N/8), G]
        torch.testing.assert_close(ref.dequantize_int4(packed, scales, zp, g, k), wd)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_twin_agrees_with_canonical_packer(symmetric):
    """Same numbers as kvserve.quant.int4 (the canonical pack-quantized code) for its tensors."""
    q4 = pytest.importorskip("kvserve.quant.int4")
    if not all(hasattr(q4, f) for f in ("quantize_rtn", "to_compressed_tensors", "dequantize")):
        pytest.skip("kvserve.quant.int4 API changed")
    w = q4.quantize_rtn(torch.randn(20, 96), group_size=32, symmetric=symmetric)
    ct = q4.to_compressed_tensors(w)
    zp = ct.get("weight_zero_point")  # packed along dim 0: [ceil(N/8), G]
    ours = ref.dequantize_int4(ct["weight_packed"], ct["weight_scale"], zp, 32, k=96)
    torch.testing.assert_close(ours, q4.dequantize(w), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# The CPU path must not pull in triton
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_reference_does_not_import_triton():
    code = "import sys, kvserve.kernels.reference; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
