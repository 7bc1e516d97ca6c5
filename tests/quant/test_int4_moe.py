"""INT4 MoE experts end to end (issue #7): tiny random Qwen3-MoE / DeepSeek-V3 / Kimi K2 models.

The twin is the same dense HF folder with every quantized weight replaced by its dequantized
INT4 values, loaded by the same engine, so differences are the INT4 path itself. Models are
stored in bf16 (scales exact in the bf16 the INT4 layer keeps) and run with fp32 activations.

* "exact" runs force every ``Int4Linear`` onto its dequantize -> fp32 GEMM path
  (``dequant_min_m = 1``, and ``gemv_max_m = 0`` where that C path exists): routed experts see
  only a few rows each, so by default they run the CPU int4 op (bf16 activations).
  Symmetric: logits within 1e-4 of the twin, greedy tokens identical. Asymmetric: the op
  layout's bf16 zero offset, atol 2e-2.
* default runs (int4 op, bf16 activations): within 4% of the largest logit at every
  position whose expert routing matches the twin's; at most 2 of 100 positions may route
  differently (a near-tied top-k choice flipped by bf16 rounding; see ``_compare_routed``).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import SamplingParams
from kvserve.layers.int4.linear import Int4Linear
from kvserve.layers.int4.merged import Int4MergedLinear
from kvserve.layers.int4.methods import CpuPackMethod
from kvserve.layers.int4.moe import Int4FusedMoE
from kvserve.layers.linear import Linear, MergedLinear
from kvserve.layers.moe import FusedMoE, TopKRouter
from kvserve.model.loader import load_model
from kvserve.quant import int4
from kvserve.quant.quantizer import quantize_checkpoint
from tests.model.test_moe_mla import make_tiny_moe
from tests.quant.test_int4_model import _close_op_path, _edit_config, _gptq_module

# slow: INT4 MoE models and their dense twins through engines
pytestmark = pytest.mark.slow

LONG = [1] + [(i * 37) % 500 + 3 for i in range(99)]  # 100 tokens
SHORT = [1, 17, 33, 101, 5, 77, 250]
PROMPTS = [[1, 17, 33, 101, 5], [1, 9], list(range(1, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# a layer with routed experts, per model
SPARSE_LAYER = {"qwen3_moe": 0, "glm4_moe": 1, "deepseek_v3": 1, "kimi_k2": 0}



@pytest.fixture(scope="module")
def moe_bf16(tmp_path_factory):
    """name -> tiny MoE folder (tests/model/test_moe_mla.py ARCHS) stored in bf16."""
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            path = make_tiny_moe(str(tmp_path_factory.mktemp(name)), name)
            f = os.path.join(path, "model.safetensors")
            save_file({k: v.bfloat16().contiguous() for k, v in load_file(f).items()}, f,
                      metadata={"format": "pt"})
            _edit_config(path, lambda c: c.update(dtype="bfloat16", torch_dtype="bfloat16"))
            cache[name] = path
        return cache[name]

    return get


def _twin(src: str, out: str, dense: dict[str, torch.Tensor]) -> str:
    """``src`` with ``dense`` (name -> weight) replacing its tensors."""
    shutil.copytree(src, out)
    f = os.path.join(out, "model.safetensors")
    sd = load_file(f)
    sd.update(dense)
    save_file({k: v.contiguous() for k, v in sd.items()}, f, metadata={"format": "pt"})
    return out


def _ct_dequantized(qdir: str, modules, group_size: int) -> dict[str, torch.Tensor]:
    sd = load_file(os.path.join(qdir, "model.safetensors"))
    return {f"{m}.weight": int4.dequantize(int4.from_compressed_tensors(
        sd[f"{m}.weight_packed"], sd[f"{m}.weight_scale"], sd[f"{m}.weight_shape"],
        sd.get(f"{m}.weight_zero_point"), group_size)) for m in modules}


def _exact(llm):
    """Every Int4Linear on the dequantize -> fp32 GEMM path (see module docstring)."""
    n = 0
    for m in llm.engine.model.modules():
        if isinstance(m, Int4Linear):
            if isinstance(m.method, CpuPackMethod):  # the other CPU methods dequantize anyway
                m.method.dequant_min_m, m.method.gemv_max_m = 1, 0  # (the C GEMM goes first)
            n += 1
    assert n > 0
    return llm


def _routing_log(llm) -> tuple[list[torch.Tensor], list]:
    """Hooks recording every router's chosen experts (sorted ids [T, k]) per call."""
    log: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: log.append(out[1].sort(-1).values))
             for m in llm.engine.model.modules() if isinstance(m, TopKRouter)]
    return log, hooks


def _compare_routed(a, b, ids: list[int], *, rel: float | None = None,
                    atol: float | None = None, max_flips: int = 2) -> None:
    """INT4 engine ``a`` vs dense twin ``b`` on one prompt, position by position.

    Routing is a discrete top-k: activation rounding (the int4 op runs bf16) can flip a near-
    tied expert choice at a position, which changes that position's logits by O(1) -- a real
    but expected effect, not a kernel error. So: at most ``max_flips`` positions may route
    differently in some MoE layer (measured: 0-1 of 100), and every other position must
    agree within ``atol`` or ``rel`` * max|logit| (then also argmax up to near-ties).
    """
    log_a, hooks_a = _routing_log(a)
    log_b, hooks_b = _routing_log(b)
    try:
        la, lb = a.engine.prompt_logits(ids), b.engine.prompt_logits(ids)
    finally:
        for h in hooks_a + hooks_b:
            h.remove()
    assert len(log_a) == len(log_b) > 0
    flipped = torch.zeros(len(ids), dtype=torch.bool)
    for x, y in zip(log_a, log_b, strict=True):
        assert x.shape == y.shape and x.shape[0] == len(ids)  # one prefill step per router
        flipped |= (x != y).any(-1)
    assert int(flipped.sum()) <= max_flips, f"routing differs at {flipped.nonzero().tolist()}"
    keep = ~flipped
    if rel is not None:
        _close_op_path(la[keep], lb[keep], rel)
    else:
        torch.testing.assert_close(la[keep], lb[keep], atol=atol, rtol=0)


def _greedy(llm, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def _mods(llm) -> dict[str, torch.nn.Module]:
    return dict(llm.engine.model.named_modules())


# --------------------------------------------------------------------------- our quantizer


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_quantized_moe_matches_dense_twin(moe_bf16, tmp_path, make_llm, name):
    src = moe_bf16(name)
    qdir = str(tmp_path / "q")
    summary = quantize_checkpoint(src, qdir, group_size=32, symmetric=True, progress=False)
    layer = SPARSE_LAYER[name]
    experts = [m for m in summary.quantized if ".experts." in m]
    assert len(experts) == 2 * 8 * 3  # 2 sparse layers x 8 experts x gate/up/down
    assert f"model.layers.{layer}.mlp.gate" in summary.ignore  # router stays dense
    sd = load_file(os.path.join(qdir, "model.safetensors"))
    assert f"model.layers.{layer}.mlp.experts.7.down_proj.weight_packed" in sd
    assert f"model.layers.{layer}.mlp.gate.weight" in sd
    twin = _twin(src, str(tmp_path / "twin"), _ct_dequantized(qdir, summary.quantized, 32))

    a = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32")
    b = make_llm(twin, dtype="float32", kv_cache_dtype="fp32")
    mods = _mods(a)
    moe = mods[f"model.layers.{layer}.mlp.experts"]
    assert isinstance(moe, Int4FusedMoE) and len(moe) == 8
    for e in (0, 7):
        gu = mods[f"model.layers.{layer}.mlp.experts.{e}.gate_up_proj"]
        down = mods[f"model.layers.{layer}.mlp.experts.{e}.down_proj"]
        assert isinstance(gu, Int4MergedLinear) and isinstance(gu.int4, Int4Linear)
        assert (gu.int4.out_features, gu.int4.in_features) == (64, 64)  # gate+up fused
        assert isinstance(down, Int4MergedLinear) and down.int4.out_features == 64
    assert isinstance(_mods(b)[f"model.layers.{layer}.mlp.experts"], FusedMoE)  # dense twin
    dense_bytes = 8 * 3 * 32 * 64 * 4  # fp32 expert weights of one layer
    assert moe.weight_bytes() < dense_bytes / 4
    if name != "qwen3_moe":  # shared experts are quantized too
        assert isinstance(mods["model.layers.1.mlp.shared_experts.gate_up_proj"],
                          Int4MergedLinear)
    if name == "deepseek_v3":  # MLA's latent projections are not quantizer targets
        assert isinstance(mods["model.layers.1.self_attn.kv_b_proj"], Linear)
        assert isinstance(mods["model.layers.1.self_attn.o_proj"], Int4MergedLinear)
    params = dict(a.engine.model.named_parameters())
    assert not any(n.endswith(("weight_packed", "weight_scale")) for n in params)

    # default compute paths (int4 op for the few rows each expert sees)
    _compare_routed(a, b, SHORT, rel=0.04, max_flips=0)
    _compare_routed(a, b, LONG, rel=0.04)
    # exact path: same logits, same greedy tokens
    _exact(a)
    for ids in (SHORT, LONG):
        torch.testing.assert_close(a.engine.prompt_logits(ids), b.engine.prompt_logits(ids),
                                   atol=1e-4, rtol=0)
    assert _greedy(a) == _greedy(b)


def test_only_routed_experts_run(moe_bf16, tmp_path, make_llm):
    """One token through a sparse layer runs exactly its top-k experts' INT4 modules."""
    src = moe_bf16("qwen3_moe")
    qdir = str(tmp_path / "q")
    quantize_checkpoint(src, qdir, group_size=32, progress=False)
    llm = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32")
    moe = _mods(llm)["model.layers.0.mlp.experts"]
    calls: list[tuple[int, int]] = []
    hooks = [moe[e].gate_up_proj.register_forward_hook(
        lambda _m, args, _out, e=e: calls.append((e, args[0].shape[0]))) for e in range(8)]
    llm.engine.prompt_logits([1])
    for h in hooks:
        h.remove()
    assert len(calls) == 2 and len({e for e, _ in calls}) == 2  # top_k 2, one row each
    assert all(n == 1 for _, n in calls)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_fp8_kv_and_integrity(moe_bf16, tmp_path, make_llm, name):
    src = moe_bf16(name)
    qdir = str(tmp_path / "q")
    summary = quantize_checkpoint(src, qdir, group_size=32, progress=False)
    twin = _twin(src, str(tmp_path / "twin"), _ct_dequantized(qdir, summary.quantized, 32))
    a = make_llm(qdir, dtype="float32", kv_cache_dtype="fp8")
    b = make_llm(twin, dtype="float32", kv_cache_dtype="fp8")
    assert a.engine.kv_cache.is_fp8 and a.engine.integrity is not None
    _compare_routed(a, b, SHORT, rel=0.08, max_flips=0)
    _exact(a)
    torch.testing.assert_close(a.engine.prompt_logits(LONG), b.engine.prompt_logits(LONG),
                               atol=1e-4, rtol=0)
    assert _greedy(a) == _greedy(b)


def test_experts_only_kimi_style(moe_bf16, tmp_path, make_llm):
    """``experts_only`` (Kimi K2 Thinking layout): routed experts INT4, everything else dense;
    the same folder with a Kimi-style regex ``ignore`` list instead of exact names loads to
    the same model."""
    src = moe_bf16("kimi_k2")
    qdir = str(tmp_path / "q")
    summary = quantize_checkpoint(src, qdir, group_size=32, progress=False, experts_only=True)
    assert summary.quantized and all(".mlp.experts." in m for m in summary.quantized)
    assert len(summary.quantized) == 2 * 8 * 3
    for kept in ("model.layers.0.mlp.gate", "model.layers.0.mlp.shared_experts.gate_proj",
                 "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj"):
        assert kept in summary.ignore, kept
    twin = _twin(src, str(tmp_path / "twin"), _ct_dequantized(qdir, summary.quantized, 32))
    a = _exact(make_llm(qdir, dtype="float32", kv_cache_dtype="fp32"))
    mods = _mods(a)
    assert isinstance(mods["model.layers.1.mlp.experts"], Int4FusedMoE)
    assert isinstance(mods["model.layers.1.mlp.shared_experts.gate_up_proj"], MergedLinear)
    assert isinstance(mods["model.layers.1.self_attn.o_proj"], Linear)
    ref = make_llm(twin, dtype="float32", kv_cache_dtype="fp32").engine.prompt_logits(LONG)
    torch.testing.assert_close(a.engine.prompt_logits(LONG), ref, atol=1e-4, rtol=0)

    kimi = str(tmp_path / "kimi_ignore")
    shutil.copytree(qdir, kimi)
    _edit_config(kimi, lambda c: c["quantization_config"].update(ignore=[
        "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]))
    k = _exact(make_llm(kimi, dtype="float32", kv_cache_dtype="fp32"))
    torch.testing.assert_close(k.engine.prompt_logits(LONG), ref, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- hand-built folders


def _hand_built(src: str, out: str, experts_to: dict[str, torch.Tensor], qc: dict) -> None:
    """``src`` with each routed expert weight replaced by ``experts_to`` tensors."""
    shutil.copytree(src, out)
    f = os.path.join(out, "model.safetensors")
    sd = {k: v for k, v in load_file(f).items() if ".mlp.experts." not in k}
    sd.update(experts_to)
    save_file(sd, f, metadata={"format": "pt"})
    _edit_config(out, lambda c: c.update(quantization_config=qc))


def _expert_weights(src: str) -> dict[str, torch.Tensor]:
    sd = load_file(os.path.join(src, "model.safetensors"))
    return {k.removesuffix(".weight"): v for k, v in sd.items() if ".mlp.experts." in k}


def test_hand_built_compressed_tensors_asymmetric_group32(moe_bf16, tmp_path, make_llm):
    """llm-compressor style: a config group targeting the experts only (regex), asymmetric
    group 32 with packed zero points; everything else dense without an ignore list."""
    src = moe_bf16("qwen3_moe")
    tensors, dense = {}, {}
    for m, w in _expert_weights(src).items():
        q = int4.quantize_rtn(w.float(), 32, symmetric=False, scale_dtype=torch.bfloat16)
        assert q.zeros is not None and q.zeros.abs().sum() > 0
        tensors.update({f"{m}.{k}": v for k, v in int4.to_compressed_tensors(q).items()})
        dense[f"{m}.weight"] = int4.dequantize(q)
    qdir = str(tmp_path / "ct")
    _hand_built(src, qdir, tensors, {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": [],
        "config_groups": {"experts": {"targets": ["re:.*mlp\\.experts\\.\\d+\\..*"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
            "symmetric": False, "actorder": None, "dynamic": False}}}})
    twin = _twin(src, str(tmp_path / "twin"), dense)
    a = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32")
    b = make_llm(twin, dtype="float32", kv_cache_dtype="fp32")
    mods = _mods(a)
    gu = mods["model.layers.2.mlp.experts.3.gate_up_proj"]
    assert isinstance(gu, Int4MergedLinear) and gu.scheme.describe() == (
        "int4 pack-quantized group 32 asym")
    assert isinstance(mods["model.layers.2.self_attn.qkv_proj"], MergedLinear)
    assert isinstance(mods["model.layers.1.mlp.gate_up_proj"], MergedLinear)  # dense MLP layer
    _compare_routed(a, b, SHORT, rel=0.04, max_flips=0)
    _exact(a)
    _compare_routed(a, b, LONG, atol=2e-2)


@pytest.mark.parametrize(("name", "sym", "fmt", "act_order"), [
    ("qwen3_moe", True, "gptq", True),
    ("qwen3_moe", False, "gptq", False),
    ("deepseek_v3", False, "gptq_v2", True),
])
def test_gptq_experts(moe_bf16, tmp_path, make_llm, name, sym, fmt, act_order):
    """GPTQ (auto-gptq / GPTQModel layout): every linear in a block quantized, experts
    included. DeepSeek-V3: kv_b_proj loads INT4 and is dequantized for MLA absorption;
    q_b_proj (in 48, not a multiple of the group) is kept dense by a ``dynamic`` rule."""
    src = moe_bf16(name)
    sd = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    new, dense = {}, {}
    perms: dict[str, torch.Tensor] = {}
    for key in sorted(sd):
        module = key.removesuffix(".weight")
        w = sd[key]
        if (not key.endswith(".weight") or w.dim() != 2 or ".layers." not in key
                or "layernorm" in key or module.endswith((".mlp.gate", "q_b_proj"))):
            new[key] = w
            continue
        perm = None
        if act_order:  # gate/up (and q/k/v) share the input: one Hessian order, as GPTQ
            base = module.rsplit(".", 1)[0] + f":{w.shape[1]}"
            perm = perms.setdefault(base, torch.randperm(w.shape[1], generator=g))
        tensors, twin_w = _gptq_module(w, 32, sym, fmt, perm)
        new.update({f"{module}.{k}": v for k, v in tensors.items()})
        dense[key] = twin_w
    qdir = str(tmp_path / "gptq")
    shutil.copytree(src, qdir)
    save_file(new, os.path.join(qdir, "model.safetensors"), metadata={"format": "pt"})
    _edit_config(qdir, lambda c: c.update(quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": act_order, "sym": sym,
        "checkpoint_format": fmt, "lm_head": False, "dynamic": {"-:.*q_b_proj$": {}}}))
    twin = _twin(src, str(tmp_path / "twin"), dense)
    a = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32")
    b = make_llm(twin, dtype="float32", kv_cache_dtype="fp32")
    layer = SPARSE_LAYER[name]
    mods = _mods(a)
    gu = mods[f"model.layers.{layer}.mlp.experts.5.gate_up_proj"]
    assert isinstance(gu, Int4MergedLinear) and isinstance(gu.int4, Int4Linear)
    assert (gu.int4.perm is not None) == act_order
    if name == "deepseek_v3":
        assert isinstance(mods["model.layers.0.self_attn.kv_b_proj"], Linear)
        assert isinstance(mods["model.layers.0.self_attn.q_b_proj"], Linear)
        assert isinstance(mods["model.layers.0.self_attn.q_a_proj"], Int4MergedLinear)
    _exact(a)
    if sym:  # exact: no routing can differ
        torch.testing.assert_close(a.engine.prompt_logits(LONG), b.engine.prompt_logits(LONG),
                                   atol=1e-4, rtol=0)
    else:  # the op layout's bf16 zero offset: ~1e-3 noise, enough to flip a near-tied route
        _compare_routed(a, b, LONG, atol=2e-2)
    if sym:
        assert _greedy(a) == _greedy(b)


# --------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def quantized_qwen3(moe_bf16, tmp_path_factory) -> str:
    qdir = str(tmp_path_factory.mktemp("q3") / "q")
    quantize_checkpoint(moe_bf16("qwen3_moe"), qdir, group_size=32, progress=False)
    return qdir


def _variant(qdir: str, out: str, edit_sd=None, edit_qc=None) -> str:
    shutil.copytree(qdir, out)
    if edit_sd is not None:
        f = os.path.join(out, "model.safetensors")
        sd = load_file(f)
        edit_sd(sd)
        save_file(sd, f, metadata={"format": "pt"})
    if edit_qc is not None:
        _edit_config(out, lambda c: edit_qc(c["quantization_config"]))
    return out


def test_expert_errors_name_the_tensor(moe_bf16, quantized_qwen3, tmp_path):
    q, src = quantized_qwen3, load_file(os.path.join(moe_bf16("qwen3_moe"), "model.safetensors"))
    e3 = "model.layers.2.mlp.experts.3"

    def drop(sd):
        del sd[f"{e3}.up_proj.weight_scale"]
    with pytest.raises(ValueError, match=rf"{e3}\.up_proj\.weight_scale"):
        load_model(_variant(q, str(tmp_path / "missing"), drop), progress=False)

    def dense_expert(sd):
        for k in ("weight_packed", "weight_scale", "weight_shape"):
            del sd[f"{e3}.gate_proj.{k}"]
        sd[f"{e3}.gate_proj.weight"] = src[f"{e3}.gate_proj.weight"]
    with pytest.raises(ValueError, match=rf"{e3}\.gate_proj\.weight is a dense expert weight"):
        load_model(_variant(q, str(tmp_path / "dense"), dense_expert), progress=False)

    def bad_shape(sd):
        sd[f"{e3}.down_proj.weight_shape"] = torch.tensor([64, 40])
    with pytest.raises(ValueError, match=rf"{e3}\.down_proj \(int4 pack-quantized group 32"):
        load_model(_variant(q, str(tmp_path / "shape"), bad_shape), progress=False)

    # gate quantized, up kept dense: one fused GEMM cannot mix
    with pytest.raises(ValueError, match=rf"{e3}\.gate_up_proj"):
        load_model(_variant(q, str(tmp_path / "mix"), edit_qc=lambda qc: qc["ignore"].append(
            f"{e3}.up_proj")), progress=False)

    # packed expert tensors while the config keeps experts dense
    with pytest.raises(ValueError, match=r"experts\.\d+\.\w+_proj\.weight_\w+ is INT4"):
        load_model(_variant(q, str(tmp_path / "ign"), edit_qc=lambda qc: qc["ignore"].append(
            "re:.*experts.*")), progress=False)

    # a quantized router gate: never supported
    def int4_router(sd):
        w = sd.pop("model.layers.0.mlp.gate.weight")
        for k, v in int4.to_compressed_tensors(int4.quantize_rtn(w.float(), 32)).items():
            sd[f"model.layers.0.mlp.gate.{k}"] = v
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate\.weight_\w+ is INT4"):
        load_model(_variant(q, str(tmp_path / "router"), int4_router), progress=False)


def test_ignored_expert_stays_dense_inside_an_int4_layer(moe_bf16, quantized_qwen3, tmp_path,
                                                         make_llm):
    """``ignore`` on one expert: it loads dense (stored ``.weight``) next to INT4 experts."""
    src = moe_bf16("qwen3_moe")
    ref = load_file(os.path.join(src, "model.safetensors"))
    e3 = "model.layers.2.mlp.experts.3"
    projs = ("gate_proj", "up_proj", "down_proj")

    def dense_expert(sd):
        for p in projs:
            for k in ("weight_packed", "weight_scale", "weight_shape"):
                del sd[f"{e3}.{p}.{k}"]
            sd[f"{e3}.{p}.weight"] = ref[f"{e3}.{p}.weight"]
    qdir = _variant(quantized_qwen3, str(tmp_path / "q"), dense_expert, lambda qc: qc[
        "ignore"].append("re:.*layers\\.2\\.mlp\\.experts\\.3\\..*"))
    sd = load_file(os.path.join(quantized_qwen3, "model.safetensors"))
    quantized = sorted({k.rsplit(".", 1)[0] for k in sd if k.endswith(".weight_packed")}
                       - {f"{e3}.{p}" for p in projs})
    twin = _twin(src, str(tmp_path / "twin"), _ct_dequantized(qdir, quantized, 32))
    a = _exact(make_llm(qdir, dtype="float32", kv_cache_dtype="fp32"))
    mods = _mods(a)
    assert isinstance(mods[f"{e3}.gate_up_proj"], MergedLinear)
    assert isinstance(mods[f"{e3}.down_proj"], Linear)
    assert isinstance(mods["model.layers.2.mlp.experts.4.gate_up_proj"], Int4MergedLinear)
    b = make_llm(twin, dtype="float32", kv_cache_dtype="fp32")
    torch.testing.assert_close(a.engine.prompt_logits(LONG), b.engine.prompt_logits(LONG),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize(("weights", "extra", "match"), [
    ({"num_bits": 8, "type": "int", "strategy": "channel"}, {}, "'experts'.*8-bit int"),
    ({"num_bits": 8, "type": "float", "strategy": "channel"}, {}, "'experts'.*fp8 weights"),
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
     {"input_activations": {"num_bits": 8, "type": "int"}}, "'experts'.*W4A8"),
    ({"num_bits": 4, "type": "int", "strategy": "block", "group_size": 32}, {},
     "'experts'.*strategy 'block'"),
])
def test_unsupported_expert_schemes(quantized_qwen3, tmp_path, weights, extra, match):
    def edit(qc):
        qc["config_groups"]["experts"] = {"targets": ["re:.*experts.*"], "weights": weights,
                                          **extra}
    path = _variant(quantized_qwen3, str(tmp_path / "m"), edit_qc=edit)
    with pytest.raises(ValueError, match=f"unsupported quantization scheme.*{match}"):
        load_model(path, progress=False)


# --------------------------------------------------------------------------- quantizer


def test_quantizer_splits_stacked_experts(tmp_path):
    """transformers 5.x in-memory layout (3-D ``experts.gate_up_proj`` / ``down_proj``) is
    written per expert with the standard compressed-tensors names."""
    src = tmp_path / "stacked"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 2 * 32, 64, generator=g)  # [E, 2I, hidden]
    down = torch.randn(3, 64, 32, generator=g)  # [E, hidden, I]
    save_file({"model.layers.0.mlp.experts.gate_up_proj": gate_up,
               "model.layers.0.mlp.experts.down_proj": down,
               "model.layers.0.mlp.gate.weight": torch.randn(3, 64, generator=g)},
              str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    summary = quantize_checkpoint(str(src), str(tmp_path / "out"), group_size=32,
                                  progress=False, experts_only=True)
    assert len(summary.quantized) == 9 and summary.ignore == ("lm_head", "model.layers.0.mlp.gate")
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" not in sd
    for e in range(3):
        for proj, w in (("gate_proj", gate_up[e, :32]), ("up_proj", gate_up[e, 32:]),
                        ("down_proj", down[e])):
            m = f"model.layers.0.mlp.experts.{e}.{proj}"
            q = int4.from_compressed_tensors(sd[f"{m}.weight_packed"], sd[f"{m}.weight_scale"],
                                             sd[f"{m}.weight_shape"], None, 32)
            assert torch.equal(q.values, int4.quantize_rtn(w, 32).values), m
    # group 64: down_proj (in 32) cannot be grouped, so its per-expert slices stay dense
    g64 = quantize_checkpoint(str(src), str(tmp_path / "g64"), group_size=64, progress=False,
                              experts_only=True)
    assert len(g64.quantized) == 6 and "model.layers.0.mlp.experts.2.down_proj" in g64.ignore
    sd = load_file(str(tmp_path / "g64" / "model.safetensors"))
    assert torch.equal(sd["model.layers.0.mlp.experts.2.down_proj.weight"], down[2])

    dense = tmp_path / "dense"
    dense.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.randn(64, 64)},
              str(dense / "model.safetensors"))
    (dense / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="experts_only.*no MoE expert weights"):
        quantize_checkpoint(str(dense), str(tmp_path / "x"), progress=False, experts_only=True)


def test_cli_experts_only(moe_bf16, tmp_path, capsys, make_llm):
    from kvserve.cli import main

    out = str(tmp_path / "q")
    rc = main(["quantize", "--model", moe_bf16("qwen3_moe"), "--out", out, "--group-size", "32",
               "--experts-only", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "quantized 48 linear modules to int4 (group 32, symmetric, RTN, MoE experts only)" \
        in text
    llm = make_llm(out)
    assert isinstance(_mods(llm)["model.layers.2.mlp.experts"], Int4FusedMoE)
    assert len(_greedy(llm, PROMPTS[:1])[0]) == GREEDY.max_tokens
    assert main(["quantize", "--model", moe_bf16("qwen3_moe"), "--out", str(tmp_path / "c"),
                 "--experts-only", "--calibration", out + "/config.json", "--no-progress"]) == 2
    assert "--experts-only" in capsys.readouterr().err
