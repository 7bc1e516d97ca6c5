"""Gemma 3 (text): Gemma3ForCausalLM (HF folders, ``model_type`` gemma3_text) and GGUF files of
architecture ``gemma3`` (kvserve/model/gguf.py maps their names and norms).

Differences from the Llama decoder it reuses (QKV / gate-up fusion, q/k norms, the attention
backend call):

    x = embed(ids) * sqrt(hidden)
    per layer:  h = x + post_attention_norm(attn(input_norm(x)))
                x = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))
    norms       (1 + w) RMSNorm (the checkpoint stores w; the parameter holds 1 + w)
    q / k       per-head (1 + w) RMSNorm before rope
    mlp         down(gelu_tanh(gate) * up)
    scale       query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
    layers      ``layer_types``: sliding_attention layers read the last ``sliding_window``
                keys only (KVSpec.layer_windows) and rotate with their own rope
                (rope_parameters["sliding_attention"]: rope_local_base_freq), full_attention
                layers attend over everything with theirs (rope_parameters["full_attention"],
                scaling included)
    head        tied to the embedding; final_logit_softcapping when the config sets it
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.cpu import cpu_ops
from kvserve.layers.lora import LoRAStep, with_lora
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.forward_batch import ForwardBatch
from kvserve.model.interface import KVSpec
from kvserve.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of

SLIDING, FULL = "sliding_attention", "full_attention"


def _load_one_plus(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Gemma's checkpoints store w of ``x * (1 + w)``: the parameter keeps 1 + w (in fp32
    arithmetic, as HF computes it), so the fused add + RMSNorm kernels apply unchanged."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded.float() + 1.0)


class GemmaRMSNorm(RMSNorm):
    """y = x / rms(x) * (1 + w); ``weight`` holds 1 + w once loaded."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        self.weight.weight_loader = _load_one_plus  # type: ignore[attr-defined]

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) without a residual: the fused C op where it applies (fp32 [T, D] on CPU,
        recordable in a CPU decode graph), else ``forward``."""
        return self.add_norm(x, None)[0] if x.dim() == 2 else self(x)


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:  # older configs: every ``sliding_window_pattern``-th layer is full
        pattern = getattr(config, "sliding_window_pattern", 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {SLIDING!r} / {FULL!r} for each of the "
                         f"{config.num_hidden_layers} layers, got {types}")
    return list(types)


def check_config(config) -> None:
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 does not set it)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported: kvserve serves causal "
                         "language models")


class Gemma3Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary,
                         qkv_bias=bool(getattr(config, "attention_bias", False)),
                         o_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, h, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = with_lora(self.qkv_proj, x, batch.lora)
        # fp32 on CPU: q / k heads normed, then rotated, in place in qkv (C calls a CPU decode
        # graph records); else the torch twin below
        fused = cpu_ops.head_rms_norm_applies(qkv, self.q_norm.weight)
        if fused:
            cpu_ops.head_rms_norm_(qkv, 0, h, d, self.q_norm.weight, self.q_norm.eps)
            cpu_ops.head_rms_norm_(qkv, h, hk, d, self.k_norm.weight, self.k_norm.eps)
            fused = self.rotary.rotate_qk_(batch.positions, qkv, h + hk, d)
        q, k, v = qkv.split((h * d, hk * d, hk * d), dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, hk, d), v.view(t, hk, d)
        if not fused:
            if not cpu_ops.head_rms_norm_applies(qkv, self.q_norm.weight):
                q, k = self.q_norm(q), self.k_norm(k)
            qk = self.rotary(batch.positions, torch.cat((q, k), dim=1))
            q, k = qk[:, :h], qk[:, h:]
        o = batch.attn.forward(self.layer_idx, q, k, v, batch.meta)  # fp32 [T, H, D]
        return with_lora(self.o_proj, o.reshape(t, h * d).to(x.dtype), batch.lora)


class Gemma3MLP(LlamaMLP):
    """GeGLU: down(gelu_tanh(gate) * up)."""

    def forward(self, x: torch.Tensor, lora: LoRAStep | None = None) -> torch.Tensor:
        gate_up = with_lora(self.gate_up_proj, x, lora)
        act = cpu_ops.gelu_tanh_mul(gate_up)  # fp32 on CPU: one C call
        if act is None:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        return with_lora(self.down_proj, act, lora)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx, rotary)
        self.mlp = Gemma3MLP(hidden, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed MLP output, the residual stream before it): the stream is
        their sum, added by the next fused add + RMSNorm (as in the Llama decoder)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        attn = self.post_attention_layernorm.norm(self.self_attn(h, batch))
        h, residual = self.pre_feedforward_layernorm.add_norm(attn, residual)
        return self.post_feedforward_layernorm.norm(self.mlp(h, batch.lora)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        check_config(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = float(config.hidden_size) ** 0.5
        d = head_dim_of(config)
        types = layer_types(config)
        with torch.device("cpu"):  # one rope per kind of layer, shared by its layers
            rotary = {t: RotaryEmbedding(config, d, config.max_position_embeddings, layer_type=t)
                      for t in sorted(set(types))}
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, rotary[t])
                                    for i, t in enumerate(types))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        # sqrt(hidden) in the activations' dtype, as HF rounds it (fp32: in place, one C call)
        if not cpu_ops.scale_(x, self.embed_scale):
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, batch, residual)
        return self.norm.add_norm(x, residual)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is not None and self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @classmethod
    def spec_for(cls, config, tp_size: int = 1, tp_rank: int = 0) -> KVSpec:
        spec = super().spec_for(config, tp_size, tp_rank)
        window = int(getattr(config, "sliding_window", None) or 0)
        windows = tuple(window if t == SLIDING else 0 for t in layer_types(config))
        return KVSpec(
            num_layers=spec.num_layers, num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, components=2,
            scale=float(getattr(config, "query_pre_attn_scalar", None) or spec.head_dim)
            ** -0.5,
            max_position_embeddings=spec.max_position_embeddings,
            layer_windows=windows if any(windows) else (),
        )
