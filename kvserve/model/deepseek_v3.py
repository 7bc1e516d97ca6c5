"""DeepSeek-V3 / R1 and Kimi K2 (``DeepseekV3ForCausalLM``): multi-head latent attention
(MLA) + sigmoid-routed MoE with shared experts after ``first_k_dense_replace`` dense layers.

Attention per token (H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, R = kv_lora_rank):

    q = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x) when q_lora_rank is None
        -> [H, dn + dr] = [q_nope | q_pe]
    [c_kv | k_pe] = kv_a_proj_with_mqa(x)      c_kv <- kv_a_layernorm(c_kv)   [R], [dr]
    q_pe, k_pe <- rope (decoupled: only these dr dims; interleaved pairs when
                  ``rope_interleave``, yarn scaling incl. its cos/sin attention factor)
    cache row = [c_kv | k_pe]  (``kvserve.attention.mla_torch``: expansion through kv_b_proj in
                prefill, weight absorption in decode)
    softmax scale = (dn + dr)^-0.5 * mscale^2,  mscale = 0.1 * mscale_all_dim * ln(factor) + 1
                    for yarn with ``mscale_all_dim`` set (1 otherwise), as transformers does.

KV bytes per token vs MHA: see ``kvserve/attention/mla_torch.py`` (DeepSeek-V3: 70,272 B BF16,
35,258 B FP8, vs 4,997,120 B for the same model as plain BF16 MHA).

Kimi K2 checkpoints declare this architecture with ``model_type: kimi_k2``, which transformers
does not know; importing this module registers ``kimi_k2`` with ``AutoConfig`` as a
``DeepseekV3Config`` subclass so the loader's ``AutoConfig.from_pretrained`` resolves it
locally (no ``trust_remote_code``). INT4 checkpoints (compressed-tensors pack-quantized, GPTQ)
load through ``kvserve.model.loader``, routed experts included (Kimi K2 Thinking ships its
experts INT4 group 32, the rest BF16). Block-FP8 checkpoints (``quantization_config`` fp8,
``weight_scale_inv`` tensors) must be dequantized to BF16 first.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from kvserve.distributed.parallel_state import get_tp_size
from kvserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from kvserve.layers.moe import check_activation, deepseek_style_moe, load_expert_tensor
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, _rope_parameters
from kvserve.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, gather_logits
from kvserve.model.forward_batch import ForwardBatch
from kvserve.model.interface import CausalLMBase, KVSpec
from kvserve.model.llama import LlamaMLP


def _register_kimi_k2() -> None:
    from transformers import AutoConfig, DeepseekV3Config

    class KimiK2Config(DeepseekV3Config):
        model_type = "kimi_k2"

    with contextlib.suppress(ValueError):  # already registered (by a newer transformers)
        AutoConfig.register("kimi_k2", KimiK2Config)


_register_kimi_k2()


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config) -> float:
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = _rope_parameters(config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


def mla_kv_spec(config, tp_size: int = 1) -> KVSpec:
    """KV cache spec of an MLA model: one latent row [R + dr] per token and layer (components
    == 1, so the registry picks mla_torch / mla_triton: resolve_backend_name)."""
    return KVSpec(
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads // tp_size,  # this rank's heads
        num_kv_heads=1,  # the latent row, replicated on every tensor-parallel rank
        head_dim=config.kv_lora_rank + config.qk_rope_head_dim,
        components=1,
        scale=mla_softmax_scale(config),
        max_position_embeddings=config.max_position_embeddings,
        kv_lora_rank=config.kv_lora_rank,  # the row is [c_kv (R) | k_pe (dr)]
    )


class DeepseekV3Attention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # Tensor parallel: heads split (q_b / kv_b column parallel, o_proj row parallel); the
        # latent projections q_a / kv_a are replicated, so every rank computes and caches the
        # same latent rows: the MLA cache is replicated per rank (docs/parallelism.md).
        h = config.num_attention_heads
        self.num_heads = h // get_tp_size()
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        qk = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, h * qk)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, h * qk)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              h * (self.nope_dim + self.v_dim))
        self.o_proj = RowParallelLinear(h * self.v_dim, hidden, bias=bias)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, -1).split((self.nope_dim, self.rope_dim), dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), -1)
        c_kv = self.kv_a_layernorm(c_kv)  # [T, R]
        q_pe = self.rotary(batch.positions, q_pe)  # fp32 [T, H, dr]
        k_pe = self.rotary(batch.positions, k_pe.view(t, 1, self.rope_dim)).view(t, -1)
        latent = torch.cat((c_kv.float(), k_pe), dim=-1)  # [T, R + dr] the cache row
        attn = batch.attn
        if not attn.latent:
            raise ValueError(f"DeepseekV3 (MLA) needs the 'mla_torch' attention backend, not "
                             f"{attn.name!r}")
        o = attn.forward_mla(self.layer_idx, q_nope, q_pe, latent, batch.meta,
                             self.kv_b_proj.weight)  # fp32 [T, H, dv]
        return self.o_proj(o.reshape(t, h * self.v_dim).to(x.dtype))


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(config, layer_idx, rotary)
        if layer_idx >= config.first_k_dense_replace:
            self.mlp: nn.Module = deepseek_style_moe(config, LlamaMLP)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        interleave = bool(getattr(config, "rope_interleave", True))
        with torch.device("cpu"):  # cos/sin tables are plain attributes: never on meta
            rotary = RotaryEmbedding(config, config.qk_rope_head_dim,
                                     config.max_position_embeddings, interleaved=interleave)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch)
        return self.norm(x)


class DeepseekV3ForCausalLM(CausalLMBase):
    # checkpoint module name -> (our fused module, shard id); q_proj is NOT fused here.
    packed_modules = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    # MLA decode absorbs kv_b_proj's weight into the queries: an INT4 kv_b_proj is dequantized
    # to a dense Linear once at load (kvserve.layers.int4.loading.densify_int4_modules).
    int4_dense_modules = ("kv_b_proj",)

    def __init__(self, config) -> None:
        super().__init__()
        check_activation(config)
        quant = getattr(config, "quantization_config", None)
        if quant:
            raw = quant if isinstance(quant, dict) else getattr(quant, "to_dict", dict)()
            method = str(raw.get("quant_method", quant)).lower().replace("_", "-")
            if method not in ("compressed-tensors", "gptq"):  # INT4: see loader/quant_config
                raise ValueError(f"quantized DeepseekV3 checkpoints ({method}) are not "
                                 "supported; dequantize to bf16 first (INT4 compressed-tensors "
                                 "pack-quantized and GPTQ load)")
        self.config = config
        self.model = DeepseekV3Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_logits(self.lm_head(hidden).float(), self.config.vocab_size)

    @classmethod
    def spec_for(cls, config, tp_size: int = 1, tp_rank: int = 0) -> KVSpec:
        return mla_kv_spec(config, tp_size)

    @torch.no_grad()
    def fold_kv_rotation(self, rotation) -> None:
        """Rotated KV modes (``int8``, ``fp8_rot``): the cache stores ``[c_kv R_c | k_pe R_pe]``
        (kvserve/quant/rotation.py, ``split=(R, dr)``); fold R_c into every layer's
        ``kv_b_proj.weight`` W [H * (dn + dv), R] as ``W R_c``, so W_UK and W_UV (absorbed
        decode and prefill expansion alike) read the rotated latent unchanged. Computed in
        fp32, stored in the weight's dtype (a bf16 weight is rounded once more: relative
        2^-9, like the weight itself). Called once, by the worker, before serving."""
        if getattr(self, "_kv_rotation_folded", None) is not None:
            raise ValueError("kv rotation already folded into kv_b_proj")
        r_c = rotation.parts[0]
        for layer in self.model.layers:
            w = layer.self_attn.kv_b_proj.weight
            if not w.is_floating_point() or w.shape[-1] != r_c.shape[0]:
                raise ValueError(f"kv_b_proj.weight {tuple(w.shape)} {w.dtype}: cannot fold a "
                                 f"{r_c.shape[0]}-wide rotation into it")
            w.copy_((w.float() @ r_c.to(w.device)).to(w.dtype))
        self._kv_rotation_folded = rotation.describe()

    def load_extra(self, name: str, handle, loaded: set) -> bool:
        return load_expert_tensor(self, name, handle, loaded)
