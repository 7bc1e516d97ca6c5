"""Rotary position embeddings; frequencies come from transformers' own rope functions so every
scaling type a config names (default, linear, llama3, yarn, ...) matches HF exactly."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.cpu import cpu_ops


def _rope_parameters(config, layer_type: str | None = None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:  # per layer type (Gemma 3: sliding_attention / full_attention)
        params = params[layer_type]
    if not params:  # transformers 4.x style
        scaling = getattr(config, "rope_scaling", None) or {}
        params = dict(scaling)
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(config, rotary_dim: int, layer_type: str | None = None
                     ) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r} (rope_parameters)")
    if layer_type is not None:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    else:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rope over the first ``rotary_dim`` dims of each head.

    cos/sin tables [max_pos, rotary_dim/2] fp32 are built once; positions index into them.
    """

    def __init__(self, config, rotary_dim: int, max_position: int, interleaved: bool = False,
                 layer_type: str | None = None):
        """``layer_type``: the key of ``config.rope_parameters`` to use when a model keeps one
        rope per kind of layer (Gemma 3's local and global layers)."""
        super().__init__()
        inv_freq, scaling = compute_inv_freq(config, rotary_dim, layer_type)
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.cos = freqs.cos() * scaling  # plain attributes: never on the meta device
        self.sin = freqs.sin() * scaling

    def rotate_qk_(self, positions: torch.Tensor, qkv: torch.Tensor, nheads: int,
                   head_dim: int) -> bool:
        """In place on a fused projection's output (fp32 [T, W] on CPU): heads [0, nheads)
        of each row -- q's then k's -- rotated (kvserve/csrc/cpu_ops.c; the same math as
        ``forward``). False, nothing done, where that kernel does not apply."""
        return cpu_ops.rope_qk_(qkv, positions, self.cos, self.sin, nheads, head_dim,
                                self.interleaved)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (any float dtype) -> rotated, fp32."""
        if self.cos.device != positions.device:  # first call on an accelerator
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rd/2]
        sin = self.sin[positions].unsqueeze(1)
        x = x.float()
        rd = self.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        if self.interleaved:  # pairs (x0,x1),(x2,x3)... (DeepSeek / GLM-style checkpoints)
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            out = torch.stack((o1, o2), dim=-1).flatten(-2)
        else:
            x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out
