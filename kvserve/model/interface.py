"""What the engine and the loader may ask of a model: the ``CausalLM`` Protocol, its typed
``KVSpec``, and ``CausalLMBase`` with the hooks' defaults (a model overrides what it needs;
nobody probes with ``hasattr``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from kvserve.distributed.parallel_state import get_tp_rank, get_tp_size
from kvserve.model.forward_batch import ForwardBatch


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What the KV cache and the attention backend need to know about a model (this rank's
    heads under tensor parallelism)."""

    num_layers: int
    num_heads: int  # query heads of this rank
    num_kv_heads: int  # cache rows per token and layer of this rank (1 for an MLA latent)
    head_dim: int  # cache row width (kv_lora_rank + rope dim for MLA)
    components: int  # 2: K and V; 1: one MLA latent row
    scale: float  # softmax scale
    max_position_embeddings: int
    sliding_window: int | None = None
    kv_lora_rank: int | None = None  # MLA: the row is [c_kv (kv_lora_rank) | k_pe (rope dim)]
    # Per layer: 0 (full causal attention) or the sliding window that layer reads (Gemma 3's
    # local layers); empty: every layer full. Unlike ``sliding_window`` it does not bound the
    # context: the full layers attend over all of it.
    layer_windows: tuple[int, ...] = ()

    @property
    def context_len(self) -> int:
        """The longest context the model attends over."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


class CausalLM(Protocol):
    config: Any  # the HF config
    # checkpoint module name -> (our fused module, shard id)
    packed_modules: ClassVar[dict[str, tuple[str, str]]]
    # modules read as a dense matrix: an INT4 checkpoint's copy is dequantized at load
    int4_dense_modules: ClassVar[tuple[str, ...]]
    tie_word_embeddings: bool

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...  # hidden states [T, hidden]
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...  # [N, V] fp32
    def kv_spec(self) -> KVSpec: ...  # this rank's (``spec_for`` this rank's config)
    @classmethod
    def spec_for(cls, config: Any, tp_size: int = 1, tp_rank: int = 0) -> KVSpec: ...
    def tie_weights(self) -> None: ...  # after materializing, before loading

    def fold_kv_rotation(self, rotation) -> None:
        """MLA with a rotated KV mode: fold the latent's rotation into the up-projection once
        (kvserve/quant/rotation.py); the worker calls it when ``kv_spec().kv_lora_rank`` is
        set."""
        ...

    def load_extra(self, name: str, handle, loaded: set) -> bool:
        """Load a checkpoint tensor that maps to no parameter (e.g. per-expert tensors into
        stacked experts) through ``handle.get_tensor(name)`` (a ``TensorReader`` of
        kvserve.model.sources); False if it is not the model's."""
        ...


class CausalLMBase(nn.Module):
    """The hooks' defaults: nothing packed, nothing kept dense, no extra tensors; tied
    embeddings share ``model.embed_tokens.weight`` with ``lm_head``."""

    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {}
    int4_dense_modules: ClassVar[tuple[str, ...]] = ()
    tie_word_embeddings: bool = False

    @classmethod
    def spec_for(cls, config: Any, tp_size: int = 1, tp_rank: int = 0) -> KVSpec:
        """The KV spec of tensor-parallel rank ``tp_rank`` of ``tp_size``, from the HF config
        alone (no weights): the builder settles it before any worker starts."""
        raise NotImplementedError

    def kv_spec(self) -> KVSpec:
        """This rank's spec: ``spec_for`` this model's config and this process's TP rank."""
        return type(self).spec_for(self.config, get_tp_size(), get_tp_rank())

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_extra(self, name: str, handle, loaded: set) -> bool:
        return False

    def fold_kv_rotation(self, rotation) -> None:
        raise ValueError(f"{type(self).__name__} has no latent up-projection to fold a KV "
                         "rotation into")
