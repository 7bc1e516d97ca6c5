"""LoRA adapters for the Llama family: PEFT folders read and checked against the base model,
and the model's linears wrapped with adapter slots (kvserve.layers.lora).

A PEFT LoRA folder is ``adapter_config.json`` + ``adapter_model.safetensors`` (never a pickled
``.bin``: it is refused, not read). Its tensors are named
``base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight`` with
``lora_A`` [r, in] and ``lora_B`` [out, r] in the checkpoint's (HF) layout, the layout kvserve's
linears keep (GGUF q/k are un-permuted at load), so the adapter applies unchanged over dense,
INT4 or GGUF base weights. Every check raises ValueError naming what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.layers.lora import LoRALinear

# HF module -> (kvserve's linear, shard index in it)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                  r"lora_(A|B)\.weight")
# PEFT options kvserve does not implement: refused rather than served wrong
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none"}


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter, checked: (layer, HF module) -> (lora_A [r, in], lora_B [out, r]) fp32 on
    the host, its rank, scale and content digest (salts its sequences' block hashes)."""

    name: str
    path: str
    rank: int
    scale: float
    digest: bytes
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({m for _, m in self.weights}))


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """HF module -> (in_features, out_features) of the base model."""
    h = config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    return {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d),
            "o_proj": (heads * d, h), "gate_proj": (h, inter), "up_proj": (h, inter),
            "down_proj": (inter, h)}


def _config(path: str, param: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{param}: {path!r} has no adapter_config.json (not a PEFT adapter "
                         "folder)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{param}: adapter_config.json does not parse: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{param}: adapter_config.json is not a JSON object")
    return cfg


def read_adapter(name: str, path: str, config, max_rank: int,
                 param: str = "lora_path") -> LoRAAdapter:
    """Read and check the PEFT LoRA folder ``path`` against the base model's ``config``."""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"{param}: {path!r} is not a directory")
    cfg = _config(path, param)
    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st_path):
        extra = (" (adapter_model.bin is a pickle: kvserve does not read it; save with "
                 "safe_serialization=True)"
                 if os.path.isfile(os.path.join(path, "adapter_model.bin")) else "")
        raise ValueError(f"{param}: {path!r} has no adapter_model.safetensors{extra}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{param}: peft_type {cfg.get('peft_type')!r} is not LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{param}: adapter_config.json r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise ValueError(f"{param}: adapter rank {r} is over max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{param}: lora_alpha must be a number, got {alpha!r}")
    for key, want in _UNSUPPORTED.items():
        if cfg.get(key, want) not in (want, None):
            raise ValueError(f"{param}: {key}={cfg[key]!r} is not supported (only {want!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise ValueError(f"{param}: {key} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{param}: target_modules must name modules, got {targets!r}")
    bad = sorted(set(targets) - set(TARGETS))
    if bad:
        raise ValueError(f"{param}: target_modules {bad} are not supported (supported: "
                         f"{', '.join(TARGETS)})")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    weights = _read_tensors(st_path, config, r, set(targets), param)
    with open(st_path, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update(json.dumps(cfg, sort_keys=True).encode())
    return LoRAAdapter(name, path, r, float(scale), digest.digest(), weights)


def _read_tensors(st_path: str, config, r: int, targets: set[str],
                  param: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    shapes = module_shapes(config)
    layers = config.num_hidden_layers
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(st_path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _KEY.fullmatch(key.replace(".default.", "."))
                if m is None:
                    raise ValueError(f"{param}: unexpected tensor {key!r} in "
                                     "adapter_model.safetensors")
                layer, module, ab = int(m[1]), m[3], m[4]
                if module not in targets:
                    raise ValueError(f"{param}: tensor {key!r} is for {module}, not one of "
                                     f"target_modules")
                if layer >= layers:
                    raise ValueError(f"{param}: tensor {key!r}: the base model has {layers} "
                                     "layers")
                t = f.get_tensor(key)
                fan_in, fan_out = shapes[module]
                want = (r, fan_in) if ab == "A" else (fan_out, r)
                if tuple(t.shape) != want:
                    raise ValueError(f"{param}: {key} has shape {tuple(t.shape)}, the base "
                                     f"model needs {want} (rank {r}, {module} {fan_in} -> "
                                     f"{fan_out})")
                if not t.is_floating_point() or not torch.isfinite(t).all():
                    raise ValueError(f"{param}: {key} is not finite floating point")
                found.setdefault((layer, module), {})[ab] = t.float()
    except SafetensorError as e:
        raise ValueError(f"{param}: adapter_model.safetensors does not read: {e}") from None
    out = {}
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{param}: layer {layer} {module} has lora_{''.join(ab)} without "
                             f"its pair")
        out[layer, module] = (ab["A"], ab["B"])
    if not out:
        raise ValueError(f"{param}: adapter_model.safetensors holds no LoRA weights")
    return out


def check_lora_model(model: nn.Module, tp_size: int) -> None:
    """LoRA serving needs a Llama-family dense model on one rank (ValueError otherwise)."""
    from kvserve.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

    layers = getattr(getattr(model, "model", None), "layers", [])
    if not isinstance(model, LlamaForCausalLM) or not all(
            type(la) is LlamaDecoderLayer and isinstance(la.mlp, LlamaMLP) for la in layers):
        raise ValueError(f"enable_lora: LoRA adapters need a dense Llama-family model "
                         f"(Llama / Mistral / Qwen2 / Qwen3), not {type(model).__name__}")
    if tp_size != 1:
        raise ValueError("enable_lora: LoRA serving runs on one rank (tensor_parallel_size 1)")


def wrap_for_lora(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                  device: torch.device | str) -> dict[tuple[int, str], LoRALinear]:
    """Swap every target linear of every layer for a ``LoRALinear`` with ``max_loras`` empty
    slots; returns them by (layer, kvserve linear name)."""
    shapes = module_shapes(model.config)
    out: dict[tuple[int, str], LoRALinear] = {}
    fused: dict[str, list[str]] = {}
    for hf, (ours, _) in TARGETS.items():
        fused.setdefault(ours, []).append(hf)
    for i, layer in enumerate(model.model.layers):
        for ours, hfs in fused.items():
            parent_name, attr = ours.split(".")
            parent = getattr(layer, parent_name)
            base = getattr(parent, attr)
            wrapped = LoRALinear(base, shapes[hfs[0]][0], tuple(shapes[h][1] for h in hfs),
                                 max_loras, max_rank, dtype, device)
            setattr(parent, attr, wrapped)
            out[i, ours] = wrapped
    return out


def load_into_slot(wrapped: dict[tuple[int, str], LoRALinear], slot: int,
                   adapter: LoRAAdapter | None) -> None:
    """Write ``adapter`` into ``slot`` of every wrapped linear (None: clear the slot)."""
    per: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    if adapter is not None:
        for (layer, hf), ab in adapter.weights.items():
            ours, shard = TARGETS[hf]
            per.setdefault((layer, ours), {})[shard] = ab
    for key, lin in wrapped.items():
        shards = per.get(key, {})
        lin.set_slot(slot, shards, adapter.scale if adapter is not None and shards else 0.0)
