"""Up-front tensor-parallel checks: a ``ValueError`` before any process starts when
``tensor_parallel_size`` cannot split the model, naming the parameter and listing the sizes
that would work (vllm PR #52535 does the same)."""

from __future__ import annotations

from kvserve.model.default_model import resolve_model
from kvserve.model.loader import _raw_quantization_config, load_hf_config, model_source

# Architectures whose layers are tensor-parallel (kvserve.model.llama, qwen3_moe, glm4_moe,
# deepseek_v3), and those of them with routed experts.
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
                    "DeepseekV3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)

def _int4_group_size(path: str, folder: str, is_gguf: bool) -> int | None:
    """The INT4 group size the checkpoint's quantized weights use (None: dense)."""
    if is_gguf:
        return 32  # Q4_0 / Q4_1 blocks
    from kvserve.model.quant_config import parse_quant_config

    quant = parse_quant_config(_raw_quantization_config(folder))
    if quant is None:
        return None
    sizes = set()
    for name in ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
        scheme = quant.scheme_for(name)
        if scheme is not None and scheme.group_size != -1:  # channel-wise: any split works
            sizes.add(scheme.group_size)
    return max(sizes) if sizes else None


def validate_parallel(model: str | None, tp: int, enable_expert_parallel: bool = False) -> None:
    if tp == 1:
        return
    path = resolve_model(model)
    folder, ggml = model_source(path)
    cfg, arch = load_hf_config(folder)
    if arch not in TP_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size={tp}: {arch} has no tensor-parallel layers yet "
                         f"(supported: {', '.join(TP_ARCHITECTURES)}); use "
                         "tensor_parallel_size=1")
    moe = arch in MOE_ARCHITECTURES
    if enable_expert_parallel and not moe:
        raise ValueError(f"enable_expert_parallel: {arch} has no experts")
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    inter = cfg.intermediate_size
    group = _int4_group_size(path, folder, ggml is not None)
    if moe and group is not None:
        raise ValueError(f"tensor_parallel_size={tp}: INT4 {arch} checkpoints are not split "
                         "over ranks yet; use tensor_parallel_size=1 or a bf16 checkpoint")
    checks: list[tuple[str, int, object]] = [
        ("num_attention_heads", heads, lambda t: heads % t == 0),
        ("intermediate_size", inter, lambda t: inter % t == 0),
    ]
    if arch not in MLA_ARCHITECTURES:  # MLA: one latent row, replicated
        checks.append(("num_key_value_heads", kv, lambda t: kv % t == 0 or t % kv == 0))
    if moe:
        experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
        moe_inter = cfg.moe_intermediate_size
        shared = moe_inter * (getattr(cfg, "n_shared_experts", 0) or 0)
        if enable_expert_parallel:
            checks.append(("num_experts (expert parallel)", experts,
                           lambda t: experts % t == 0))
        else:
            checks.append(("moe_intermediate_size", moe_inter, lambda t: moe_inter % t == 0))
        if shared:
            checks.append(("moe_intermediate_size x n_shared_experts", shared,
                           lambda t: shared % t == 0))
    if group is not None:
        # row-parallel INT4 weights split their input columns in whole quantization groups
        checks += [
            (f"intermediate_size / tensor_parallel_size (down_proj input, INT4 group size "
             f"{group})", inter, lambda t: inter % t == 0 and (inter // t) % group == 0),
            (f"num_attention_heads x head_dim / tensor_parallel_size (o_proj input, INT4 group "
             f"size {group})", heads * head_dim,
             lambda t: heads % t == 0 and (heads // t * head_dim) % group == 0),
        ]
    works = [t for t in range(1, 2 * heads + 1) if all(ok(t) for _, _, ok in checks)]
    for name, value, ok in checks:
        if not ok(tp):
            raise ValueError(f"tensor_parallel_size={tp} does not split {name}={value}; "
                             f"tensor_parallel_size values that work for this model: {works}")
