"""INT4 models end to end: ``LLM(model=INT4_FOLDER)`` vs a dense twin.

The twin is an ordinary dense HF folder holding the dequantized weights, loaded by the same
engine, so any difference is the INT4 path itself. The tiny model is bf16, so scales are
exactly what the INT4 layer keeps (bf16), and both engines run fp32 activations. Tolerances:

* prompts >= 96 tokens run the dequant -> fp32 GEMM path: symmetric is exact (atol 1e-4);
  asymmetric folds the zero point into a bf16 offset (-zp * scale, what the CPU int4 op wants),
  ~2^-9 relative of that offset: atol 2e-2 on logits of magnitude ~4.
* short prompts (and decode) run the CPU int4 op with bf16 activations: |diff| <= 4% of the
  largest logit (8% with an FP8 KV cache), argmax equal up to near-ties within that.
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
from kvserve.layers.linear import Linear
from kvserve.model.loader import load_model
from kvserve.model.quant_config import parse_quant_config
from kvserve.quant import int4
from kvserve.quant.quantizer import quantize_checkpoint
from tests.conftest import make_tiny_model

# slow: INT4 and dense twin engines per model and group size
pytestmark = pytest.mark.slow

LONG = [1] + [(i * 37) % 500 + 3 for i in range(119)]  # 120 tokens: dequant path
SHORT = [1, 17, 33, 101, 5, 77, 250]  # 7 tokens: int4 op path
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")



def _make_bf16_tiny(path: str, arch: str = "llama") -> str:
    """Tiny random model, hidden 128 (GQA 4/2 heads), stored in bf16."""
    make_tiny_model(path, arch, hidden_size=128, intermediate_size=256, vocab_size=512)
    f = os.path.join(path, "model.safetensors")
    save_file({k: v.bfloat16().contiguous() for k, v in load_file(f).items()}, f,
              metadata={"format": "pt"})
    _edit_config(path, lambda c: c.update(dtype="bfloat16", torch_dtype="bfloat16"))
    return path


@pytest.fixture(scope="module")
def bf16_tiny(tmp_path_factory) -> str:
    return _make_bf16_tiny(str(tmp_path_factory.mktemp("tiny128")))


def _edit_config(path: str, fn) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    fn(cfg)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def _write_twin(src: str, out: str, replace: dict[str, torch.Tensor]) -> str:
    """Dense HF folder: ``src``'s files with ``replace`` (name -> dense weight) applied."""
    shutil.copytree(src, out)
    sd = load_file(os.path.join(src, "model.safetensors"))
    sd.update(replace)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _ct_twin(qdir: str, src: str, out: str, modules, group_size: int) -> str:
    sd = load_file(os.path.join(qdir, "model.safetensors"))
    dense = {}
    for m in modules:
        w = int4.from_compressed_tensors(
            sd[f"{m}.weight_packed"], sd[f"{m}.weight_scale"], sd[f"{m}.weight_shape"],
            sd.get(f"{m}.weight_zero_point"), None if group_size == -1 else group_size)
        dense[f"{m}.weight"] = int4.dequantize(w)  # fp32
    return _write_twin(src, out, dense)


def _compare(a, b, symmetric: bool) -> None:
    """INT4 engine ``a`` vs dense twin ``b`` on the long (dequant) and short (op) prompts."""
    la, lb = a.engine.prompt_logits(LONG), b.engine.prompt_logits(LONG)
    torch.testing.assert_close(la, lb, atol=1e-4 if symmetric else 2e-2, rtol=0)
    la, lb = a.engine.prompt_logits(SHORT), b.engine.prompt_logits(SHORT)
    _close_op_path(la, lb, 0.04)


def _close_op_path(la: torch.Tensor, lb: torch.Tensor, rel: float) -> None:
    """|la - lb| <= rel * max|lb|, and la's argmax is lb's up to a near-tie within that."""
    tol = rel * float(lb.abs().max())
    assert (la - lb).abs().max() <= tol
    picked = lb.gather(1, la.argmax(-1, keepdim=True)).squeeze(1)
    assert (picked >= lb.max(-1).values - 2 * tol).all()


def _modules(llm) -> dict[str, torch.nn.Module]:
    return dict(llm.engine.model.named_modules())


# --------------------------------------------------------------------------- compressed-tensors


@pytest.mark.parametrize(("symmetric", "group_size"),
                         [(True, 32), (False, 32), (True, 64), (False, 128), (True, -1)])
def test_compressed_tensors_matches_dense_twin(bf16_tiny, tmp_path, make_llm, symmetric,
                                               group_size):
    qdir = str(tmp_path / "q")
    summary = quantize_checkpoint(bf16_tiny, qdir, group_size=group_size, symmetric=symmetric,
                                  progress=False)
    assert len(summary.quantized) == 14
    twin = _ct_twin(qdir, bf16_tiny, str(tmp_path / "twin"), summary.quantized, group_size)
    # FP8 KV off here, integrity on (default)
    a = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32")
    b = make_llm(twin, dtype="float32", kv_cache_dtype="fp32")
    mods = _modules(a)
    # one INT4 GEMM per fused module, lm_head (ignored) dense
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj",
                 "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
        assert isinstance(mods[name], Int4MergedLinear), name
        assert isinstance(mods[name].int4, Int4Linear), name
    assert mods["model.layers.0.self_attn.qkv_proj"].int4.out_features == 128 + 64 + 64
    assert isinstance(mods["lm_head"], Linear)  # ParallelLMHead (a Linear), dense
    # placeholders are gone once packed
    params = dict(a.engine.model.named_parameters())
    assert not any(n.endswith(("weight_packed", "weight_scale")) for n in params)
    _compare(a, b, symmetric)
    # decode through the INT4 op (KV leak check by the fixture)
    out = a.generate({"prompt_token_ids": SHORT}, SamplingParams(temperature=0, max_tokens=8,
                                                                 ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_qkv_bias_model(tmp_path, make_llm):
    """Qwen2 (q/k/v bias): the fused INT4 module loads the bias shards as a dense parameter."""
    src = _make_bf16_tiny(str(tmp_path / "qwen2"), "qwen2")
    qdir = str(tmp_path / "q")
    summary = quantize_checkpoint(src, qdir, group_size=32, progress=False)
    twin = _ct_twin(qdir, src, str(tmp_path / "twin"), summary.quantized, 32)
    a = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32")
    b = make_llm(twin, dtype="float32", kv_cache_dtype="fp32")
    qkv = _modules(a)["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv, Int4MergedLinear) and qkv.bias is not None
    ref = load_file(os.path.join(src, "model.safetensors"))
    assert torch.equal(qkv.bias, torch.cat([ref[f"model.layers.0.self_attn.{p}_proj.bias"]
                                            for p in "qkv"]).float())
    _compare(a, b, symmetric=True)


def test_fp8_kv_cache(bf16_tiny, tmp_path, make_llm):
    qdir = str(tmp_path / "q")
    summary = quantize_checkpoint(bf16_tiny, qdir, group_size=32, symmetric=True,
                                  progress=False)
    twin = _ct_twin(qdir, bf16_tiny, str(tmp_path / "twin"), summary.quantized, 32)
    a = make_llm(qdir, dtype="float32", kv_cache_dtype="fp8")
    b = make_llm(twin, dtype="float32", kv_cache_dtype="fp8")
    assert a.engine.kv_dtype == torch.float8_e4m3fn and a.engine.integrity is not None
    # exact weights on the dequant path: the FP8 cache sees identical K/V
    torch.testing.assert_close(a.engine.prompt_logits(LONG), b.engine.prompt_logits(LONG),
                               atol=1e-4, rtol=0)
    _close_op_path(a.engine.prompt_logits(SHORT), b.engine.prompt_logits(SHORT), 0.08)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_default_dtype_and_kv_just_work(bf16_tiny, tmp_path, make_llm, dtype):
    """``LLM(model=INT4_FOLDER)`` with the default dtype (fp32 activations on every CPU
    kind) or bf16 activations, integrity on, and an FP8 KV cache: close to the fp32 run of
    the same INT4 weights, and generates."""
    from kvserve.config import resolve_model_dtype

    qdir = str(tmp_path / "q")
    quantize_checkpoint(bf16_tiny, qdir, group_size=32, progress=False)
    llm = make_llm(qdir, kv_cache_dtype="fp8", dtype=dtype)
    ref = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32")
    assert llm.engine.model_config.dtype == resolve_model_dtype(dtype, torch.bfloat16, "cpu")
    assert llm.engine.integrity is not None
    for ids in (SHORT, LONG):
        _close_op_path(llm.engine.prompt_logits(ids), ref.engine.prompt_logits(ids), 0.15)
    outs = llm.generate(["w1 w2 w3", "w9"], SamplingParams(temperature=0, max_tokens=6,
                                                                  ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


# --------------------------------------------------------------------------- GPTQ


def _pack_rows(u: torch.Tensor) -> torch.Tensor:
    """Unsigned nibbles [R, C] (C % 8 == 0) -> int32 [R, C / 8], value c at bits 4 * (c % 8)."""
    r, c = u.shape
    words = (u.long().view(r, c // 8, 8) << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_module(w: torch.Tensor, group_size: int, sym: bool, fmt: str,
                 perm: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ tensors for dense ``w`` [out, in] (act-order: groups follow ``perm``) and the
    dense twin computed from the stored integers."""
    out_f, k = w.shape
    perm = perm if perm is not None else torch.arange(k)
    q = int4.quantize_rtn(w[:, perm].float(), group_size, sym, scale_dtype=torch.bfloat16)
    u = torch.empty(out_f, k, dtype=torch.long)
    u[:, perm] = q.values.long() + 8  # unsigned nibbles in the original column order
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // group_size
    if sym:
        zu = torch.full_like(q.scales, 8, dtype=torch.long)
    else:
        zu = q.zeros.long() + 8  # [out, ng] in [0, 15]
        if fmt == "gptq":  # v1 stores zero - 1: zero 0 is not representable
            zu = zu.clamp(min=1)
    scales = q.scales.t().contiguous()  # [ng, out], bf16 values
    stored = zu - 1 if fmt == "gptq" else zu
    tensors = {
        "qweight": _pack_rows(u.t().contiguous().view(k // 8, 8, out_f).permute(0, 2, 1)
                              .reshape(-1, 8)).view(k // 8, out_f),
        "qzeros": _pack_rows(stored.t().contiguous()),
        "scales": scales.half(),  # bf16-representable, exact in fp16
        "g_idx": g_idx.int(),
    }
    twin = (u - zu[:, g_idx]).float() * scales.float().t()[:, g_idx]
    return tensors, twin


def _make_gptq(src: str, out: str, group_size: int, sym: bool, fmt: str, act_order: bool,
               shared_perm: bool = True) -> dict[str, torch.Tensor]:
    """GPTQ folder from ``src``; returns the twin's dense weights (name -> tensor)."""
    sd = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    new, twin = {}, {}
    perms: dict[tuple[str, int], torch.Tensor] = {}
    for name in sorted(sd):
        module = name.removesuffix(".weight")
        if not module.endswith(QUANTIZED):
            new[name] = sd[name]
            continue
        w = sd[name]
        perm = None
        if act_order:
            # same input -> same Hessian order for q/k/v and for gate/up (as GPTQ produces)
            key = (module.rsplit(".", 1)[0] + ("" if shared_perm else module), w.shape[1])
            if key not in perms:
                perms[key] = torch.randperm(w.shape[1], generator=g)
            perm = perms[key]
        tensors, dense = _gptq_module(w, group_size, sym, fmt, perm)
        for suffix, t in tensors.items():
            new[f"{module}.{suffix}"] = t
        twin[name] = dense
    os.makedirs(out)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), out)
    save_file(new, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    _edit_config(out, lambda c: c.update(quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
        "sym": sym, "checkpoint_format": fmt, "lm_head": False, "damp_percent": 0.01,
        "true_sequential": True, "static_groups": False}))
    return twin


@pytest.mark.parametrize(("sym", "fmt", "act_order", "shared_perm"), [
    (True, "gptq", True, True),
    (False, "gptq_v2", True, True),
    (False, "gptq", False, True),
    (True, "gptq_v2", True, False),  # q/k/v with different g_idx: one Int4Linear per shard
])
def test_gptq_matches_dense_twin(bf16_tiny, tmp_path, make_llm, sym, fmt, act_order,
                                 shared_perm):
    qdir = str(tmp_path / "gptq")
    twin_w = _make_gptq(bf16_tiny, qdir, 32, sym, fmt, act_order, shared_perm)
    twin = _write_twin(bf16_tiny, str(tmp_path / "twin"), twin_w)
    a = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32")
    b = make_llm(twin, dtype="float32", kv_cache_dtype="fp32")
    qkv = _modules(a)["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv, Int4MergedLinear)
    if shared_perm:
        assert isinstance(qkv.int4, Int4Linear)
        assert (qkv.int4.perm is not None) == act_order
    else:
        assert isinstance(qkv.int4, torch.nn.ModuleList) and len(qkv.int4) == 3
    _compare(a, b, sym)


# --------------------------------------------------------------------------- errors, matching


UNSUPPORTED = {
    "8-bit": {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}},
    "fp8": {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}}}},
    "W4A8": {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                 "input_activations": {"num_bits": 8, "type": "int"}}}},
    "marlin-24": {"quant_method": "compressed-tensors", "format": "marlin-24",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
    "bits=8": {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True},
    "marlin": {"quant_method": "gptq", "bits": 4, "group_size": 128,
               "checkpoint_format": "marlin"},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
}


@pytest.mark.parametrize("scheme", list(UNSUPPORTED))
def test_unsupported_scheme_named(bf16_tiny, tmp_path, scheme):
    path = str(tmp_path / "m")
    shutil.copytree(bf16_tiny, path)
    _edit_config(path, lambda c: c.update(quantization_config=UNSUPPORTED[scheme]))
    with pytest.raises(ValueError, match=f"unsupported quantization scheme.*{scheme}"):
        load_model(path, progress=False)


def test_matching_like_compressed_tensors():
    qc = parse_quant_config({
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*layers\\.1\\..*down_proj$"],
        "config_groups": {
            "g_class": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}},
            "g_regex": {"targets": ["re:.*mlp\\..*"], "weights": {
                "num_bits": 4, "type": "int", "strategy": "group", "group_size": 64,
                "symmetric": False}},
            "g_name": {"targets": ["model.layers.0.mlp.down_proj"], "weights": {
                "num_bits": 4, "type": "int", "strategy": "channel"}},
        }})
    assert qc is not None
    assert qc.scheme_for("lm_head") is None
    assert qc.scheme_for("model.layers.1.mlp.down_proj") is None  # regex ignore
    assert qc.scheme_for("model.layers.0.self_attn.q_proj").group_size == 128  # class
    up = qc.scheme_for("model.layers.0.mlp.up_proj")
    assert (up.group_size, up.symmetric) == (64, False)  # regex beats class
    assert qc.scheme_for("model.layers.0.mlp.down_proj").group_size == -1  # name beats regex
    assert parse_quant_config(None) is None


def test_gptq_config_rules():
    qc = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 128,
                             "desc_act": True, "sym": True,
                             "dynamic": {"-:.*layers\\.1\\.mlp\\..*": {},
                                         "+:.*layers\\.0\\.mlp\\..*": {"group_size": 32}}})
    assert qc is not None
    assert qc.scheme_for("lm_head") is None
    assert qc.scheme_for("model.layers.1.mlp.up_proj") is None
    assert qc.scheme_for("model.layers.0.mlp.up_proj").group_size == 32
    s = qc.scheme_for("model.layers.1.self_attn.o_proj")
    assert (s.group_size, s.act_order, s.required_tensors()) == (128, True,
                                                                 ("qweight", "scales", "g_idx"))
    with pytest.raises(ValueError, match="bits"):
        parse_quant_config({"quant_method": "gptq", "bits": 4,
                            "dynamic": {"+:.*down.*": {"bits": 8}}})


def test_ignore_regex_keeps_module_dense(bf16_tiny, tmp_path, make_llm):
    """A down_proj written dense and listed as ``re:`` in ``ignore`` loads dense."""
    qdir = str(tmp_path / "q")
    summary = quantize_checkpoint(bf16_tiny, qdir, group_size=32, progress=False)
    f = os.path.join(qdir, "model.safetensors")
    sd, src = load_file(f), load_file(os.path.join(bf16_tiny, "model.safetensors"))
    for m in [m for m in summary.quantized if m.endswith("down_proj")]:
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            del sd[f"{m}.{suffix}"]
        sd[f"{m}.weight"] = src[f"{m}.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    _edit_config(qdir, lambda c: c["quantization_config"]["ignore"].append("re:.*down_proj$"))
    llm = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32")
    mods = _modules(llm)
    assert isinstance(mods["model.layers.1.mlp.down_proj"], Linear)
    assert isinstance(mods["model.layers.1.mlp.gate_up_proj"], Int4MergedLinear)
    assert torch.isfinite(llm.engine.prompt_logits(SHORT)).all()


def test_errors_name_the_tensor_or_module(bf16_tiny, tmp_path):
    qdir = str(tmp_path / "q")
    quantize_checkpoint(bf16_tiny, qdir, group_size=32, progress=False)
    f = os.path.join(qdir, "model.safetensors")
    sd = load_file(f)

    missing = str(tmp_path / "missing")
    shutil.copytree(qdir, missing)
    save_file({k: v for k, v in sd.items()
               if k != "model.layers.1.self_attn.k_proj.weight_scale"},
              os.path.join(missing, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight_scale"):
        load_model(missing, progress=False)

    # q_proj ignored but k/v quantized: the fused qkv GEMM cannot mix
    mixed = str(tmp_path / "mixed")
    shutil.copytree(qdir, mixed)
    _edit_config(mixed, lambda c: c["quantization_config"]["ignore"].append(
        "model.layers.0.self_attn.q_proj"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj"):
        load_model(mixed, progress=False)

    # packed tensors for a module the config keeps dense
    dense_cfg = str(tmp_path / "dense_cfg")
    shutil.copytree(qdir, dense_cfg)
    _edit_config(dense_cfg, lambda c: c["quantization_config"]["ignore"].append(
        "model.layers.1.mlp.down_proj"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_"):
        load_model(dense_cfg, progress=False)

    # wrong shape in a shard names the checkpoint module
    bad = str(tmp_path / "bad")
    shutil.copytree(qdir, bad)
    sd2 = dict(sd)
    sd2["model.layers.0.self_attn.v_proj.weight_shape"] = torch.tensor([64, 136])
    save_file(sd2, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_proj"):
        load_model(bad, progress=False)


# --------------------------------------------------------------------------- transformers, CLI


def test_transformers_loads_our_output(bf16_tiny, tmp_path, make_llm):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    qdir = str(tmp_path / "q")
    quantize_checkpoint(bf16_tiny, qdir, group_size=32, symmetric=True, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([LONG])).logits[0].float()
    ours = make_llm(qdir, dtype="float32", kv_cache_dtype="fp32").engine.prompt_logits(LONG)
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)


def test_cli_quantize(bf16_tiny, tmp_path, capsys, make_llm):
    from kvserve.cli import main

    out = str(tmp_path / "q")
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{(i * 37) % 120}" for i in range(200)))
    rc = main(["quantize", "--model", bf16_tiny, "--out", out, "--weights", "int4",
               "--group-size", "64", "--asymmetric", "--calibration", str(calib),
               "--no-progress", "--json", str(tmp_path / "s.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "quantized 14 linear modules to int4 (group 64, asymmetric, AWQ)" in text
    assert "checkpoint size:" in text
    with open(tmp_path / "s.json") as f:
        report = json.load(f)
    qb = report["quantized_weight_bytes"]
    assert qb["after"] < qb["before"] / 3  # bf16 -> 4 bits + scales/zeros per 64
    assert report["checkpoint_bytes"]["after"] < report["checkpoint_bytes"]["before"]
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 64
    llm = make_llm(out)
    assert torch.isfinite(llm.engine.prompt_logits(SHORT)).all()
    # user errors name the flag
    assert main(["quantize", "--model", bf16_tiny, "--out", out, "--no-progress"]) == 2
    assert "--out" in capsys.readouterr().err
