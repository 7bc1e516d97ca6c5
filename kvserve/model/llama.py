"""Llama-family decoder: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (qkv bias),
Qwen3ForCausalLM (per-head QK RMSNorm). Module names follow HF so checkpoints map 1:1, except
the fused ``qkv_proj`` / ``gate_up_proj`` (see ``packed_modules``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import get_tp_size
from kvserve.kernels.cpu import cpu_ops
from kvserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    kv_head_layout,
)
from kvserve.layers.lora import LoRAStep, with_lora
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, gather_logits
from kvserve.model.forward_batch import ForwardBatch
from kvserve.model.interface import CausalLMBase, KVSpec


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = d = head_dim_of(config)
        # Tensor parallel: this rank's query heads and KV heads (see QKVParallelLinear).
        self.qkv_proj = QKVParallelLinear(config.hidden_size, total_heads, total_kv, d,
                                          bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * d, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = with_lora(self.qkv_proj, x, batch.lora)
        # fp32 on CPU without QK norm: q and k rotated in place in one C call (then views)
        rotated = self.q_norm is None and self.rotary.rotate_qk_(batch.positions, qkv, h + hk, d)
        q, k, v = qkv.split((h * d, hk * d, hk * d), dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, hk, d), v.view(t, hk, d)
        if not rotated:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            # One rope call for q and k together (rope is per head).
            qk = self.rotary(batch.positions, torch.cat((q, k), dim=1))
            q, k = qk[:, :h], qk[:, h:]
        o = batch.attn.forward(self.layer_idx, q, k, v, batch.meta)  # fp32 [T, H, D]
        return with_lora(self.o_proj, o.reshape(t, h * d).to(x.dtype), batch.lora)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate // get_tp_size()  # this rank's columns
        self.gate_up_proj = MergedColumnParallelLinear(hidden, (intermediate, intermediate),
                                                       ("gate", "up"), bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, lora: LoRAStep | None = None) -> torch.Tensor:
        gate_up = with_lora(self.gate_up_proj, x, lora)
        act = cpu_ops.silu_mul(gate_up)  # fp32 on CPU: one C call
        if act is None:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        return with_lora(self.down_proj, act, lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, **attn_kw) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary, **attn_kw)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size,
                        bias=getattr(config, "mlp_bias", False))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds the
        two (one fused add + RMSNorm per norm, as vLLM passes the residual)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_norm(self.self_attn(h, batch), residual)
        mlp = self.mlp(h) if batch.lora is None else self.mlp(h, batch.lora)
        return mlp, residual


class LlamaModel(nn.Module):
    def __init__(self, config, layer_cls=LlamaDecoderLayer, **attn_kw) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        d = head_dim_of(config)
        rotary_dim = int(d * getattr(config, "partial_rotary_factor", 1.0))
        with torch.device("cpu"):
            rotary = RotaryEmbedding(config, rotary_dim, config.max_position_embeddings)
        self.layers = nn.ModuleList(
            layer_cls(config, i, rotary, **attn_kw) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, batch, residual)
        return self.norm.add_norm(x, residual)[0]


class LlamaForCausalLM(CausalLMBase):
    # checkpoint module name -> (our fused module, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    qkv_bias_default = False
    qk_norm = False

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        attn_bias = getattr(config, "attention_bias", self.qkv_bias_default)
        self.model = LlamaModel(
            config,
            qkv_bias=attn_bias or self.qkv_bias_default,
            o_bias=attn_bias and not self.qkv_bias_default,
            qk_norm=self.qk_norm,
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, V] fp32 logits; under TP only rank 0 gets them (None elsewhere)."""
        return gather_logits(self.lm_head(hidden).float(), self.config.vocab_size)

    @classmethod
    def spec_for(cls, config, tp_size: int = 1, tp_rank: int = 0) -> KVSpec:
        c = config
        h = c.num_attention_heads
        hk, _ = kv_head_layout(getattr(c, "num_key_value_heads", None) or h, tp_size, tp_rank)
        window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window",
                                                              True) else None
        return KVSpec(
            num_layers=c.num_hidden_layers,
            num_heads=h // tp_size,  # this rank's heads: its attention and its KV cache slice
            num_kv_heads=hk, head_dim=head_dim_of(c), components=2,
            scale=head_dim_of(c) ** -0.5, max_position_embeddings=c.max_position_embeddings,
            sliding_window=window,
        )


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
