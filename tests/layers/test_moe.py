"""MoE routing and expert dispatch (``kvserve.layers.moe``) against transformers' formulas and
a naive per-token loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.int4.moe import Int4FusedMoE
from kvserve.layers.moe import FusedMoE, TopKRouter, grouped_topk


def hf_deepseek_route(logits, bias, top_k, n_group, topk_group, norm, scale):
    """transformers' DeepseekV3TopkRouter.forward after the gate linear, verbatim."""
    n = logits.shape[-1]
    scores = logits.sigmoid()
    scores_for_choice = scores + bias
    group_scores = (scores_for_choice.view(-1, n_group, n // n_group).topk(2, dim=-1)[0]
                    .sum(dim=-1))
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(-1, n_group, n // n_group).reshape(-1, n))
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if norm:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    return topk_weights * scale, topk_indices


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _router(hidden, e, k, **kw) -> TopKRouter:
    r = TopKRouter(hidden, e, k, **kw)
    with torch.no_grad():
        r.weight.copy_(torch.randn(e, hidden) * 0.3)
        if r.e_score_correction_bias is not None:
            r.e_score_correction_bias.copy_(torch.rand(e) * 0.2)
    return r


@pytest.mark.parametrize("e,k,n_group,topk_group,norm,scale", [
    (16, 4, 4, 2, True, 2.5),    # DeepSeek-V3 shape, scaled down
    (256, 8, 8, 4, True, 2.5),   # DeepSeek-V3 real routing dims
    (8, 2, 1, 1, False, 1.7),    # Kimi K2 style: one group, un-normalized
    (8, 2, 2, 1, True, 1.0),     # GLM-4.5 style with grouping
])
def test_sigmoid_grouped_topk_matches_hf_formula(e, k, n_group, topk_group, norm, scale):
    torch.manual_seed(0)
    hidden, t = 32, 64
    r = _router(hidden, e, k, scoring="sigmoid", norm_topk_prob=norm,
                routed_scaling_factor=scale, n_group=n_group, topk_group=topk_group,
                correction_bias=True, fp32_weight=True)
    x = torch.randn(t, hidden)
    w, ids = r(x)
    logits = F.linear(x, r.weight)
    ref_w, ref_ids = hf_deepseek_route(logits, r.e_score_correction_bias, k, n_group,
                                       topk_group, norm, scale)
    w, ids = _sorted(w, ids)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-6)


def test_sigmoid_router_matches_transformers_module():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(1)
    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                           topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    hf = DeepseekV3TopkRouter(cfg)
    ours = _router(32, 16, 4, scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                   n_group=4, topk_group=2, correction_bias=True, fp32_weight=True)
    with torch.no_grad():
        hf.weight.copy_(ours.weight)
        hf.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    x = torch.randn(50, 32)
    _, ref_w, ref_ids = hf(x)
    w, ids = ours(x)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    w, ids = _sorted(w, ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)


def test_bias_changes_selection_only():
    torch.manual_seed(2)
    r = _router(16, 8, 2, scoring="sigmoid", norm_topk_prob=False, correction_bias=True,
                fp32_weight=True)
    x = torch.randn(40, 16)
    with torch.no_grad():
        r.e_score_correction_bias.zero_()
        r.e_score_correction_bias[3] = 10.0  # expert 3 always chosen ...
    w, ids = r(x)
    assert (ids == 3).any(-1).all()
    scores = torch.sigmoid(F.linear(x, r.weight))
    torch.testing.assert_close(w, scores.gather(1, ids))  # ... at its bias-free score


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_qwen3_moe(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(3)
    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=norm)
    hf = Qwen3MoeTopKRouter(cfg)
    ours = _router(32, 8, 2, scoring="softmax", norm_topk_prob=norm)
    with torch.no_grad():
        hf.weight.copy_(ours.weight)
    x = torch.randn(50, 32)
    _, ref_w, ref_ids = hf(x)
    w, ids = ours(x)
    assert torch.equal(ids, ref_ids)  # both sorted by score
    torch.testing.assert_close(w, ref_w)


def test_grouped_topk_never_picks_a_dropped_group():
    torch.manual_seed(4)
    choice = torch.rand(200, 32)
    ids = grouped_topk(choice, 4, n_group=8, topk_group=2)
    groups = ids // 4  # 4 experts per group
    assert all(len(set(g.tolist())) <= 2 for g in groups)


def _experts(e=6, hidden=16, inter=24) -> FusedMoE:
    m = FusedMoE(e, hidden, inter)
    with torch.no_grad():
        m.w13.copy_(torch.randn(e, 2 * inter, hidden) * 0.3)
        m.w2.copy_(torch.randn(e, hidden, inter) * 0.3)
    return m


def _naive(m: FusedMoE, x, w, ids):
    out = torch.zeros_like(x)
    i = m.intermediate
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gate = m.w13[e, :i] @ x[t]
            up = m.w13[e, i:] @ x[t]
            out[t] += w[t, s] * (m.w2[e] @ (F.silu(gate) * up))
    return out


def _routing(t, e, k):
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    return torch.rand(t, k), ids


def test_dispatch_matches_per_token_loop():
    torch.manual_seed(5)
    m = _experts()
    x = torch.randn(37, 16)
    w, ids = _routing(37, 6, 2)
    ids[:, 0] = torch.where(ids[:, 0] == 5, 0, ids[:, 0])  # expert 5 sees few tokens
    torch.testing.assert_close(m(x, w, ids), _naive(m, x, w, ids), atol=1e-5, rtol=1e-5)
    # a single token (decode) and an empty batch
    torch.testing.assert_close(m(x[:1], w[:1], ids[:1]), _naive(m, x[:1], w[:1], ids[:1]),
                               atol=1e-5, rtol=1e-5)
    assert m(x[:0], w[:0], ids[:0]).shape == (0, 16)


def test_expert_module_hook_replaces_dense_weights():
    torch.manual_seed(6)
    m = _experts()
    x = torch.randn(20, 16)
    w, ids = _routing(20, 6, 3)
    ref = m(x, w, ids)

    def linears(stacked):
        mods = nn.ModuleList()
        for we in stacked:
            lin = nn.Linear(we.shape[1], we.shape[0], bias=False)
            lin.weight.data.copy_(we)
            mods.append(lin)
        return mods

    w13, w2 = linears(m.w13), linears(m.w2)
    m.use_expert_modules(w13, w2)
    assert m.w13.numel() == 0 and m.w2.numel() == 0  # dense copies released
    torch.testing.assert_close(m(x, w, ids), ref, atol=1e-5, rtol=1e-5)


def test_int4_experts_through_the_hook():
    int4_linear = pytest.importorskip("kvserve.layers.int4.linear")
    torch.manual_seed(7)
    m = _experts(e=4, hidden=64, inter=64)
    x = torch.randn(12, 64)
    w, ids = _routing(12, 4, 2)
    w13 = int4_linear.int4_experts_from_dense(m.w13, group_size=32)
    w2 = int4_linear.int4_experts_from_dense(m.w2, group_size=32)
    deq = FusedMoE(4, 64, 64)  # the same experts with the dequantized (twin) weights
    with torch.no_grad():
        deq.w13.copy_(torch.stack([mod.dequantize() for mod in w13]))
        deq.w2.copy_(torch.stack([mod.dequantize() for mod in w2]))
    m.use_expert_modules(w13, w2)
    got, ref = m(x, w, ids), deq(x, w, ids)
    # the INT4 op may run its GEMM in bf16: compare as a relative error of the whole output
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def test_expert_loader_shards_and_shapes():
    m = FusedMoE(2, 4, 3)
    g, u, d = torch.randn(3, 4), torch.randn(3, 4), torch.randn(4, 3)
    m.w13.weight_loader(m.w13, g, (1, "gate"))
    m.w13.weight_loader(m.w13, u, (1, "up"))
    m.w2.weight_loader(m.w2, d, (1, "down"))
    assert torch.equal(m.w13[1], torch.cat((g, u))) and torch.equal(m.w2[1], d)
    assert not m.fully_loaded("w13")
    m.w13.weight_loader(m.w13, torch.randn(2, 6, 4), (None, "gate_up"))
    assert m.fully_loaded("w13")
    with pytest.raises(ValueError, match="expected"):
        m.w2.weight_loader(m.w2, torch.randn(3, 4), (0, "down"))
    with pytest.raises(ValueError, match="out of range"):
        m.w2.weight_loader(m.w2, d, (2, "down"))


def _int4_module(shards: dict[str | None, torch.Tensor], in_features: int, group: int):
    """An ``Int4MergedLinear`` fed through its weight loaders, as the model loader does, with
    compressed-tensors tensors of RTN-quantized ``shards``; returns it and the dense twin."""
    from kvserve.layers.int4.merged import Int4MergedLinear
    from kvserve.model.quant_config import Int4Scheme
    from kvserve.quant import int4

    ids = tuple(shards)
    mod = Int4MergedLinear(in_features, tuple(w.shape[0] for w in shards.values()), ids,
                           Int4Scheme("pack-quantized", group, True),
                           {s: f"experts.x.{s}_proj" for s in ids})
    twin = []
    for shard, w in shards.items():
        q = int4.quantize_rtn(w, group, scale_dtype=torch.bfloat16)  # exact in the op layout
        twin.append(int4.dequantize(q))
        for tname, t in int4.to_compressed_tensors(q).items():
            param = getattr(mod, tname)
            param.weight_loader(param, t, shard)
    assert mod.int4 is not None  # built as soon as every shard was in
    return mod, torch.cat(twin)


def test_int4_fused_moe_layer_matches_its_dequantized_twin():
    """``Int4FusedMoE``: per expert one Int4Linear for gate+up and one for down; only experts
    that received tokens run (each once, on its rows); a dense (ignored) expert mixes in."""
    from kvserve.layers.int4.linear import Int4Linear
    from kvserve.layers.int4.methods import CpuPackMethod

    torch.manual_seed(8)
    e_n, hidden, inter = 5, 64, 32
    dense = _experts(e=e_n, hidden=hidden, inter=inter)
    moe, twin = Int4FusedMoE(e_n, hidden, inter), FusedMoE(e_n, hidden, inter)
    for e in range(e_n):
        if e == 3:  # kept dense (e.g. listed in ignore): plain MergedLinear / Linear
            moe[e].gate_up_proj.weight.data.copy_(dense.w13[e])
            moe[e].down_proj.weight.data.copy_(dense.w2[e])
            twin.w13.data[e], twin.w2.data[e] = dense.w13[e], dense.w2[e]
            continue
        moe[e].gate_up_proj, w13 = _int4_module(
            {"gate": dense.w13[e, :inter], "up": dense.w13[e, inter:]}, hidden, 32)
        moe[e].down_proj, w2 = _int4_module({None: dense.w2[e]}, inter, 32)
        assert isinstance(moe[e].gate_up_proj.int4, Int4Linear)  # gate+up: one INT4 GEMM
        twin.w13.data[e], twin.w2.data[e] = w13, w2
    x = torch.randn(23, hidden)
    w, ids = _routing(23, e_n, 2)
    ids[ids == 4] = 0  # expert 4 receives no token
    calls: dict[int, list[int]] = {}
    for e in range(e_n):
        moe[e].gate_up_proj.register_forward_hook(
            lambda _m, args, _o, e=e: calls.setdefault(e, []).append(args[0].shape[0]))
    got = moe(x, w, ids)
    counts = torch.bincount(ids.flatten(), minlength=e_n)
    assert calls == {e: [int(counts[e])] for e in range(e_n) if counts[e] > 0}
    assert 4 not in calls
    ref = twin(x, w, ids)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2  # int4 op: bf16 activations
    for m in moe.modules():
        if isinstance(m, CpuPackMethod):  # dequant -> fp32 GEMM: the twin's arithmetic
            m.dequant_min_m, m.gemv_max_m = 1, 0  # (the C skinny GEMM goes first otherwise)
    torch.testing.assert_close(moe(x, w, ids), ref, atol=1e-5, rtol=1e-5)
    assert moe(x[:0], w[:0], ids[:0]).shape == (0, hidden)
    # bytes held: 4 INT4 experts (4-bit + a scale per 32) and one fp32 expert
    assert moe.weight_bytes() < 4 * 3 * inter * hidden * 0.6 + 3 * inter * hidden * 4 + 1024
