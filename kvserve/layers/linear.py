"""Dense linear layers whose parameters own their weight loading.

``MergedLinear`` fuses several checkpoint tensors (q/k/v or gate/up) into one GEMM; the loader
calls ``param.weight_loader(param, tensor, shard_id)`` and the parameter copies the shard into
its slice of the fused weight:

    weight [sum(out_sizes), in]     rows [off_i, off_i + out_sizes[i]) <- checkpoint shard i
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _param(shape: tuple[int, ...], loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features), default_weight_loader)
        self.bias = _param((out_features,), default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(nn.Module):
    """One GEMM for several projections; ``shard_ids`` name them (e.g. ("q", "k", "v"))."""

    def __init__(
        self,
        in_features: int,
        out_sizes: tuple[int, ...],
        shard_ids: tuple[str, ...],
        bias: bool = False,
    ) -> None:
        super().__init__()
        assert len(out_sizes) == len(shard_ids)
        self.in_features = in_features
        self.out_sizes = out_sizes
        self.shard_ids = shard_ids
        self.offsets = {s: sum(out_sizes[:i]) for i, s in enumerate(shard_ids)}
        self.sizes = dict(zip(shard_ids, out_sizes, strict=True))
        self.weight = _param((sum(out_sizes), in_features), self._load)
        self.bias = _param((sum(out_sizes),), self._load) if bias else None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        off, size = self.offsets[shard_id], self.sizes[shard_id]
        dst = param.data.narrow(0, off, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"shard {shard_id!r}: expected {tuple(dst.shape)}, "
                             f"got {tuple(loaded.shape)}")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
