"""INT4 formats (kvserve.quant.int4) and Int4Linear (kvserve.layers.int4.linear).

Reference packers here are written independently of the library, with explicit per-element bit
operations, from the format descriptions (compressed-tensors pack-quantized, GPTQ v1/v2).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.layers.int4.layouts import int4pack_layout
from kvserve.layers.int4.linear import Int4Linear, int4_experts_from_dense
from kvserve.layers.int4.methods import CpuPackMethod
from kvserve.quant import int4


def _to_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def ref_pack_rows(nibbles: list[list[int]]) -> torch.Tensor:
    """Unsigned nibbles [R][C] -> int32 [R, ceil(C/8)], value c at bits 4*(c%8) of word c//8."""
    out = []
    for row in nibbles:
        words = [0] * math.ceil(len(row) / 8)
        for c, v in enumerate(row):
            assert 0 <= v <= 15
            words[c // 8] |= v << (4 * (c % 8))
        out.append([_to_int32(w) for w in words])
    return torch.tensor(out, dtype=torch.int32)


def ref_pack_gptq(q: torch.Tensor, zeros_u: torch.Tensor, scales: torch.Tensor, g_idx,
                  fmt: str) -> dict[str, torch.Tensor]:
    """GPTQ tensors from unsigned q [K, N], unsigned zeros [ng, N] (the real zero points)."""
    k, n = q.shape
    qweight = ref_pack_rows(q.t().tolist()).t().contiguous()  # packed along K: [K/8, N]
    stored = zeros_u - 1 if fmt == "gptq" else zeros_u  # v1 stores zero - 1
    qzeros = ref_pack_rows(stored.tolist())  # packed along N: [ng, N/8]
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales,
            "g_idx": torch.tensor(g_idx, dtype=torch.int32)}


# --------------------------------------------------------------------------- packing


def test_pack_hand_built_bytes() -> None:
    v = torch.arange(-8, 8, dtype=torch.int8).view(1, 16)  # nibbles 0..15
    packed = int4.pack_int4(v, dim=1)
    assert packed.tolist() == [[0x76543210, _to_int32(0xFEDCBA98)]]
    # partial word: 3 values -> tail nibbles are 0 (not 8)
    assert int4.pack_int4(torch.tensor([[7, -8, 0]], dtype=torch.int8)).tolist() == [[0x80F]]
    # along dim 0 (zero points): 9 rows -> 2 words per column
    z = torch.arange(9, dtype=torch.int8).view(9, 1) - 4
    pz = int4.pack_int4(z, dim=0)
    assert pz.shape == (2, 1)
    assert pz[:, 0].tolist() == [_to_int32(0xBA987654), 0xC]


@pytest.mark.parametrize("shape", [(1, 1), (4, 8), (5, 13), (16, 200), (9, 64)])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_roundtrip_and_reference(shape: tuple[int, int], dim: int) -> None:
    g = torch.Generator().manual_seed(sum(shape) + dim)
    v = torch.randint(-8, 8, shape, dtype=torch.int8, generator=g)
    packed = int4.pack_int4(v, dim)
    assert torch.equal(int4.unpack_int4(packed, shape[dim], dim), v)
    nib = (v.to(torch.int64) + 8)
    ref = ref_pack_rows(nib.tolist()) if dim == 1 else ref_pack_rows(nib.t().tolist()).t()
    assert torch.equal(packed, ref)


@pytest.mark.slow
def test_pack_matches_compressed_tensors() -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(1)
    for shape in [(16, 64), (5, 13), (24, 200)]:
        v = torch.randint(-8, 8, shape, dtype=torch.int8, generator=g)
        for dim in (0, 1):
            assert torch.equal(helpers.pack_to_int32(v, 4, packed_dim=dim),
                               int4.pack_int4(v, dim))


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="values"):
        int4.pack_int4(torch.tensor([[8]], dtype=torch.int8))
    with pytest.raises(ValueError, match="dim"):
        int4.pack_int4(torch.zeros(2, 2, dtype=torch.int8), dim=2)
    with pytest.raises(ValueError, match="size"):
        int4.unpack_int4(torch.zeros(2, 2, dtype=torch.int32), 40)


# --------------------------------------------------------------------------- quantize / dequantize


def _ref_dequant(w: int4.Int4Weight) -> torch.Tensor:
    out = torch.empty(w.out_features, w.in_features)
    gi = w.group_index().tolist()
    for o in range(w.out_features):
        for k in range(w.in_features):
            z = 0 if w.zeros is None else int(w.zeros[o, gi[k]])
            out[o, k] = (int(w.values[o, k]) - z) * float(w.scales[o, gi[k]])
    return out


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size,k", [(32, 64), (64, 64), (128, 256), (32, 45), (-1, 37)])
def test_quantize_rtn_roundtrip(symmetric: bool, group_size: int, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    w = torch.randn(6, k, generator=g) * 0.1
    q = int4.quantize_rtn(w, group_size, symmetric)
    assert q.values.dtype == torch.int8 and q.values.shape == w.shape
    assert int(q.values.min()) >= -8 and int(q.values.max()) <= 7
    assert q.n_groups == (1 if group_size == -1 else math.ceil(k / group_size))
    d = int4.dequantize(q)
    assert torch.allclose(d, _ref_dequant(q), atol=1e-6)
    # error bounded by half a step (+ clamp of the positive max in the symmetric case)
    step = q.scales.float()[:, q.group_index()]
    assert ((d - w).abs() <= step * (1.0 if symmetric else 0.5) + 1e-6).all()
    # the compressed-tensors tensors carry the same weight
    ct = int4.to_compressed_tensors(q)
    assert ct["weight_packed"].shape == (6, math.ceil(k / 8))
    assert ct["weight_shape"].tolist() == [6, k]
    assert ("weight_zero_point" in ct) == (not symmetric)
    back = int4.from_compressed_tensors(**ct, group_size=group_size)
    assert torch.equal(int4.dequantize(back), d)


def test_clip_search_lowers_error() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    plain = (int4.dequantize(int4.quantize_rtn(w, 64)) - w).square().sum()
    clipped = (int4.dequantize(int4.quantize_rtn(w, 64, clip_search=True)) - w).square().sum()
    assert clipped < 0.95 * plain


@pytest.mark.parametrize("symmetric", [True, False])
def test_matches_compressed_tensors_quantizer(symmetric: bool) -> None:
    """Our values/scales/zeros reproduce compressed-tensors' own quantize and decompressor."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize

    # fp32: compressed-tensors rounds w / scale in the weight's dtype, we always use fp32
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    q = int4.quantize_rtn(w, 32, symmetric)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group",
                            group_size=32)
    zp = q.zeros if q.zeros is not None else torch.zeros_like(q.scales, dtype=torch.int8)
    ct_vals = quantize(x=w, scale=q.scales, zero_point=zp, args=args, dtype=torch.int8)
    assert torch.equal(ct_vals, q.values)
    q = int4.quantize_rtn(w.bfloat16(), 32, symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    sd = int4.to_compressed_tensors(q)
    sd["weight_scale"] = q.scales
    out = PackedQuantizationCompressor.decompress(sd, scheme)
    assert torch.equal(out["weight"], int4.dequantize(q, torch.bfloat16))


def test_int4weight_validation() -> None:
    v = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="scales"):
        int4.Int4Weight(v, torch.ones(4, 3), None, 4)
    with pytest.raises(ValueError, match="group_size"):
        int4.Int4Weight(v, torch.ones(4, 2), None, 0)
    with pytest.raises(ValueError, match="g_idx"):
        int4.Int4Weight(v, torch.ones(4, 2), None, 4, torch.full((8,), 5))
    with pytest.raises(ValueError, match="group_size"):
        int4.quantize_rtn(torch.randn(4, 8), group_size=0)


# --------------------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_unpack(fmt: str, sym: bool, act_order: bool) -> None:
    g = torch.Generator().manual_seed(7)
    k, n, gs = 64, 16, 16
    ng = k // gs
    q = torch.randint(0, 16, (k, n), generator=g)  # unsigned, [in, out] like qweight
    if sym:
        zeros_u = torch.full((ng, n), 8)
    else:
        # v1 stores zero - 1, so its zero points span [1, 16]; v2 stores [0, 15]
        lo = 1 if fmt == "gptq" else 0
        zeros_u = torch.randint(lo, lo + 16, (ng, n), generator=g)
    scales = torch.rand(ng, n, generator=g) * 0.1 + 0.01
    if act_order:  # desc_act: group of channel = its rank in a random order // group size
        order = torch.randperm(k, generator=g)
        g_idx = (torch.argsort(order) // gs).tolist()
    else:
        g_idx = [i // gs for i in range(k)]
    tensors = ref_pack_gptq(q, zeros_u, scales, g_idx, fmt)
    w = int4.unpack_gptq(**tensors, group_size=gs, sym=sym, checkpoint_format=fmt)
    ref = torch.empty(n, k)
    for i in range(k):
        gi = g_idx[i]
        ref[:, i] = (q[i].float() - zeros_u[gi].float()) * scales[gi]
    assert torch.allclose(int4.dequantize(w), ref, atol=1e-6)
    assert (w.g_idx is not None) == act_order
    lin = Int4Linear(w)
    assert torch.allclose(lin.dequantize(), ref, atol=float(scales.max()) * 8 / 256)
    x = torch.randn(3, k, generator=g)
    assert torch.allclose(lin(x), x @ lin.dequantize().t(), atol=2e-2, rtol=2e-2)


def test_gptq_rejects_bad_format() -> None:
    with pytest.raises(ValueError, match="checkpoint_format"):
        int4.unpack_gptq(torch.zeros(1, 8, dtype=torch.int32), None, torch.ones(1, 8),
                         group_size=8, sym=True, checkpoint_format="awq")


# --------------------------------------------------------------------------- Int4Linear


def _check_linear(lin: Int4Linear, q: int4.Int4Weight, bias: torch.Tensor | None,
                  m: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m)
    twin_w = lin.dequantize()
    # the layer's weight is the format's weight up to bf16 rounding of (scale, zero)
    ref_w = int4.dequantize(q)
    tol_w = q.scales.float().abs().max() * (9 if q.zeros is not None else 1) / 128
    assert (twin_w - ref_w).abs().max() <= tol_w
    x = torch.randn(m, q.in_features, generator=g).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (m, q.out_features)
    ref = x.float() @ twin_w.t() + (bias if bias is not None else 0.0)
    err = (y.float() - ref).abs().max() / ref.abs().max()
    # bf16 rounding of x (op path) and of the output
    assert err < 2e-2, float(err)


SHAPES = [  # (N, K, group, symmetric)
    (64, 128, 32, True), (48, 256, 128, False), (33, 96, 64, True), (40, 45, 32, False),
    (24, 37, -1, True), (32, 320, 160, True), (16, 512, 512, False), (17, 48, 16, True),
]


@pytest.mark.parametrize("n,k,gs,sym", SHAPES)
@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_matches_twin(n: int, k: int, gs: int, sym: bool, m: int,
                                  dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * k)
    q = int4.quantize_rtn(torch.randn(n, k, generator=g) * 0.05, gs, sym,
                          scale_dtype=torch.bfloat16)
    bias = torch.randn(n, generator=g) if sym else None
    lin = Int4Linear(q, bias)
    # bf16 scales, zero 0: the packed layer is exact
    if sym and isinstance(lin.method, CpuPackMethod):
        assert torch.equal(lin.dequantize(), int4.dequantize(q))
    _check_linear(lin, q, bias, m, dtype)


@pytest.mark.parametrize("dequant_min_m", [1, 10_000])
def test_int4_linear_both_paths(dequant_min_m: int) -> None:
    """Force the dequant path at M=1 and the int4 op at M=64 (and 3-D input)."""
    g = torch.Generator().manual_seed(0)
    q = int4.quantize_rtn(torch.randn(40, 200, generator=g), 64, False)
    lin = Int4Linear(q, dequant_min_m=dequant_min_m)
    for m in (1, 64):
        _check_linear(lin, q, None, m, torch.bfloat16)
    x = torch.randn(2, 3, 200, generator=g)
    assert torch.allclose(lin(x), lin(x.view(6, 200)).view(2, 3, 40))
    assert lin(torch.zeros(0, 200)).shape == (0, 40)


def test_int4_linear_fast_path_present() -> None:
    layout = int4pack_layout()
    if layout is None:
        pytest.skip("torch int4 CPU op unavailable: twin path only")
    assert layout[0] in (16, 32, 64)
    lin = Int4Linear.from_dense(torch.randn(64, 128), 32)
    assert isinstance(lin.method, CpuPackMethod) and lin.method.packed is not None
    coarse = Int4Linear.from_dense(torch.randn(64, 128), 16)  # 16 | G' impossible
    assert not isinstance(coarse.method, CpuPackMethod)
    # 4 bits + bf16 (scale, zero) per 32 weights = 6 bits/weight vs 16
    assert lin.weight_bytes() == 64 * 128 // 2 + (128 // 32) * 64 * 2 * 2


def test_int4_linear_irregular_act_order() -> None:
    """g_idx whose groups are not all group_size long: kept as-is on the twin path."""
    g = torch.Generator().manual_seed(5)
    k, n = 32, 16
    g_idx = torch.randint(0, 4, (k,), generator=g)
    q = int4.Int4Weight(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g),
                        torch.rand(n, 4, generator=g), None, 8, g_idx)
    lin = Int4Linear(q)
    assert not isinstance(lin.method, CpuPackMethod)
    assert torch.allclose(lin.dequantize(), int4.dequantize(q))
    x = torch.randn(2, k, generator=g)
    assert torch.allclose(lin(x), x @ int4.dequantize(q).t(), atol=1e-5)


def test_from_compressed_tensors_and_concat() -> None:
    g = torch.Generator().manual_seed(2)
    parts = [int4.quantize_rtn(torch.randn(n, 64, generator=g), 32, False) for n in (32, 16)]
    fused = Int4Linear(int4.concat_out(parts))
    single = [Int4Linear(int4.from_compressed_tensors(**int4.to_compressed_tensors(p),
                                                      group_size=32)) for p in parts]
    x = torch.randn(5, 64, generator=g)
    assert torch.allclose(fused(x), torch.cat([s(x) for s in single], -1))
    with pytest.raises(ValueError, match="in_features"):
        int4.concat_out([parts[0], int4.quantize_rtn(torch.randn(8, 32), 32)])


def test_int4_linear_errors() -> None:
    lin = Int4Linear.from_dense(torch.randn(32, 64), 32)
    with pytest.raises(ValueError, match="x must be"):
        lin(torch.randn(2, 63))
    with pytest.raises(ValueError, match="bias"):
        Int4Linear(int4.quantize_rtn(torch.randn(32, 64), 32), torch.zeros(3))
    with pytest.raises(ValueError, match="dequant_min_m"):
        Int4Linear(int4.quantize_rtn(torch.randn(32, 64), 32), dequant_min_m=0)


def test_experts_helper() -> None:
    w = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(4))
    experts = int4_experts_from_dense(w, 32)
    assert len(experts) == 3
    for e, lin in enumerate(experts):
        assert torch.allclose(lin.dequantize(), int4.dequantize(int4.quantize_rtn(w[e], 32)),
                              atol=float(w.abs().max()) / 7.5 / 32)


# --------------------------------------------------------------------------- AWQ


def test_awq_beats_rtn_with_outlier_channels() -> None:
    """LLM-like activations (log-normal channel scales, 1% outlier channels x30)."""
    g = torch.Generator().manual_seed(0)
    k, n, tokens = 128, 128, 256
    c = torch.exp(torch.randn(k, generator=g) * 0.8)
    c[torch.randperm(k, generator=g)[:3]] *= 30
    x, x_test = (torch.randn(tokens, k, generator=g) * c for _ in range(2))
    w = torch.randn(n, k, generator=g) * 0.02
    res = int4.awq_search_scales([w], x, 64, True, n_grid=10)
    assert res.error <= res.rtn_error and res.alpha > 0
    rtn = int4.dequantize(int4.quantize_rtn(w, 64))
    awq = int4.dequantize(int4.quantize_rtn(w * res.scales, 64)) / res.scales
    ref = x_test @ w.t()
    e_rtn = (ref - x_test @ rtn.t()).square().sum()
    e_awq = (ref - x_test @ awq.t()).square().sum()
    assert e_awq < 0.8 * e_rtn, (float(e_awq), float(e_rtn))
