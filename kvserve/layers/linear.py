"""Dense linear layers whose parameters own their weight loading.

``MergedLinear`` fuses several checkpoint tensors (q/k/v or gate/up) into one GEMM; the loader
calls ``param.weight_loader(param, tensor, shard_id)`` and the parameter copies the shard into
its slice of the fused weight:

    weight [sum(out_sizes), in]     rows [off_i, off_i + out_sizes[i]) <- checkpoint shard i

INT4 checkpoints swap these modules for ``kvserve.layers.int4.merged.Int4MergedLinear``, which
loads through the same ``weight_loader`` protocol and the same ``tp_plan`` (the INT4 home is
``kvserve/layers/int4/``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from kvserve.kernels.cpu import w16_gemm


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """This rank's part of a checkpoint weight [out, in]: ``size`` rows (dim 0, column
    parallel) or columns (dim 1, row parallel) from ``start``, of ``full``."""

    dim: int
    start: int
    size: int
    full: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The slice of a weight (any dim >= 1) or of a bias (1-D: only dim-0 slices apply).
        A tensor the loader already read sliced (``size`` long on ``dim``) passes as is."""
        if self.dim >= t.dim() or (t.shape[self.dim] == self.size != self.full):
            return t
        return t.narrow(self.dim, self.start, self.size)

    def read(self, handle, name: str, is_bias: bool = False) -> torch.Tensor:
        """Read only this slice of checkpoint tensor ``name`` from a safetensors handle."""
        sl = handle.get_slice(name)
        if is_bias and self.dim == 1:
            return sl[:]
        end = self.start + self.size
        return sl[self.start : end] if self.dim == 0 else sl[:, self.start : end]


# shard id -> this rank's slice (None: the whole tensor, tp=1 or replicated)
TPPlan = dict[str | None, ShardSlice | None]


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)


def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except for fp32 activations against a 16-bit CPU weight (a bf16 / fp16
    checkpoint kept 16-bit in memory and computed in fp32, see ``model.loader``): the C kernel
    reads the weight as 16-bit (kvserve.kernels.cpu.w16_gemm; fp32 result)."""
    if weight.dtype != x.dtype and w16_gemm.applies(x, weight):
        return w16_gemm.linear_w16(x, weight, bias)
    return F.linear(x, weight, bias)


def _param(shape: tuple[int, ...], loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class Linear(nn.Module):
    # Tensor parallelism (the subclasses below): this rank's slice of each checkpoint shard,
    # the checkpoint's [out, in] per shard, and whether outputs are partial sums (row parallel:
    # all-reduced, then the bias added once).
    tp_plan: TPPlan = {None: None}
    reduce_results = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.full_in, self.full_out_sizes = in_features, (out_features,)
        self.weight = _param((out_features, in_features), self._load)
        self.bias = _param((out_features,), self._load) if bias else None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        sl = self.tp_plan[None]
        if sl is not None and not (param is self.bias and sl.dim == 1):
            loaded = sl.take(loaded)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """Output rows split over the TP ranks: y_r = x W_r^T (+ b_r); no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp, r = get_tp_size(), get_tp_rank()
        per = out_features // tp
        super().__init__(in_features, per, bias)
        self.full_out_sizes = (out_features,)
        self.tp_plan = {None: ShardSlice(0, r * per, per, out_features) if tp > 1 else None}


class RowParallelLinear(Linear):
    """Input columns split over the TP ranks: y = all_reduce(x_r W_r^T) + b (bias once).
    ``reduce_results=False`` (vLLM's name): return the partial sum x_r W_r^T; the caller
    reduces once after summing several of them (an MoE layer's experts). No bias then."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 reduce_results: bool = True) -> None:
        if bias and not reduce_results:
            raise ValueError("RowParallelLinear: bias needs reduce_results=True (a bias added "
                             "to every rank's partial sum would be counted tp times)")
        tp, r = get_tp_size(), get_tp_rank()
        per = in_features // tp
        super().__init__(per, out_features, bias)
        self.reduce_results = reduce_results
        self.full_in = in_features
        self.tp_plan = {None: ShardSlice(1, r * per, per, in_features) if tp > 1 else None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1 or not self.reduce_results:
            return dense_linear(x, self.weight, self.bias)
        y = tp_all_reduce(dense_linear(x, self.weight))  # [T, out]: the sum of every rank's part
        return y if self.bias is None else y + self.bias


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
        self.offsets, self.sizes = shard_layout(out_sizes, shard_ids)
        self.full_in, self.full_out_sizes = in_features, out_sizes
        self.tp_plan = dict.fromkeys(shard_ids)
        self.weight = _param((sum(out_sizes), in_features), self._load)
        self.bias = _param((sum(out_sizes),), self._load) if bias else None

    reduce_results = False

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        if self.tp_plan[shard_id] is not None:
            loaded = self.tp_plan[shard_id].take(loaded)
        off, size = self.offsets[shard_id], self.sizes[shard_id]
        dst = param.data.narrow(0, off, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"shard {shard_id!r}: expected {tuple(dst.shape)}, "
                             f"got {tuple(loaded.shape)}")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


def shard_layout(out_sizes: tuple[int, ...], shard_ids: tuple) -> tuple[dict, dict]:
    """Each shard's first output row and row count in a merged [sum(out_sizes), in] weight."""
    assert len(out_sizes) == len(shard_ids)
    offsets = {s: sum(out_sizes[:i]) for i, s in enumerate(shard_ids)}
    return offsets, dict(zip(shard_ids, out_sizes, strict=True))


def tp_geometry(module: nn.Module) -> dict:
    """The tensor-parallel keyword arguments a replacement of ``module`` is built with."""
    return dict(tp_plan=module.tp_plan, full_in=module.full_in,
                full_out_sizes=module.full_out_sizes, reduce_results=module.reduce_results)


def loaded_bias(bias: torch.Tensor | None, loader) -> nn.Parameter | None:
    """An empty bias parameter shaped like ``bias`` (None stays None) filled by ``loader``."""
    if bias is None:
        return None
    p = nn.Parameter(torch.empty_like(bias), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def checkpoint_names(name: str, module: nn.Module,
                     shard_ckpt: dict[str, dict[str, str]]) -> dict[str | None, str]:
    """Shard id -> checkpoint tensor name of the (meta) ``Linear`` / ``MergedLinear`` at
    ``name``; ``shard_ckpt`` maps a merged module's attribute to its shards' checkpoint names
    (``qkv_proj`` -> {"q": "q_proj", ...}); a shard it does not name is ``{name}.{shard}``."""
    if not isinstance(module, MergedLinear):
        return {None: name}
    parent_name, _, attr = name.rpartition(".")
    ckpt = shard_ckpt.get(attr, {})
    prefix = parent_name + "." if parent_name else ""
    return {s: prefix + ckpt[s] if s in ckpt else f"{name}.{s}" for s in module.shard_ids}


class MergedColumnParallelLinear(MergedLinear):
    """gate/up (or any fused column-parallel shards): rank r holds rows
    [r * size / tp, (r + 1) * size / tp) of every shard, fused as [sum(size / tp), in]."""

    def __init__(self, in_features: int, out_sizes: tuple[int, ...],
                 shard_ids: tuple[str, ...], bias: bool = False) -> None:
        tp, r = get_tp_size(), get_tp_rank()
        per = tuple(n // tp for n in out_sizes)
        super().__init__(in_features, per, shard_ids, bias)
        self.full_out_sizes = out_sizes
        if tp > 1:
            self.tp_plan = {s: ShardSlice(0, r * n, n, full) for s, n, full in
                            zip(shard_ids, per, out_sizes, strict=True)}


def kv_head_layout(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(KV heads on this rank, index of its first KV head). tp <= num_kv_heads: heads split
    evenly; tp > num_kv_heads: every rank holds one head, ``tp // num_kv_heads`` replicas of
    each (vLLM's ``num_kv_head_replicas``), rank r holding head ``r // replicas``."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return per, rank * per
    return 1, rank // (tp // num_kv_heads)


class QKVParallelLinear(MergedLinear):
    """Fused q/k/v, split by heads: rank r holds query heads [r*h/tp, (r+1)*h/tp) and its KV
    heads (``kv_head_layout``; replicated when tp > num_kv_heads)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False) -> None:
        tp, r = get_tp_size(), get_tp_rank()
        h = num_heads // tp
        hk, first_kv = kv_head_layout(num_kv_heads, tp, r)
        d = head_dim
        super().__init__(hidden, (h * d, hk * d, hk * d), ("q", "k", "v"), bias)
        self.num_heads, self.num_kv_heads = h, hk
        self.full_out_sizes = (num_heads * d, num_kv_heads * d, num_kv_heads * d)
        if tp > 1:
            kv = ShardSlice(0, first_kv * d, hk * d, num_kv_heads * d)
            self.tp_plan = {"q": ShardSlice(0, r * h * d, h * d, num_heads * d), "k": kv,
                            "v": kv}
