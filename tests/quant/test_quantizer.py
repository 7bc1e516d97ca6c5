"""quantize_checkpoint: output folder layout, config schema, and loading it back."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.layers.int4.linear import Int4Linear
from kvserve.quant import int4
from kvserve.quant.quantizer import _awq_overrides, is_target, quantize_checkpoint

CALIB = " ".join(f"w{(i * 37) % 120}" for i in range(300))


@pytest.fixture(scope="module")
def tiny(model_factory) -> str:
    return model_factory("llama", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)


def _ct(sd: dict[str, torch.Tensor], module: str, group_size: int) -> int4.Int4Weight:
    return int4.from_compressed_tensors(
        sd[f"{module}.weight_packed"], sd[f"{module}.weight_scale"],
        sd[f"{module}.weight_shape"], sd.get(f"{module}.weight_zero_point"), group_size)


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _nibble(word: int, j: int) -> int:
    return (word >> (4 * j)) & 0xF


def test_is_target() -> None:
    assert is_target("model.layers.3.self_attn.q_proj")
    assert is_target("model.layers.0.mlp.experts.7.down_proj")
    assert is_target("model.layers.0.block_sparse_moe.experts.1.w2")
    assert not is_target("lm_head")
    assert not is_target("model.layers.0.mlp.gate")
    assert not is_target("model.embed_tokens")


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_tiny_llama(tiny: str, tmp_path, symmetric: bool) -> None:
    out = str(tmp_path / "q")
    summary = quantize_checkpoint(tiny, out, group_size=32, symmetric=symmetric,
                                  progress=False)
    assert len(summary.quantized) == 2 * 7 and summary.ignore == ("lm_head",)
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files
    cfg = _json(os.path.join(out, "config.json"))
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"]) == \
        (4, "int", "group", 32, symmetric)
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert qc["ignore"] == ["lm_head"]

    src = load_file(os.path.join(tiny, "model.safetensors"))
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" in sd and "model.embed_tokens.weight" in sd
    assert torch.equal(sd["model.norm.weight"], src["model.norm.weight"])
    for module in summary.quantized:
        assert f"{module}.weight" not in sd
        dense = src[f"{module}.weight"]
        n, k = dense.shape
        packed = sd[f"{module}.weight_packed"]
        assert packed.dtype == torch.int32 and packed.shape == (n, math.ceil(k / 8))
        assert sd[f"{module}.weight_scale"].shape == (n, k // 32)
        assert sd[f"{module}.weight_shape"].tolist() == [n, k]
        if symmetric:
            assert f"{module}.weight_zero_point" not in sd
        else:
            assert sd[f"{module}.weight_zero_point"].shape == (math.ceil(n / 8), k // 32)
        q = _ct(sd, module, 32)
        deq = int4.dequantize(q)
        scale = sd[f"{module}.weight_scale"].float().repeat_interleave(32, 1)
        assert ((deq - dense).abs() <= scale * (1.0 if symmetric else 0.5) + 1e-6).all()

    # hand-check one packed word against the spec: nibble j of word c = round(w/s)[8c+j] + 8
    m = "model.layers.0.self_attn.q_proj"
    dense, s = src[f"{m}.weight"], sd[f"{m}.weight_scale"]
    z = (int4.unpack_int4(sd[f"{m}.weight_zero_point"], dense.shape[0], 0).float()
         if not symmetric else torch.zeros_like(s))
    word = int(sd[f"{m}.weight_packed"][3, 5])
    for j in range(8):
        col = 8 * 5 + j
        expect = round(float(dense[3, col] / s[3, col // 32]) + float(z[3, col // 32]))
        assert _nibble(word, j) == max(-8, min(7, expect)) + 8


def test_config_and_tensors_load_with_compressed_tensors(tiny: str, tmp_path) -> None:
    """Schema validated by compressed-tensors; its decompressor gives our weights (asym), and a
    transformers model loaded from the folder computes the same logits as ours (sym)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    for symmetric in (False, True):
        out = str(tmp_path / f"q{symmetric}")
        summary = quantize_checkpoint(tiny, out, group_size=32, symmetric=symmetric,
                                      progress=False)
        qc = _json(os.path.join(out, "config.json"))["quantization_config"]
        parsed = QuantizationConfig.model_validate(qc)
        scheme = parsed.config_groups["group_0"]
        sd = load_file(os.path.join(out, "model.safetensors"))
        for module in summary.quantized:
            part = {k.removeprefix(module + "."): v for k, v in sd.items()
                    if k.startswith(module + ".")}
            got = PackedQuantizationCompressor.decompress(part, scheme)["weight"]
            assert torch.equal(got.float(), int4.dequantize(_ct(sd, module, 32)))

    # symmetric folder (the last one) through transformers + compressed-tensors
    ids = torch.tensor([[1, 5, 9, 22, 7, 3]])
    hf = AutoModelForCausalLM.from_pretrained(out)
    ref = AutoModelForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        for module in summary.quantized:
            ref.get_submodule(module).weight.copy_(int4.dequantize(_ct(sd, module, 32)))
        assert torch.allclose(hf(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5)


def test_int4_linear_from_quantized_folder(tiny: str, tmp_path) -> None:
    out = str(tmp_path / "q")
    summary = quantize_checkpoint(tiny, out, group_size=32, symmetric=False, progress=False)
    sd = load_file(os.path.join(out, "model.safetensors"))
    m = summary.quantized[0]
    lin = Int4Linear(int4.from_compressed_tensors(
        sd[f"{m}.weight_packed"], sd[f"{m}.weight_scale"], sd[f"{m}.weight_shape"],
        sd[f"{m}.weight_zero_point"], group_size=32))
    x = torch.randn(4, lin.in_features)
    ref = x @ int4.dequantize(_ct(sd, m, 32)).t()
    assert torch.allclose(lin(x), ref, atol=2e-2 * float(ref.abs().max()))


def test_sharded_input_and_channelwise(tiny: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(sharded, max_shard_size="40KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    a = quantize_checkpoint(tiny, str(tmp_path / "a"), group_size=-1, progress=False)
    b = quantize_checkpoint(sharded, str(tmp_path / "b"), group_size=-1, progress=False)
    assert sorted(a.quantized) == sorted(b.quantized)
    sa = load_file(str(tmp_path / "a" / "model.safetensors"))
    sb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    w = _json(str(tmp_path / "a" / "config.json"))["quantization_config"]
    assert w["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert sa["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 1)


def test_moe_router_and_partial_group_stay_dense(tmp_path) -> None:
    """Hand-made checkpoint: experts quantized, router and a K % group != 0 target ignored."""
    src = tmp_path / "moe"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(16, 64, generator=g),
        "model.layers.0.mlp.gate.weight": torch.randn(4, 64, generator=g),
        "model.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(32, 64, generator=g),
        "model.layers.0.mlp.experts.1.down_proj.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 48, generator=g),
        "model.layers.0.input_layernorm.weight": torch.ones(64),
        "lm_head.weight": torch.randn(16, 64, generator=g),
    }
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    (src / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    summary = quantize_checkpoint(str(src), str(out), group_size=32, progress=False)
    assert set(summary.quantized) == {"model.layers.0.mlp.experts.0.gate_proj",
                                      "model.layers.0.mlp.experts.1.down_proj"}
    assert set(summary.ignore) == {"lm_head", "model.layers.0.mlp.gate",
                                   "model.layers.0.self_attn.o_proj"}
    sd = load_file(str(out / "model.safetensors"))
    assert torch.equal(sd["model.layers.0.self_attn.o_proj.weight"],
                       tensors["model.layers.0.self_attn.o_proj.weight"])
    assert (out / "tokenizer_config.json").exists()
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(str(out), str(tmp_path / "again"), progress=False)
    with pytest.raises(ValueError, match="group_size"):
        quantize_checkpoint(str(src), str(tmp_path / "bad"), group_size=0, progress=False)


def test_awq_calibration(tiny: str, tmp_path) -> None:
    """AWQ scales are folded exactly (the dense function is unchanged) and never lose to RTN."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    awq_dir, rtn_dir = str(tmp_path / "awq"), str(tmp_path / "rtn")
    summary = quantize_checkpoint(tiny, awq_dir, group_size=32, calibration_text=CALIB,
                                  progress=False)
    quantize_checkpoint(tiny, rtn_dir, group_size=32, progress=False)
    assert len(summary.awq) == 2 * 4  # attn, o (no GQA here), mlp, down per layer
    for res in summary.awq.values():
        assert res.error <= res.rtn_error

    ids = AutoTokenizer.from_pretrained(tiny)(CALIB, return_tensors="pt").input_ids[:, :128]

    def logits(folder: str) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(tiny)
        sd = load_file(os.path.join(folder, "model.safetensors"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                module = name.removesuffix(".weight")
                if f"{module}.weight_packed" in sd:
                    p.copy_(int4.dequantize(_ct(sd, module, 32)))
                elif name in sd:
                    p.copy_(sd[name])
            return model(input_ids=ids).logits

    ref = AutoModelForCausalLM.from_pretrained(tiny)(input_ids=ids).logits.detach()

    # folding alone (before rounding) preserves the function
    cfg = _json(os.path.join(tiny, "config.json"))
    folded, _ = _awq_overrides(tiny, cfg, CALIB, 32, True, False)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    params = dict(model.named_parameters())
    assert folded.keys() <= params.keys() and len(folded) == 2 * 9  # q k v ln1 o gate up ln2 down
    with torch.no_grad():
        for name, t in folded.items():
            params[name].copy_(t)
        assert torch.allclose(model(input_ids=ids).logits, ref, atol=1e-4)

    err_awq = (logits(awq_dir) - ref).square().mean()
    err_rtn = (logits(rtn_dir) - ref).square().mean()
    signal = ref.square().mean()
    print(f"logit MSE / signal: awq {err_awq / signal:.4f}, rtn {err_rtn / signal:.4f}")
    assert err_awq < 2 * err_rtn  # a random tiny model has no outliers for AWQ to fix
    assert err_awq < 0.1 * signal
