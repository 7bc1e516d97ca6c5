"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``).

Attention: GQA with q/k/v bias when ``attention_bias`` (o_proj never has a bias), optional
per-head QK RMSNorm (``use_qk_norm``), rotate-half rope on the first
``head_dim * partial_rotary_factor`` dims of each head (the factor lives in
``rope_parameters``; default 0.5). MLP: dense SiLU MLP on the first ``first_k_dense_replace``
layers, then a sigmoid-routed MoE (DeepSeek-V3 routing: correction bias for selection, grouped
top-k, ``routed_scaling_factor``) plus ``n_shared_experts`` shared experts.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.moe import check_activation, deepseek_style_moe, load_expert_tensor
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
)


def partial_rotary_factor(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    return float(0.5 if factor is None else factor)


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if layer_idx >= config.first_k_dense_replace:
            return deepseek_style_moe(config, LlamaMLP)
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class Glm4MoeModel(LlamaModel):
    def __init__(self, config, **attn_kw) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_dim = int(head_dim_of(config) * partial_rotary_factor(config))
        with torch.device("cpu"):  # cos/sin tables are plain attributes: never on meta
            rotary = RotaryEmbedding(config, rotary_dim, config.max_position_embeddings)
        self.layers = nn.ModuleList(
            Glm4MoeDecoderLayer(config, i, rotary, **attn_kw)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        check_activation(config)
        self.config = config
        self.model = Glm4MoeModel(
            config, qkv_bias=bool(getattr(config, "attention_bias", False)), o_bias=False,
            qk_norm=bool(getattr(config, "use_qk_norm", False)),
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def load_extra(self, name: str, handle, loaded: set) -> bool:
        return load_expert_tensor(self, name, handle, loaded)
