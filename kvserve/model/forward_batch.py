"""The explicit per-step state every model forward receives (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.layers.lora import LoRAStep


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    attn: AttentionBackend
    lora: LoRAStep | None = None  # each token row's adapter slot (None: no LoRA this step)
