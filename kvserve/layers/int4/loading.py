"""The INT4 passes over a model the loader runs (``kvserve.model.loader``): which modules load
as INT4 (``swap_int4_modules``, on the meta model, from a quantization view that answers
``scheme_for(checkpoint module name)``: ``kvserve.model.quant_config.QuantConfig`` or
``kvserve.model.gguf.GGUFQuant``), and after the checkpoint is read, packing them for this
device (``finish_int4_modules``).

``model`` is a ``kvserve.model.interface.CausalLM``: its ``packed_modules`` (checkpoint module
-> (fused module, shard id)), ``tie_word_embeddings`` and ``int4_dense_modules`` are read here.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kvserve.layers.int4.gguf_linear import GGUFLinear
from kvserve.layers.int4.linear import Int4Linear
from kvserve.layers.int4.merged import Int4MergedLinear
from kvserve.layers.int4.moe import Int4FusedMoE
from kvserve.layers.linear import Linear, MergedLinear, checkpoint_names
from kvserve.layers.moe import FusedMoE
from kvserve.quant.int4 import Int4Scheme


class QuantView(Protocol):
    """Which checkpoint modules a checkpoint quantizes, and how (None: dense)."""

    def scheme_for(self, name: str, class_name: str = "Linear") -> Int4Scheme | None: ...


def swap_int4_modules(model: nn.Module, quant: QuantView) -> int:
    """Replace the (meta) ``Linear`` / ``MergedLinear`` modules that ``quant`` quantizes with
    ``Int4MergedLinear``; returns how many. A fused module's shards are looked up by their
    checkpoint names (``packed_modules``) and must agree; a tied ``lm_head`` stays as it is.

    MoE: a ``FusedMoE`` (stacked dense experts) any of whose ``experts.<e>.{gate,up,down}_proj``
    the config quantizes first becomes an ``Int4FusedMoE`` of per-expert dense modules named
    like the checkpoint (``experts.<e>.gate_up_proj`` / ``down_proj``); the pass below then
    swaps those the config quantizes, so per-expert ``ignore`` entries, gate/up agreement and
    error messages work as for any MLP. Router gates are not linear modules here: always dense.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedMoE) and any(
                quant.scheme_for(f"{name}.{e}.{proj}") is not None
                for e in range(module.num_experts)
                for proj in ("gate_proj", "up_proj", "down_proj")):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, Int4FusedMoE.replacing(module))
    shard_ckpt: dict[str, dict[str, str]] = {}  # fused module -> shard id -> checkpoint module
    for ckpt, (fused, shard) in model.packed_modules.items():
        shard_ckpt.setdefault(fused, {})[shard] = ckpt
    tied = model.tie_word_embeddings
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, (Linear, MergedLinear)):
            continue
        if tied and name == "lm_head":
            continue
        parent_name, _, attr = name.rpartition(".")
        names = checkpoint_names(name, module, shard_ckpt)
        schemes = {s: quant.scheme_for(n) for s, n in names.items()}
        if len(set(schemes.values())) > 1:
            detail = ", ".join(f"{names[s]}: {sch.describe() if sch else 'dense'}"
                               for s, sch in schemes.items())
            raise ValueError(f"fused module {name} runs its shards as one GEMM, but "
                             f"quantization_config quantizes them differently ({detail})")
        scheme = next(iter(schemes.values()))
        if scheme is None:
            continue
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int4MergedLinear.replacing(module, scheme, names))
        swapped += 1
    return swapped


def densify_int4_modules(model: nn.Module, dtype: torch.dtype, device: str = "cpu"
                         ) -> int:
    """Modules a model reads as a dense weight matrix (its ``int4_dense_modules``: attribute
    names, e.g. MLA's ``kv_b_proj``, whose weight decode absorbs into the queries) load from
    INT4 checkpoint tensors like any other and are then dequantized once (on the CPU, after
    the checkpoint is read) into a plain ``Linear`` of ``dtype`` on ``device``. Returns how
    many."""
    names = tuple(model.int4_dense_modules)
    n = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Int4MergedLinear) or name.rpartition(".")[2] not in names:
            continue
        if len(module.shard_ids) != 1:
            raise ValueError(f"{name}: a fused module cannot be dequantized to a Linear")
        module.finish_loading()  # idempotent; GPTQ modules may still wait for optional tensors
        w = module.dequantize().to(device=device, dtype=dtype)  # [out, in]
        with torch.device("meta"):  # parameters replaced just below
            dense = Linear(module.in_features, module.out_sizes[0],
                           bias=module.bias is not None)
        dense.weight = torch.nn.Parameter(w, requires_grad=False)
        if module.bias is not None:
            dense.bias = torch.nn.Parameter(module.bias.detach().to(device=device, dtype=dtype),
                                            requires_grad=False)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, dense)
        n += 1
    return n


def finish_int4_modules(model: nn.Module, dtype: torch.dtype, device: str,
                        kernel: str = "triton") -> None:
    """After the checkpoint is read (and its missing-tensor check): the modules the model reads
    as a dense matrix are dequantized (``densify_int4_modules``), every other INT4 module is
    built (``finish_loading``: those still waiting for optional tensors) and, off the CPU,
    repacked once for the GPU ``kernel`` ("triton" or "tinygemm"; the CPU layout dropped) and
    moved to ``device``. Packed GGUF modules (``GGUFLinear``) are finished the same way."""
    densify_int4_modules(model, dtype, device)
    for module in model.modules():
        if isinstance(module, GGUFLinear):  # packed GGUF blocks
            module.finish_loading()
            if torch.device(device).type != "cpu":
                module.to_device(kernel, device)
        elif isinstance(module, Int4MergedLinear):
            module.finish_loading()
            if torch.device(device).type != "cpu":
                # packed on the CPU from the checkpoint; repacked once for the GPU kernel
                # (dropping the CPU layout) and moved
                for lin in module.modules():
                    if isinstance(lin, Int4Linear):
                        lin.to_device_layout(kernel, device)
                module.to(device)
