from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model.loader import load_model


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_named(tiny_llama, tmp_path):
    path = _copy(tiny_llama, str(tmp_path / "m"))
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FancyNetForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="FancyNetForCausalLM"):
        load_model(path, progress=False)


def test_missing_tensor_named(tiny_llama, tmp_path):
    path = _copy(tiny_llama, str(tmp_path / "m"))
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path, progress=False)


def test_sharded_checkpoint_loads_identically(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="20KB")
    for name in os.listdir(tiny_llama):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(tiny_llama, name), sharded)
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    a = load_model(tiny_llama, dtype="float32", progress=False).model
    b = load_model(sharded, dtype="float32", progress=False).model
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


def test_missing_shard_named(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="20KB")
    shard = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(sharded, shard))
    with pytest.raises(ValueError, match=shard):
        load_model(sharded, progress=False)


def test_fused_qkv_holds_the_shards(tiny_llama):
    model = load_model(tiny_llama, dtype="float32", progress=False).model
    sd = load_file(os.path.join(tiny_llama, "model.safetensors"))
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    ref = torch.cat([sd[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, ref)
