"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package.

* **Metadata** -> an HF folder: transformers' GGUF conversion makes the config and the tokenizer
  (vocabulary, merges, special tokens, chat template) once per file; they are written to
  ``~/.cache/kvserve/gguf/<key>/`` (key: the file's path, size and mtime) so later starts read
  plain ``config.json`` / ``tokenizer.json`` in milliseconds instead of re-parsing the file.
* **Tensors** -> HF names through ``gguf``'s own tensor-name map for the architecture, then the
  model's per-parameter ``weight_loader`` as for safetensors (kvserve.model.sources.GGUFSource,
  then kvserve.model.loader). How each ggml type loads is one table,
  ``kvserve.layers.int4.gguf_types.GGML_TYPES``: F32 / F16 / BF16 as stored; packed types
  (Q4_0, Q4_1, Q8_0, and what else is registered there) keep a linear module's raw blocks
  (``GGUFLinear``, when every shard of the fused module is a packed type); every other tensor
  is dequantized by ``gguf.quants.dequantize`` to fp32, then cast to the compute dtype. A type
  gguf cannot read is a ValueError naming the type and the tensor. The start-up log names each
  type, its count and its path, and the resident weight bytes against the file's.
* **Rope permutation**: llama.cpp's converter permutes the rows of q_proj / k_proj of Llama and
  Mistral checkpoints (``LlamaModel.permute``: per head, the two rotary halves interleaved).
  Undone here on whole rows, which is exact for quantized rows too (a block never spans rows);
  checked against transformers' own GGUF loading in tests/model/test_gguf.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

logger = logging.getLogger(__name__)

# general.architecture -> (HF architecture, q/k rows permuted by convert_hf_to_gguf.py).
# llama.cpp writes Mistral checkpoints as "llama"; "mistral" is read for other writers.
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
}
AS_IS_TYPES = ("F32", "F16", "BF16")
_CACHE_VERSION = "1"


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def _cache_root() -> str:
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")),
                        "kvserve", "gguf")


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str  # GGUF name, e.g. blk.0.attn_q.weight
    type: str  # ggml type name: Q4_1, F32, ...
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order ([out, in] for a matrix)
    data: np.ndarray  # as the reader maps it (raw blocks for quantized types)


class GGUFCheckpoint:
    """One ``.gguf`` file: metadata folder, tensor table, HF-name mapping."""

    def __init__(self, path: str) -> None:
        if not is_gguf(path):
            raise ValueError(f"model {path!r} is not a .gguf file")
        self.path = os.path.realpath(path)
        try:
            self.gguf_arch, self.tensors = _read_table(self.path)
        except Exception as e:  # noqa: BLE001 - the readers raise several types on bad files
            raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e
        if self.gguf_arch not in ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.gguf_arch!r} ({path}) is not supported; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        self.architecture, self.permuted_qk = ARCHITECTURES[self.gguf_arch]
        from kvserve.layers.int4.gguf_types import path_of

        for t in self.tensors.values():
            try:
                path_of(t.qtype, t.name)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None

    # ---------------------------------------------------------------- metadata

    @cached_property
    def metadata_dir(self) -> str:
        """A folder with config.json and the tokenizer files, made once per file version."""
        st = os.stat(self.path)
        key = hashlib.sha256(f"{_CACHE_VERSION}|{self.path}|{st.st_size}|{st.st_mtime_ns}"
                             .encode()).hexdigest()[:20]
        out = os.path.join(_cache_root(), key)
        if os.path.isfile(os.path.join(out, "config.json")):
            return out
        logger.info("converting GGUF metadata (config, tokenizer, chat template) of %s once "
                    "into %s", os.path.basename(self.path), out)
        from transformers import AutoConfig, AutoTokenizer

        register_with_transformers()
        folder, name = os.path.split(self.path)
        tmp = out + f".tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            if self.gguf_arch == "gemma3":
                _gemma3_config(config, self.path)
            config.architectures = [self.architecture]
            config.dtype = self.compute_dtype_name()
            config.save_pretrained(tmp)
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            tok.save_pretrained(tmp)
            with open(os.path.join(tmp, "gguf_source.json"), "w") as f:
                json.dump({"gguf": self.path, "architecture": self.gguf_arch}, f)
        except Exception as e:
            raise ValueError(f"transformers could not convert the metadata of {self.path}: "
                             f"{e}") from e
        os.makedirs(os.path.dirname(out), exist_ok=True)
        try:
            os.replace(tmp, out)
        except OSError:  # another process made it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        return out

    def compute_dtype_name(self) -> str:
        """The checkpoint dtype for ``dtype=auto``: the matrices' float type, or bfloat16 for
        quantized files (the dtype llama.cpp's converter starts from)."""
        kinds = Counter(t.type for t in self.tensors.values() if len(t.shape) == 2)
        top = kinds.most_common(1)[0][0] if kinds else "F32"
        return {"F32": "float32", "F16": "float16"}.get(top, "bfloat16")

    # ---------------------------------------------------------------- tensors

    def name_map(self, hf_names: list[str], num_layers: int) -> dict[str, str]:
        """GGUF tensor name -> HF checkpoint name, for the HF names the model expects."""
        import gguf

        names = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        arch = names.get(self.gguf_arch, gguf.MODEL_ARCH.LLAMA)  # "mistral": llama's tensors
        tmap = gguf.get_tensor_name_map(arch, num_layers)
        out: dict[str, str] = {}
        for hf in hf_names:
            base, _, suffix = hf.rpartition(".")
            g = tmap.get_name(base)
            if g is not None:
                out[f"{g}.{suffix}"] = hf
        return out

    def type_of(self, gguf_name: str) -> str | None:
        t = self.tensors.get(gguf_name)
        return t.type if t is not None else None

    def qk_row_perm(self, hf_name: str, hf_config) -> torch.Tensor | None:
        """Row order that undoes llama.cpp's q/k permutation for ``hf_name`` (None: none).

        convert_hf_to_gguf's ``permute`` views [heads, 2, dim/2, ...] rows as [heads, dim/2, 2]:
        GGUF row h*dim + 2i + j holds HF row h*dim + j*dim/2 + i. The inverse gathers those.
        """
        if not self.permuted_qk:
            return None
        if hf_name.endswith("q_proj.weight") or hf_name.endswith("q_proj.bias"):
            heads = hf_config.num_attention_heads
        elif hf_name.endswith("k_proj.weight") or hf_name.endswith("k_proj.bias"):
            heads = hf_config.num_key_value_heads or hf_config.num_attention_heads
        else:
            return None
        rows = heads * _head_dim(hf_config)
        # hf row (h, j, i) lives at gguf row (h, i, j)
        idx = torch.arange(rows).view(heads, -1, 2).transpose(1, 2).reshape(rows)
        return idx

    def iter_tensors(self, name_map: dict[str, str], packed: set[str], hf_config,
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every mapped GGUF tensor. Names in ``packed`` (HF module
        names whose weight stays in the file's blocks) come as ``<module>.gguf_blocks``: uint8
        [out, blocks * block bytes] of raw blocks; everything else as a float tensor.
        ``self.paths`` then holds each GGUF tensor's path ("as stored", "packed",
        "dequantized") for the start-up log."""
        from gguf.quants import dequantize

        unknown = sorted(n for n in self.tensors if n not in name_map
                         and not n.startswith("rope_freqs"))
        if unknown:
            raise ValueError(f"{self.path}: GGUF tensor(s) kvserve has no parameter for: "
                             f"{', '.join(unknown[:8])}" + (" ..." if len(unknown) > 8 else ""))
        self.paths: dict[str, str] = {}
        for gname, t in self.tensors.items():
            hf = name_map.get(gname)
            if hf is None:
                continue
            module = hf.rpartition(".")[0]
            perm = self.qk_row_perm(hf, hf_config)
            if module in packed and hf.endswith(".weight"):
                raw = torch.from_numpy(np.array(t.data)).view(t.shape[0], -1)  # a copy: the
                # reader's arrays map the file read-only
                if perm is not None:
                    raw = raw.index_select(0, perm)
                self.paths[gname] = "packed"
                yield f"{module}.gguf_blocks", raw
                continue
            if t.type in AS_IS_TYPES:
                arr = np.array(t.data)  # a writable copy of the read-only mapping
                tensor = torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16) \
                    if t.type == "BF16" else torch.from_numpy(arr)
                self.paths[gname] = "as stored"
            else:
                try:
                    tensor = torch.from_numpy(dequantize(t.data, t.qtype))
                except Exception as e:  # noqa: BLE001 - gguf raises several types
                    raise ValueError(f"{self.path}: cannot dequantize GGUF tensor {gname!r} of "
                                     f"ggml type {t.type}: {e}") from e
                self.paths[gname] = "dequantized"
            tensor = tensor.reshape(t.shape)
            if self.gguf_arch == "gemma3" and hf.endswith("norm.weight"):
                tensor = tensor - 1  # llama.cpp stores Gemma's (1 + w); the checkpoint's w
            if perm is not None:
                tensor = tensor.index_select(0, perm)
            yield hf, tensor

    def tensor_bytes(self) -> int:
        """Bytes of every tensor in the file (as stored)."""
        return sum(int(np.asarray(t.data).nbytes) for t in self.tensors.values())

    def log_types(self, resident: int, kept_q8: set[str] = frozenset()) -> None:
        """The start-up log: each ggml type, its count and the path its tensors took (after
        ``iter_tensors``), and resident weight bytes against the file's tensor bytes.
        ``kept_q8``: GGUF names of Q8_0 tables kept 8-bit after loading."""
        from kvserve.layers.int4.gguf_types import GGML_TYPES

        paths: Counter[tuple[str, str]] = Counter()
        for gname, how in getattr(self, "paths", {}).items():
            t = self.tensors[gname]
            if gname in kept_q8:
                how = "kept Q8_0 (token embedding / LM head)"
            elif how != "as stored":
                how = f"{how} ({GGML_TYPES[t.qtype].kernel})" if how == "packed" else (
                    f"dequantized to the compute dtype (gguf.quants.dequantize"
                    f"{'' if len(t.shape) < 2 else '; no packed kernel for this type or shape'})")
            paths[(t.type, how)] += 1
        for (kind, how), n in sorted(paths.items()):
            logger.info("GGUF %s x%d: %s", kind, n, how)
        file_bytes = self.tensor_bytes()
        logger.info("GGUF weights: %.1f MB resident, %.2fx the file's %.1f MB of tensors",
                    resident / 1e6, resident / max(file_bytes, 1), file_bytes / 1e6)


def register_with_transformers() -> None:
    """Teach transformers' GGUF reader (``transformers.integrations.gguf.dequant``: block
    sizes, names, dequantizers) the ggml types it lacks but ``gguf`` reads (Q5_0, Q5_1, ...),
    with ``gguf.quants.dequantize`` as their dequantizer: its header reader (used here and for
    the metadata conversion) otherwise refuses a whole file that holds one such tensor, and
    its model loading (the parity reference) cannot dequantize them. Idempotent."""
    try:
        from transformers.integrations.gguf import dequant as tf
    except ImportError:  # an older transformers: gguf.GGUFReader is the fallback
        return
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import _type_traits

    readable = set(_type_traits)
    for qtype, size in GGML_QUANT_SIZES.items():  # sizes of every type: the header reads;
        # a type without a dequantizer is then refused by name (GGUFCheckpoint)
        if qtype.name in AS_IS_TYPES or int(qtype) in tf.GGML_BLOCK:
            continue
        tf.GGML_BLOCK[int(qtype)] = size
        tf.GGML_NAME[int(qtype)] = qtype.name
        if qtype in readable:
            tf._DEQUANT[int(qtype)] = _gguf_dequantizer(GGMLQuantizationType(qtype))


def _gguf_dequantizer(qtype):
    def dequant(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from gguf.quants import dequantize

        values = dequantize(blocks.cpu().numpy(), qtype)  # [blocks, weights per block]
        return torch.from_numpy(values).to(device=blocks.device, dtype=dtype)

    return dequant


def _gemma3_config(config, path: str) -> None:
    """What llama.cpp derives for ``gemma3`` instead of storing it (transformers' GGUF config
    leaves the HF defaults): the query scale 1/sqrt(head_dim) (1/sqrt(hidden / heads) for the
    62-layer 27B), the local layers' rope base 10,000, and the global layers' rope scaling
    from ``gemma3.rope.scaling.*`` when the file has it (4B and larger: linear, factor 8)."""
    import gguf

    head_dim = _head_dim(config)
    if config.num_hidden_layers == 62:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = head_dim
    params = dict(config.rope_parameters)
    params["sliding_attention"] = {"rope_type": "default", "rope_theta": 10000.0}
    fields = gguf.GGUFReader(path).fields
    factor = fields.get("gemma3.rope.scaling.factor")
    kind = fields.get("gemma3.rope.scaling.type")
    if factor is not None and float(factor.contents()) != 1.0:
        kind_name = kind.contents() if kind is not None else "linear"
        if kind_name != "linear":
            raise ValueError(f"{path}: gemma3 rope scaling {kind_name!r} is not supported")
        params["full_attention"] = {**params["full_attention"], "rope_type": "linear",
                                    "factor": float(factor.contents())}
    config.rope_parameters = params


def _read_table(path: str) -> tuple[str, dict[str, GGUFTensor]]:
    """(general.architecture, tensors by GGUF name) with each tensor's data memory-mapped.

    transformers' header reader (``GgufHeader``: metadata with string arrays left unread, the
    tensor table) takes milliseconds; ``gguf.GGUFReader`` parses every metadata array (9 s
    for a 49k-token vocabulary) and is the fallback for transformers versions without it."""
    from gguf import GGMLQuantizationType

    try:
        from transformers.integrations.gguf import GgufHeader
    except ImportError:
        GgufHeader = None  # noqa: N806
    register_with_transformers()
    if GgufHeader is not None:
        head = GgufHeader.from_file(path)
        blob = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = {}
        for info in head.tensors:
            try:
                qtype = GGMLQuantizationType(info.ggml_type)
            except ValueError:
                raise ValueError(f"GGUF tensor {info.name!r} has ggml type id {info.ggml_type}, "
                                 "which the installed gguf library does not know (a newer "
                                 "llama.cpp type?); kvserve cannot read it") from None
            start = head.data_start + info.offset
            raw = blob[start:start + info.nbytes]
            tensors[info.name] = GGUFTensor(info.name, qtype.name, qtype, tuple(info.shape),
                                            _typed(raw, qtype, info.shape))
        return head.architecture, tensors
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else "?"
    return arch, {t.name: GGUFTensor(t.name, t.tensor_type.name, t.tensor_type,
                                     tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
                  for t in reader.tensors}


def _typed(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> np.ndarray:
    """Raw bytes as the reader would give them: values for float types, else uint8 rows of
    blocks ([rows, bytes per row])."""
    name = qtype.name
    if name in ("F32", "F16"):
        return raw.view(np.float32 if name == "F32" else np.float16).reshape(shape)
    if name == "BF16":
        return raw.view(np.uint16).reshape(shape)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return raw.reshape(rows, -1)


def _head_dim(hf_config) -> int:
    hd = getattr(hf_config, "head_dim", None)
    return int(hd) if hd else hf_config.hidden_size // hf_config.num_attention_heads


class GGUFQuant:
    """Which linear modules of a GGUF file keep their blocks: every ``Linear`` /
    ``MergedLinear`` whose shards' types are all packed in ``GGML_TYPES`` becomes a
    ``GGUFLinear`` (``swap``); the rest load dense."""

    method = "gguf"
    tensor_names = ("gguf_blocks",)

    def __init__(self, ckpt: GGUFCheckpoint, name_map: dict[str, str],
                 act_terms: int = 2) -> None:
        self.types = {hf.rpartition(".")[0]: ckpt.tensors[g].qtype for g, hf in name_map.items()
                      if hf.endswith(".weight")}
        self.act_terms = act_terms
        self.swapped: Counter[str] = Counter()

    def swap(self, model) -> int:
        from kvserve.layers.int4.gguf_linear import swap_gguf_modules

        self.swapped = swap_gguf_modules(model, self.types.get, self.act_terms)
        return sum(self.swapped.values())

    def describe(self) -> str:
        return "GGUF packed " + ", ".join(f"{k} x{n}" for k, n in sorted(self.swapped.items()))
