"""Offline INT4 (W4A16) quantizer: HF safetensors folder -> compressed-tensors pack-quantized.

    quantize_checkpoint("Llama-3.2-1B", "Llama-3.2-1B-W4A16", group_size=128)

Quantized: every 2-D ``<...>.layers.<i>.<...>.{q,k,v,o,gate,up,down}_proj.weight`` (MoE
``experts.<e>.*_proj``, shared experts and Mixtral ``experts.<e>.w1/w2/w3`` included; with
``experts_only`` the routed ``experts.<e>.*`` only, as Kimi K2 Thinking ships). Stacked 3-D
expert tensors (``experts.gate_up_proj`` [E, 2I, hidden], ``experts.down_proj``) are written
per expert (``experts.<e>.{gate,up,down}_proj.*``, the names vLLM and kvserve load). Kept dense:
embeddings, norms, ``lm_head``, routers (``mlp.gate``, listed in ``ignore``) and every other
tensor. Every kept-dense 2-D weight that is not an embedding is named in ``ignore`` (with
``lm_head``), because the config targets all ``Linear``.
A target whose in_features is not a multiple of ``group_size`` stays dense too (listed in
``ignore``): compressed-tensors refuses partial groups.

Output: ``model.safetensors`` with ``<module>.weight_packed / weight_scale / weight_shape``
(+ ``weight_zero_point`` when asymmetric), the other files of the folder (tokenizer, generation
config, ...) copied, and ``config.json`` with a ``quantization_config`` in the schema that
compressed-tensors (0.20.1 checked) and vLLM read.

``calibration_text``: AWQ. The model is run once with transformers on that text (fp32, hooks
record the inputs of q_proj / o_proj / gate_proj / down_proj); per decoder layer, per-input-
channel scales are searched (``kvserve.quant.int4.awq_search_scales``) and folded exactly:
q/k/v columns x s with input_layernorm / s, gate/up columns x s with post_attention_layernorm
/ s, down_proj columns x s with up_proj rows / s, o_proj columns x s with v_proj rows / s (only
without GQA, where shapes line up). MoE experts and Gemma-style (1 + w) norms are not scaled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kvserve.quant import int4

log = logging.getLogger(__name__)

_TARGET = re.compile(
    r"(?:^|\.)layers\.\d+\.(?:.*\.)?"
    r"(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|experts\.\d+\.w[123])$"
)
# Routed MoE experts (what ``experts_only`` quantizes; Kimi K2 Thinking's layout).
_EXPERT = re.compile(
    r"(?:^|\.)layers\.\d+\.(?:.*\.)?experts\.\d+\.(?:gate_proj|up_proj|down_proj|w[123])$"
)
# Stacked experts as transformers 5.x holds them in memory: gate_up_proj [E, 2I, hidden]
# (rows [0, I) gate, [I, 2I) up), down_proj [E, hidden, I]; written back per expert.
_STACKED_EXPERTS = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.\d+\.(?:.*\.)?experts)\.(?P<kind>gate_up_proj|down_proj)"
    r"(?:\.weight)?$"
)
_EMBEDDING = re.compile(r"(?:embed|wte$|wpe$|embeddings)")
_WEIGHT_FILES = re.compile(r".*\.(?:safetensors|bin|pt|pth|ckpt|msgpack|h5|gguf)$|"
                           r".*\.safetensors\.index\.json$|.*\.bin\.index\.json$")
_AWQ_MAX_TOKENS = 512


@dataclass(frozen=True, slots=True)
class QuantizeSummary:
    quantized: tuple[str, ...]  # module names written as pack-quantized
    ignore: tuple[str, ...]  # the config's ignore list
    awq: dict[str, int4.AwqResult] = field(default_factory=dict)  # "<layer>.<group>" -> result


def is_target(module_name: str, experts_only: bool = False) -> bool:
    """Whether a module (checkpoint name without ``.weight``) is quantized; ``experts_only``:
    routed MoE experts only (``...experts.<e>.{gate,up,down}_proj``, Mixtral ``w1/w2/w3``)."""
    if experts_only:
        return _EXPERT.search(module_name) is not None
    return _TARGET.search(module_name) is not None


def quantization_config(group_size: int, symmetric: bool, ignore: list[str],
                        clip_search: bool = False) -> dict:
    """The ``quantization_config`` for W4A16 pack-quantized (compressed-tensors schema)."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "group_size": None if group_size == -1 else group_size,
        "strategy": "channel" if group_size == -1 else "group",
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "mse" if clip_search else "minmax",
        "observer_kwargs": {},
    }
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
    }


def quantize_checkpoint(
    in_dir: str,
    out_dir: str,
    group_size: int = 128,
    symmetric: bool = True,
    calibration_text: str | None = None,
    progress: bool = True,
    *,
    clip_search: bool = False,
    experts_only: bool = False,
) -> QuantizeSummary:
    """Quantize an HF checkpoint folder to INT4 (see module docstring). ``group_size`` -1:
    channel-wise. ``clip_search``: MSE range search per group (slower, lower error).
    ``experts_only``: quantize the routed MoE experts only (attention, shared experts, dense
    MLPs stay dense and are listed in ``ignore``), as Kimi K2 Thinking ships."""
    if group_size != -1 and group_size < 1:
        raise ValueError(f"group_size must be -1 or >= 1, got {group_size}")
    if experts_only and calibration_text:
        raise ValueError("experts_only with calibration_text: AWQ scales attention and dense "
                         "MLPs only, which experts_only keeps dense; use one or the other")
    if os.path.abspath(in_dir) == os.path.abspath(out_dir):
        raise ValueError("out_dir must differ from in_dir")
    cfg_path = os.path.join(in_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"in_dir has no config.json: {in_dir}")
    with open(cfg_path) as f:
        config = json.load(f)
    if "quantization_config" in config:
        raise ValueError(f"in_dir is already quantized "
                         f"({config['quantization_config'].get('quant_method')}): {in_dir}")
    files = _weight_files(in_dir)

    overrides: dict[str, torch.Tensor] = {}
    awq: dict[str, int4.AwqResult] = {}
    if calibration_text:
        overrides, awq = _awq_overrides(in_dir, config, calibration_text, group_size, symmetric,
                                        progress)

    out: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    ignore: list[str] = ["lm_head"]
    bar = tqdm(total=sum(len(_keys(fn)) for fn in files), desc="quantize int4",
               disable=not progress, unit="tensor")
    for name, t in _split_stacked_experts(_tensors(files, overrides), bar):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and t.dim() == 2 and t.is_floating_point():
            k = t.shape[1]
            target = is_target(module, experts_only)
            if target and (group_size == -1 or k % group_size == 0):
                q = int4.quantize_rtn(t, group_size, symmetric, scale_dtype=t.dtype,
                                      clip_search=clip_search)
                for suffix, v in int4.to_compressed_tensors(q).items():
                    out[f"{module}.{suffix}"] = v
                quantized.append(module)
                continue
            if target:
                log.warning("%s: in_features %d is not a multiple of group_size %d; kept dense",
                            module, k, group_size)
            if not _EMBEDDING.search(module) and module not in ignore:
                ignore.append(module)
        out[name] = t.contiguous()
    bar.close()
    if experts_only and not quantized:
        raise ValueError(f"experts_only: {in_dir!r} has no MoE expert weights to quantize "
                         "(layers.<i>.<...>.experts.<e>.{gate,up,down}_proj.weight)")

    os.makedirs(out_dir, exist_ok=True)
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for entry in os.listdir(in_dir):
        src = os.path.join(in_dir, entry)
        if os.path.isfile(src) and entry != "config.json" and not _WEIGHT_FILES.match(entry):
            shutil.copy2(src, os.path.join(out_dir, entry))
    config["quantization_config"] = quantization_config(group_size, symmetric, ignore,
                                                        clip_search)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return QuantizeSummary(tuple(quantized), tuple(ignore), awq)


def _split_stacked_experts(tensors: Iterator[tuple[str, torch.Tensor]], bar: tqdm
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through (ticking ``bar``), splitting stacked 3-D expert tensors into the
    per-expert 2-D ``experts.<e>.{gate,up,down}_proj.weight`` that compressed-tensors / vLLM
    checkpoints use (the quantizer then treats them like any other expert weight)."""
    for name, t in tensors:
        bar.update(1)
        m = _STACKED_EXPERTS.match(name)
        if m is None or t.dim() != 3 or not t.is_floating_point():
            yield name, t
            continue
        prefix = m["prefix"]
        # clones: a kept-dense slice must not share storage with its siblings (safetensors)
        for e in range(t.shape[0]):
            if m["kind"] == "down_proj":  # [E, hidden, I]
                yield f"{prefix}.{e}.down_proj.weight", t[e].clone()
            else:  # [E, 2I, hidden]
                i = t.shape[1] // 2
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :i].clone()
                yield f"{prefix}.{e}.up_proj.weight", t[e, i:].clone()


def _weight_files(in_dir: str) -> list[str]:
    index = os.path.join(in_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(in_dir, fn) for fn in sorted(set(weight_map.values()))]
    files = sorted(fn for fn in os.listdir(in_dir) if fn.endswith(".safetensors"))
    if not files:
        raise ValueError(f"in_dir has no *.safetensors: {in_dir}")
    return [os.path.join(in_dir, fn) for fn in files]


def _tensors(files: list[str], overrides: dict[str, torch.Tensor]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, ``overrides`` replacing checkpoint values."""
    for fn in files:
        with safe_open(fn, framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118
                yield name, overrides[name] if name in overrides else sf.get_tensor(name)


def _keys(fn: str) -> list[str]:
    with safe_open(fn, framework="pt") as sf:
        return list(sf.keys())


# ---------------------------------------------------------------------------------------------
# AWQ calibration
# ---------------------------------------------------------------------------------------------


def _awq_overrides(
    in_dir: str, config: dict, text: str, group_size: int, symmetric: bool, progress: bool
) -> tuple[dict[str, torch.Tensor], dict[str, int4.AwqResult]]:
    """Run the fp32 model on ``text``, search and fold AWQ scales; return the changed
    checkpoint tensors (name -> tensor in the checkpoint dtype) and the per-group results."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(in_dir)
    model = AutoModelForCausalLM.from_pretrained(in_dir, dtype=torch.float32)
    model.eval()
    modules = dict(model.named_modules())
    ckpt_dtypes = {k: v for fn in _weight_files(in_dir) for k, v in _dtypes(fn).items()}

    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in modules.items():
        if isinstance(mod, torch.nn.Linear) and re.search(
                r"\.layers\.\d+\.[^.]+\.(?:q_proj|o_proj|gate_proj|down_proj)$", name):
            def hook(_m: torch.nn.Module, args: tuple, _name: str = name) -> None:
                inputs[_name] = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            hooks.append(mod.register_forward_pre_hook(hook))
    ids = tok(text, return_tensors="pt").input_ids[:, :_AWQ_MAX_TOKENS]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()

    gemma_norms = str(config.get("model_type", "")).startswith("gemma")
    layers = sorted({m.group(0) for n in inputs if (m := re.match(r".*\.layers\.\d+", n))},
                    key=lambda p: int(p.rsplit(".", 1)[1]))
    changed: set[str] = set()
    results: dict[str, int4.AwqResult] = {}
    # (group, producer suffix, consumer suffixes, input-capture suffix)
    plan = [
        ("attn", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.q_proj"),
        ("o", "self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        ("mlp", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_proj"),
        ("down", "mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ]
    with torch.no_grad():
        for prefix in tqdm(layers, desc="awq search", disable=not progress, unit="layer"):
            for group, prod_sfx, cons_sfx, x_sfx in plan:
                prod = modules.get(f"{prefix}.{prod_sfx}")
                cons = [modules.get(f"{prefix}.{s}") for s in cons_sfx]
                x = inputs.get(f"{prefix}.{x_sfx}")
                if prod is None or x is None or not all(isinstance(c, torch.nn.Linear)
                                                        for c in cons):
                    continue
                k = x.shape[1]
                if group_size != -1 and k % group_size != 0:
                    continue  # kept dense by the quantizer
                is_norm = not isinstance(prod, torch.nn.Linear)
                if is_norm and (gemma_norms or getattr(prod, "weight", None) is None
                                or prod.weight.shape != (k,)):
                    continue
                if not is_norm and prod.weight.shape[0] != k:
                    continue  # GQA v_proj -> o_proj: shapes do not line up
                names = [f"{prefix}.{s}.weight" for s in (prod_sfx, *cons_sfx)]
                if not all(n in ckpt_dtypes for n in names):
                    continue  # renamed by transformers on load: leave this group alone
                res = int4.awq_search_scales([c.weight for c in cons], x, group_size,
                                             symmetric)
                results[f"{prefix}.{group}"] = res
                s = res.scales
                for c in cons:
                    c.weight.mul_(s)  # columns x s
                if is_norm:
                    prod.weight.div_(s)
                    if getattr(prod, "bias", None) is not None:
                        prod.bias.div_(s)
                else:
                    prod.weight.div_(s.unsqueeze(1))  # rows / s
                    if prod.bias is not None:
                        prod.bias.div_(s)
                    if f"{prefix}.{prod_sfx}.bias" in ckpt_dtypes:
                        changed.add(f"{prefix}.{prod_sfx}.bias")
                changed.update(names)
    params = dict(model.named_parameters())
    overrides = {n: params[n].detach().to(ckpt_dtypes[n]).contiguous() for n in changed}
    return overrides, results


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16}


def _dtypes(fn: str) -> dict[str, torch.dtype]:
    """Float tensors of a safetensors file -> their dtype (read from the header only)."""
    with safe_open(fn, framework="pt") as sf:
        found = {k: _ST_DTYPES.get(sf.get_slice(k).get_dtype()) for k in sf.keys()}  # noqa: SIM118
    return {k: v for k, v in found.items() if v is not None}
