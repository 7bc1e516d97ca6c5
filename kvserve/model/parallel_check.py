"""Up-front tensor-parallel checks: a ``ValueError`` before any process starts when
``tensor_parallel_size`` cannot split the model, naming the parameter and listing the sizes
that would work (vllm PR #52535 does the same)."""

from __future__ import annotations

from kvserve.model.default_model import resolve_model
from kvserve.model.sources import load_hf_config, model_source, raw_quantization_config

# Architectures whose layers are tensor-parallel (kvserve.model.llama, qwen3_moe, glm4_moe,
# deepseek_v3), and those of them with routed experts.
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
                    "DeepseekV3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)

def _int4_group_sizes(folder: str, is_gguf: bool, names: dict[str, str]
                      ) -> dict[str, int | None]:
    """For each role -> checkpoint module name: the INT4 group size of its weight (None:
    dense or channel-wise, which any split keeps whole)."""
    if is_gguf:
        return dict.fromkeys(names, 32)  # Q4_0 / Q4_1 blocks (dense GGUF tensors: harmless)
    from kvserve.model.quant_config import parse_quant_config

    quant = parse_quant_config(raw_quantization_config(folder))
    out: dict[str, int | None] = dict.fromkeys(names)
    if quant is None:
        return out
    for role, name in names.items():
        scheme = quant.scheme_for(name)
        if scheme is not None and scheme.group_size != -1:
            out[role] = scheme.group_size
    return out


def _first_sparse_layer(cfg) -> int:
    """A layer index with routed experts (DeepSeek-V3 / GLM-4.5: after first_k_dense_replace;
    Qwen3-MoE: the first not in mlp_only_layers)."""
    k = getattr(cfg, "first_k_dense_replace", 0) or 0
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    while k in dense:
        k += 1
    return k


def _split_in_groups(n: int, group: int | None):
    """ok(t): t splits n input columns into whole INT4 groups (any t dividing n if dense)."""
    return lambda t: n % t == 0 and (group is None or (n // t) % group == 0)


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
    mla = arch in MLA_ARCHITECTURES
    # o_proj's input: heads x head_dim (MLA: heads x v_head_dim)
    head_dim = cfg.v_head_dim if mla else (getattr(cfg, "head_dim", None)
                                            or cfg.hidden_size // heads)
    inter = cfg.intermediate_size
    sparse = _first_sparse_layer(cfg) if moe else 0
    groups = _int4_group_sizes(folder, ggml is not None, {
        "down_proj": "model.layers.0.mlp.down_proj",
        "o_proj": "model.layers.0.self_attn.o_proj",
        "experts": f"model.layers.{sparse}.mlp.experts.0.down_proj",
        "shared": f"model.layers.{sparse}.mlp.shared_experts.down_proj"})

    def named(what: str, role: str) -> str:
        # row-parallel INT4 weights split their input columns in whole quantization groups
        g = groups[role]
        return what if g is None else (f"{what} / tensor_parallel_size ({role} input, INT4 "
                                       f"group size {g})")

    checks: list[tuple[str, int, object]] = [
        ("num_attention_heads", heads, lambda t: heads % t == 0),
        (named("intermediate_size", "down_proj"), inter,
         _split_in_groups(inter, groups["down_proj"])),
    ]
    if groups["o_proj"] is not None:
        o_in = heads * head_dim
        checks.append((named(f"num_attention_heads x {'v_' if mla else ''}head_dim", "o_proj"),
                       o_in, lambda t: heads % t == 0 and (o_in // t) % groups["o_proj"] == 0))
    if not mla:  # MLA: one latent row, replicated
        checks.append(("num_key_value_heads", kv, lambda t: kv % t == 0 or t % kv == 0))
    if moe:
        experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
        moe_inter = cfg.moe_intermediate_size
        shared = moe_inter * (getattr(cfg, "n_shared_experts", 0) or 0)
        if enable_expert_parallel:  # whole experts per rank: INT4 groups stay whole
            checks.append(("num_experts (expert parallel)", experts,
                           lambda t: experts % t == 0))
        else:
            checks.append((named("moe_intermediate_size", "experts"), moe_inter,
                           _split_in_groups(moe_inter, groups["experts"])))
        if shared:
            checks.append((named("moe_intermediate_size x n_shared_experts", "shared"), shared,
                           _split_in_groups(shared, groups["shared"])))
    works = [t for t in range(1, 2 * heads + 1) if all(ok(t) for _, _, ok in checks)]
    for name, value, ok in checks:
        if not ok(tp):
            raise ValueError(f"tensor_parallel_size={tp} does not split {name}={value}; "
                             f"tensor_parallel_size values that work for this model: {works}")
