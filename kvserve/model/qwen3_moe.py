"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (per-head QK RMSNorm, GQA, full rope)
with a softmax-routed top-k MoE MLP (no shared expert) on the sparse layers.

A layer is sparse unless it is listed in ``mlp_only_layers`` or ``(i + 1) %
decoder_sparse_step != 0``; dense layers use a plain SiLU MLP of ``intermediate_size``.
Expert weights load through ``kvserve.layers.moe.load_expert_tensor`` (``load_extra``).
"""

from __future__ import annotations

from torch import nn

from kvserve.layers.moe import (
    FusedMoE,
    SparseMoeBlock,
    TopKRouter,
    check_activation,
    load_expert_tensor,
)
from kvserve.layers.vocab_parallel import ParallelLMHead
from kvserve.model.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel, Qwen3ForCausalLM


def _is_sparse(config, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if not _is_sparse(config, layer_idx):
            return LlamaMLP(config.hidden_size, config.intermediate_size)
        router = TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                            scoring="softmax", norm_topk_prob=bool(config.norm_topk_prob))
        experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        return SparseMoeBlock(router, experts)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        check_activation(config)
        self.config = config
        bias = bool(getattr(config, "attention_bias", False))  # q/k/v and o alike in HF
        self.model = LlamaModel(config, layer_cls=Qwen3MoeDecoderLayer, qkv_bias=bias,
                                o_bias=bias, qk_norm=True)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def load_extra(self, name: str, handle, loaded: set) -> bool:
        return load_expert_tensor(self, name, handle, loaded)
