"""Checkpoint sources: where a model's config and weights come from (kvserve.model.loader reads
every checkpoint through one of these, with one loop).

* ``SafetensorsSource``: an HF folder (config.json, single or sharded ``*.safetensors``, the
  tokenizer files) with its own ``quantization_config`` (INT4 checkpoints).
* ``GGUFSource``: a ``.gguf`` file (kvserve.model.gguf): config and tokenizer converted once to
  an HF folder; tensors renamed to HF names, Q4_0 / Q4_1 weights kept packed (the file's types
  decide which linears load as INT4), the rest dequantized; on the CPU a Q8_0 embedding / LM
  head stays 8-bit after loading.

A source yields ``(checkpoint name, reader)`` pairs: the reader reads that tensor whole
(``get_tensor(name)``) or only this rank's slice of it (``read(name, slice, is_bias)``), so the
loader and the models' ``load_extra`` hooks (MoE experts) never ask which kind of file it is.
A source is used once, in this order: ``config``, ``prepare``, ``weights``, ``finish``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors import safe_open

from kvserve.distributed.parallel_state import get_tp_size
from kvserve.layers.linear import Linear
from kvserve.model import gguf, registry
from kvserve.model.gguf import GGUFCheckpoint, GGUFQuant
from kvserve.model.interface import CausalLM
from kvserve.model.quant_config import QuantConfig, parse_quant_config

if TYPE_CHECKING:
    from kvserve.layers.linear import ShardSlice

logger = logging.getLogger(__name__)


class TensorReader(Protocol):
    def get_tensor(self, name: str) -> torch.Tensor:
        """Checkpoint tensor ``name``, whole."""
        ...

    def read(self, name: str, rank_slice: ShardSlice | None, is_bias: bool) -> torch.Tensor:
        """``name`` for this rank: ``rank_slice`` of it (None: whole). A reader that cannot
        read a part may return the whole tensor: the parameter's weight_loader then takes
        the slice (``ShardSlice.take`` passes a tensor already sliced as is)."""
        ...


class CheckpointSource(Protocol):
    folder: str  # config.json + tokenizer files (a GGUF's converted metadata)

    def config(self) -> tuple[Any, str]:
        """(HF config, architecture); errors in the checkpoint's own quantization config
        surface here too."""
        ...

    def n_params(self) -> int | None:
        """Parameter count from the file headers (no weight read), or None if unknown."""
        ...

    def prepare(self, model: CausalLM, act_terms: int) -> QuantConfig | None:
        """Which linear modules load as INT4 (None: all dense), for ``model`` as built on the
        meta device (before any module is swapped). A GGUF source swaps its packed modules in
        itself and returns None."""
        ...

    def weights(self, model: CausalLM) -> Iterator[tuple[str, TensorReader]]:
        """Every checkpoint tensor's name (HF naming) and a reader for it."""
        ...

    def finish(self, model: CausalLM, dtype: torch.dtype, device: str, act_terms: int) -> None:
        """After every tensor is in: what the source changes on the loaded model."""
        ...

    def loaded(self, model: CausalLM, resident: int) -> None:
        """The model is ready (``resident``: its weight bytes): the source's start-up log."""
        ...

    def files(self) -> tuple[str, ...]:
        """The files the weights came from."""
        ...


# ---- HF folders -----------------------------------------------------------------------------


def load_hf_config(path: str):
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise ValueError(f"model must be a local HF folder; {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model folder {path!r} has no config.json")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{path}/config.json names no 'architectures'")
    registry.resolve(archs[0])  # fail fast, naming the architecture, before transformers
    return AutoConfig.from_pretrained(path, local_files_only=True), archs[0]


def raw_quantization_config(path: str) -> dict | None:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("quantization_config")


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r}")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"checkpoint shard(s) missing from {path!r}: {', '.join(missing)}")
    return [os.path.join(path, f) for f in files]


def checkpoint_params(path: str) -> int | None:
    """Parameter count from the safetensors headers (no tensor is read)."""
    total = 0
    try:
        for file in safetensors_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    n = 1
                    for d in f.get_slice(name).get_shape():
                        n *= d
                    total += n
    except (OSError, ValueError):
        return None
    return total


class SafetensorsFile:
    """Reader over one open safetensors file: a rank's slice is read with ``get_slice`` (the
    other ranks' rows are never read)."""

    __slots__ = ("handle",)

    def __init__(self, handle) -> None:
        self.handle = handle  # safe_open(...)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(name)

    def read(self, name: str, rank_slice: ShardSlice | None, is_bias: bool) -> torch.Tensor:
        if rank_slice is None:
            return self.handle.get_tensor(name)
        return rank_slice.read(self.handle, name, is_bias=is_bias)


class SafetensorsSource:
    """An HF folder of ``*.safetensors`` weights (its index names the shards, if sharded)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._quant: QuantConfig | None = None

    def config(self) -> tuple[Any, str]:
        hf_config, arch = load_hf_config(self.folder)
        self._quant = parse_quant_config(raw_quantization_config(self.folder))
        return hf_config, arch

    def n_params(self) -> int | None:
        return checkpoint_params(self.folder)

    def prepare(self, model: CausalLM, act_terms: int) -> QuantConfig | None:
        return self._quant

    def weights(self, model: CausalLM) -> Iterator[tuple[str, TensorReader]]:
        for file in safetensors_files(self.folder):
            with safe_open(file, framework="pt", device="cpu") as f:
                reader = SafetensorsFile(f)
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, reader

    def finish(self, model: CausalLM, dtype: torch.dtype, device: str, act_terms: int) -> None:
        return None

    def loaded(self, model: CausalLM, resident: int) -> None:
        return None

    def files(self) -> tuple[str, ...]:
        return tuple(safetensors_files(self.folder))


# ---- GGUF files -----------------------------------------------------------------------------


class WholeTensor:
    """Reader of one tensor already read whole (a GGUF tensor: dequantized, or raw Q4 blocks);
    a rank's slice is taken by the parameter's weight_loader."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensor

    def read(self, name: str, rank_slice: ShardSlice | None, is_bias: bool) -> torch.Tensor:
        return self.tensor


class GGUFSource:
    """A ``.gguf`` file. Its tensor names map to the HF names the model expects (``prepare``);
    linear modules whose every shard has a packed type (``GGML_TYPES``) keep their blocks
    (``GGUFQuant`` swaps in ``GGUFLinear``); the rest load dense."""

    def __init__(self, ckpt: GGUFCheckpoint) -> None:
        self.ckpt = ckpt
        self.folder = ckpt.metadata_dir
        self.hf_config: Any = None
        self.name_map: dict[str, str] = {}  # GGUF name -> HF name

    def config(self) -> tuple[Any, str]:
        self.hf_config, arch = load_hf_config(self.folder)
        return self.hf_config, arch

    def n_params(self) -> int | None:
        return None

    def prepare(self, model: CausalLM, act_terms: int) -> None:
        """Swaps the packed modules in itself (``GGUFLinear``); nothing for the INT4 pass."""
        dense = expected_tensors(model, dict(model.named_parameters(remove_duplicate=False)))
        self.name_map = self.ckpt.name_map(list(dense.values()),
                                           self.hf_config.num_hidden_layers)
        quant = GGUFQuant(self.ckpt, self.name_map, act_terms)
        n = quant.swap(model)
        if n:
            logger.info("%s: %d linear module(s) keep their blocks (%s)",
                        os.path.basename(self.ckpt.path), n, quant.describe())
        return None

    def weights(self, model: CausalLM) -> Iterator[tuple[str, TensorReader]]:
        packed = set(ggml_packed_modules(model))
        for name, tensor in self.ckpt.iter_tensors(self.name_map, packed, self.hf_config):
            yield name, WholeTensor(tensor)

    def finish(self, model: CausalLM, dtype: torch.dtype, device: str, act_terms: int) -> None:
        self.kept_q8: set[str] = set()
        if torch.device(device).type == "cpu":
            self.kept_q8 = keep_q8_tables(model, self.ckpt, self.name_map, dtype, act_terms)

    def loaded(self, model: CausalLM, resident: int) -> None:
        self.ckpt.log_types(resident, getattr(self, "kept_q8", set()))

    def files(self) -> tuple[str, ...]:
        return (self.ckpt.path,)


def model_source(path: str) -> tuple[str, GGUFCheckpoint | None]:
    """(folder holding config.json and the tokenizer, the GGUF file or None) for ``path``."""
    if gguf.is_gguf(path):
        ckpt = gguf.GGUFCheckpoint(path)
        return ckpt.metadata_dir, ckpt
    if os.path.isfile(path):
        raise ValueError(f"model {path!r} is a file but not a .gguf file; give a GGUF file or "
                         "an HF folder (config.json + *.safetensors)")
    return path, None


def open_checkpoint(path: str) -> CheckpointSource:
    """The source of checkpoint ``path``: a ``.gguf`` file or an HF folder."""
    folder, ggml = model_source(path)
    return GGUFSource(ggml) if ggml is not None else SafetensorsSource(folder)


def expected_tensors(model: CausalLM, params) -> dict[tuple[str, str | None], str]:
    """(our param, shard) -> the checkpoint name we expect for it."""
    inverse: dict[str, list[tuple[str, str]]] = {}
    for ckpt, (fused, shard) in model.packed_modules.items():
        inverse.setdefault(fused, []).append((ckpt, shard))
    tied = model.tie_word_embeddings
    out: dict[tuple[str, str | None], str] = {}
    for pname, param in params.items():
        if tied and pname == "lm_head.weight":
            continue
        if getattr(param, "skip_expected", False):
            continue
        parts = pname.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module in inverse:
            for ckpt, shard in inverse[module]:
                out[(pname, shard)] = ".".join(parts[:-2] + [ckpt, parts[-1]])
        else:
            out[(pname, None)] = pname
    return out


def ggml_packed_modules(model: CausalLM) -> list[str]:
    """Checkpoint module names (``model.layers.0.self_attn.q_proj``) whose weight the model
    holds as raw GGUF blocks (shards of a ``GGUFLinear``)."""
    from kvserve.layers.int4.gguf_linear import GGUFLinear

    out = []
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            out.extend(module.shard_names.values())
    return out


def keep_q8_tables(model: torch.nn.Module, ckpt: GGUFCheckpoint, name_map: dict[str, str],
                   dtype: torch.dtype, act_terms: int = 2) -> set[str]:
    """A Q8_0 token embedding (and a Q8_0 ``output`` LM head) stays 8-bit after loading: the
    dense weights just loaded are replaced by ``Q8Embedding`` / ``Q8LMHead`` over the file's
    own blocks (the same values: d * q is exact in fp32, checked here for fp32 models). A
    tied LM head reads the embedding's tensors. Returns the GGUF names of the tables kept."""
    from kvserve.layers.q8_embedding import Q8Embedding, Q8LMHead
    from kvserve.quant.gguf_q8 import dequantize_q8, unpack_q8_0

    by_hf = {hf: g for g, hf in name_map.items()}

    def table(hf_name: str, dense: torch.Tensor) -> Q8Embedding | None:
        g = by_hf.get(hf_name)
        if g is None or ckpt.type_of(g) != "Q8_0" or dense.dim() != 2:
            return None
        q, d = unpack_q8_0(ckpt.tensors[g].data, tuple(dense.shape))
        if dense.dtype == torch.float32:
            assert torch.equal(dequantize_q8(q, d), dense), hf_name  # exact, as documented
        return Q8Embedding(q, d, dense.dtype, act_terms)

    kept: set[str] = set()
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    weight = getattr(embed, "weight", None)
    if get_tp_size() > 1 or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return set()  # vocabulary-parallel shards (tp > 1): left as loaded
    tied = isinstance(head, Linear) and head.weight is weight
    emb = table("model.embed_tokens.weight", weight.detach())
    if emb is not None:
        model.model.embed_tokens = emb
        kept.add(by_hf["model.embed_tokens.weight"])
        if tied:
            model.lm_head = Q8LMHead(emb)
    if not tied and isinstance(head, Linear):  # an INT4 head stays as it is
        out = table("lm_head.weight", head.weight.detach())
        if out is not None and head.bias is None:
            model.lm_head = Q8LMHead(out)
            kept.add(by_hf["lm_head.weight"])
    return kept
