"""Load a checkpoint (kvserve.model.sources: an HF folder of *.safetensors, or a GGUF file)
into a model.

The model is built on the meta device, the source says which linears load as INT4, the model
is materialized once (``to_empty``), and every tensor the source yields is handed to its
parameter's ``weight_loader`` (fused q/k/v and gate/up are assembled from their shards there;
under tensor parallelism the source reads this rank's slice where it can). A checkpoint that
lacks a tensor the model needs is an error that names the tensor.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import closing
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kvserve.config import ModelDtypes, resolve_model_dtypes
from kvserve.distributed.parallel_state import get_tp_size
from kvserve.layers.int4.loading import finish_int4_modules, swap_int4_modules
from kvserve.layers.int4.merged import Int4MergedLinear
from kvserve.layers.linear import Linear, MergedLinear, ShardSlice
from kvserve.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from kvserve.model import gguf, registry
from kvserve.model.gguf import GGUFCheckpoint
from kvserve.model.interface import CausalLM
from kvserve.model.sources import (
    checkpoint_params,
    expected_tensors,
    load_hf_config,
    model_source,
    open_checkpoint,
)
from kvserve.quant.w16 import can_pack, tiles_of

logger = logging.getLogger(__name__)

# Checkpoint tensors that carry no weights for us.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM  # an nn.Module
    hf_config: object
    architecture: str
    dtype: torch.dtype
    # Per-layer static KV scales found in the checkpoint ([L, 2] per-tensor), else None.
    kv_scales: torch.Tensor | None
    folder: str = ""  # config.json + tokenizer files (a GGUF's converted metadata)
    weight_files: tuple[str, ...] = ()  # the files the weights came from
    storage: torch.dtype | None = None  # dense weight tables (None: ``dtype``)


def checkpoint_dtype(hf_config) -> torch.dtype:
    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) else torch.float32


def _target(model: CausalLM, name: str) -> tuple[str, str | None]:
    """Checkpoint tensor name -> (our parameter name, shard id)."""
    packed = model.packed_modules
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard = packed[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, None


def load_model(path: str, dtype: str | torch.dtype | ModelDtypes = "auto", device: str = "cpu",
               progress: bool = True, act_terms: int = 2,
               int4_kernel: str = "triton") -> LoadedModel:
    """``dtype``: a name or dtype resolved here, or the ``ModelDtypes`` the engine's builder
    settled (``checkpoint_dtypes``). ``act_terms``: GGUF Q4_0 / Q4_1 / Q8_0 weights multiply
    activations quantized to this many int8 terms per 32 columns on CPU (integer dot
    products, kvserve.quant.wq); 0 keeps fp32 activations (the dequantized weights' exact
    product, slower). ``int4_kernel``: the GPU kernel INT4 layers are repacked for off the
    CPU ("triton" or "tinygemm")."""
    from kvserve.config import dtype_name

    source = open_checkpoint(path)
    hf_config, arch = source.config()
    dtypes = (dtype if isinstance(dtype, ModelDtypes)
              else model_dtypes(dtype, checkpoint_dtype(hf_config), device, source.n_params()))
    dtype, storage = dtypes.compute, dtypes.storage
    cls = registry.resolve(arch)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(prev)
    quant = source.prepare(model, act_terms)
    if quant is not None:
        n = swap_int4_modules(model, quant)
        logger.info("%s: %d linear module(s) load as %s", path, n, quant.describe())
    materialize(model, device)
    model.tie_weights()

    params = dict(model.named_parameters(remove_duplicate=False))
    expected = expected_tensors(model, params)
    loaded: set[tuple[str, str | None]] = set()
    kv_scales: dict[tuple[int, int], float] = {}
    with tqdm(total=len(expected), desc="Loading weights", unit="tensor",
              disable=not progress, leave=False) as bar, \
            closing(source.weights(model)) as weights:
        for name, reader in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name.endswith((".k_scale", ".v_scale")):
                kv_scales[_scale_key(name)] = float(reader.get_tensor(name).float().max())
                continue
            pname, shard = _target(model, name)
            if pname not in params:
                if model.load_extra(name, reader, loaded):
                    continue
                if quant is not None and name.rsplit(".", 1)[-1] in quant.tensor_names:
                    raise ValueError(
                        f"checkpoint tensor {name} is INT4 ({quant.method}) but kvserve loads "
                        f"module {name.rsplit('.', 1)[0]} dense: quantization_config does not "
                        "quantize it (listed in 'ignore' / not in 'targets'), or kvserve has "
                        "no INT4 path for it (e.g. an MoE router gate)")
                logger.warning("ignoring checkpoint tensor %s (no such parameter)", name)
                continue
            param = params[pname]
            tensor = reader.read(name, *_rank_slice(model, pname, shard))
            if not getattr(param, "keep_dtype", False):
                tensor = tensor.to(param.dtype)
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add((pname, shard))
            bar.update(1)
    missing = [hf for key, hf in expected.items() if key not in loaded]
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensor(s): {', '.join(missing[:8])}"
                         + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    source.finish(model, dtype, device, act_terms)
    finish_int4_modules(model, dtype, device, int4_kernel)  # INT4 and packed GGUF modules
    if storage != dtype:
        n = narrow_dense_weights(model, storage)
        packed = pack_dense_weights(model)
        logger.info("%d dense weight table(s) kept %s (%d packed in the CPU GEMM's tiles), "
                    "computed in %s", n, dtype_name(storage), packed, dtype_name(dtype))
    model.eval()
    source.loaded(model, weight_bytes(model)[0])
    return LoadedModel(model, hf_config, arch, dtype, _scales_tensor(kv_scales, hf_config),
                       source.folder, source.files(), storage)


def checkpoint_dtypes(folder: str, ggml: GGUFCheckpoint | None, hf_config,
                      dtype: str | torch.dtype, device: str) -> ModelDtypes:
    """``dtype`` resolved for the checkpoint in ``folder`` (``model_source``) from its config
    and safetensors headers: no weight is read."""
    n_params = None if ggml else checkpoint_params(folder)
    return model_dtypes(dtype, checkpoint_dtype(hf_config), device, n_params)


def eos_token_ids(folder: str) -> tuple[int, ...]:
    """The end-of-sequence ids of the checkpoint in ``folder``: generation_config.json's,
    else config.json's (an int or a list), first occurrence kept."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = os.path.join(folder, name)
        if os.path.isfile(f):
            with open(f) as fh:
                eos = json.load(fh).get("eos_token_id")
            if isinstance(eos, int):
                ids.append(eos)
            elif isinstance(eos, list):
                ids.extend(int(e) for e in eos)
            if ids:
                break
    return tuple(dict.fromkeys(ids))


def model_dtypes(dtype: str | torch.dtype, ckpt: torch.dtype, device: str,
                 n_params: int | None) -> ModelDtypes:
    """``dtype`` resolved (kvserve.config.resolve_model_dtypes) for this process: whether the C
    kernel that multiplies fp32 activations by 16-bit weights (kvserve.kernels.cpu.w16_gemm) is
    built decides if a bf16 / fp16 checkpoint computed in fp32 keeps its weights 16-bit -- half
    the bytes a decode step reads."""
    from kvserve.kernels.cpu.w16_gemm import w16_library

    on_cpu = torch.device(device).type == "cpu"
    return resolve_model_dtypes(dtype, ckpt, device, n_params,
                                w16_kernel=on_cpu and w16_library() is not None)


def _dense_tables(model: CausalLM):
    """The modules whose weight table is a dense [out, in] matrix held 16-bit on CPU: dense
    linears and the token embedding, except the modules the model reads as a dense matrix
    itself (``int4_dense_modules``, e.g. MLA's kv_b_proj). A tied head's table comes twice."""
    keep = set(model.int4_dense_modules)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in keep and isinstance(
                module, (Linear, MergedLinear, VocabParallelEmbedding)):
            yield module


def narrow_dense_weights(model: CausalLM, storage: torch.dtype) -> int:
    """Cast the weight tables of dense linears and the token embedding to ``storage`` (16-bit,
    exact: they were loaded from a ``storage`` checkpoint). Biases, norms, MoE experts and the
    modules the model reads as a dense matrix (``int4_dense_modules``, e.g. MLA's kv_b_proj)
    keep the compute dtype. A tied LM head shares the embedding's table, so it is cast once.
    Returns the number of tables cast."""
    n = 0
    for module in _dense_tables(model):
        if isinstance(module, VocabParallelEmbedding):
            module.out_dtype = module.weight.dtype
        w = module.weight
        if w.dtype == torch.float32 and w.device.type == "cpu":
            w.data = w.data.to(storage)
            n += 1
    return n


def pack_dense_weights(model: CausalLM) -> int:
    """Repack the 16-bit CPU tables that ``narrow_dense_weights`` left (dense linears, the
    token embedding, a tied head once) into the 16-bit GEMM's tiles (kvserve.quant.w16: a
    batch-1 step streams them ~1.3x faster, same results; the bf16 dot products of
    ``--cpu-bf16-dot-rows`` read the same tiles). Not when the GEMM is not built. Returns the
    number of tables packed."""
    from kvserve.kernels.cpu import w16_gemm

    lib = w16_gemm.w16_library()
    if lib is None:
        return 0
    n = 0
    for module in _dense_tables(model):
        w = module.weight
        if not can_pack(w, w16_gemm.packing_for(lib, w)[1]):  # (a tied table: packed already)
            continue
        w16_gemm.pack_weight(lib, w)
        n += 1
    return n


def _rank_slice(model: torch.nn.Module, pname: str, shard: str | None
                ) -> tuple[ShardSlice | None, bool]:
    """(this rank's slice of the checkpoint tensor for ``pname`` / ``shard``, whether it is a
    bias) for ``TensorReader.read``. Tensor parallel: a dense column / row parallel weight (or
    bias) is read as this rank's slice only (safetensors ``get_slice``: the other ranks' rows
    are never read); everything else (tp = 1, replicated, vocabulary tables, INT4 parts) is
    read whole (slice None)."""
    if get_tp_size() > 1:
        mod_name, _, attr = pname.rpartition(".")
        module = model.get_submodule(mod_name) if mod_name else model
        if isinstance(module, (Linear, MergedLinear)) and not isinstance(module, ParallelLMHead):
            sl = module.tp_plan.get(shard)
            if sl is not None:
                return sl, attr == "bias"
    return None, False


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes the model's weights hold now, bytes the same weights take in bf16). INT4
    modules count their packed nibbles, scales and zero points; tied tensors count once."""
    from kvserve.layers.int4.gguf_linear import GGUFLinear
    from kvserve.layers.q8_embedding import Q8Embedding

    held = bf16 = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (Int4MergedLinear, GGUFLinear)):
            held += module.weight_bytes()
            bf16 += 2 * module.in_features * sum(module.out_sizes)
            seen.update(id(t) for t in module.parameters())
        elif isinstance(module, Q8Embedding):
            held += module.weight_bytes()
            bf16 += 2 * module.dense_numel()
            seen.update(id(t) for t in module.parameters())
    for t in model.parameters():  # dense weights (buffers are rope tables etc.)
        if id(t) in seen or not t.is_floating_point() or t.dim() < 1:
            continue
        seen.add(id(t))
        held += t.numel() * t.element_size()  # a packed table's padding rows included
        tiles = tiles_of(t)
        bf16 += 2 * (t.numel() if tiles is None else tiles.rows * tiles.cols)
    return held, bf16


def describe_weight_bytes(model: torch.nn.Module) -> str:
    held, bf16 = weight_bytes(model)
    return (f"weights resident {held / 2**20:.1f} MiB (the same weights in bf16: "
            f"{bf16 / 2**20:.1f} MiB)")


def export_gguf_to_hf(path: str, out: str, dtype: torch.dtype = torch.bfloat16,
                      progress: bool = True) -> str:
    """Write a GGUF file as an HF folder: every tensor dequantized (``gguf.quants``) and cast
    to ``dtype``, q/k rows un-permuted, config + tokenizer from the metadata. What
    ``kvserve quantize --weights bf16`` does, and the input of an int4 re-quantization."""
    import shutil

    from safetensors.torch import save_file

    ckpt = gguf.GGUFCheckpoint(path)
    hf_config, arch = load_hf_config(ckpt.metadata_dir)
    with torch.device("meta"):
        model = registry.resolve(arch)(hf_config)
    expected = expected_tensors(model, dict(model.named_parameters(remove_duplicate=False)))
    name_map = ckpt.name_map(list(expected.values()), hf_config.num_hidden_layers)
    tensors = {}
    for name, t in tqdm(ckpt.iter_tensors(name_map, set(), hf_config), total=len(name_map),
                        desc="Dequantizing GGUF", unit="tensor", disable=not progress):
        tensors[name] = t.to(dtype).contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(ckpt.metadata_dir):
        if name != "config.json":
            shutil.copy(os.path.join(ckpt.metadata_dir, name), out)
    hf_config.dtype = dtype
    hf_config.save_pretrained(out)
    return out


def materialize(model: torch.nn.Module, device: str) -> None:
    """Replace meta parameters with uninitialized real ones, keeping their attributes
    (``weight_loader`` etc.; ``Module.to_empty`` would drop them)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
            new.__dict__.update(p.__dict__)
            module._parameters[name] = new
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)


def _scale_key(name: str) -> tuple[int, int]:
    parts = name.split(".")
    layer = next(int(p) for p in parts if p.isdigit())
    return layer, 0 if name.endswith("k_scale") else 1


def _scales_tensor(scales: dict[tuple[int, int], float], hf_config) -> torch.Tensor | None:
    if not scales:
        return None
    n = hf_config.num_hidden_layers
    t = torch.ones(n, 2)
    for (layer, c), v in scales.items():
        t[layer, c] = v
    return t


def load_tokenizer(path: str):
    """The tokenizer of an HF folder, or of a GGUF file (from its converted metadata)."""
    from transformers import AutoTokenizer

    path = model_source(path)[0]
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e
