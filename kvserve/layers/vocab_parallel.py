"""Vocabulary-parallel embedding and LM head (Megatron / vLLM style).

At tp > 1 the vocabulary V is padded to Vp, a multiple of ``VOCAB_PADDING * tp`` (vLLM pads to
64), and rank r holds rows [r * Vp / tp, (r + 1) * Vp / tp) of the [Vp, hidden] table; padded
rows are zero. The embedding looks up the ids that fall in its range (others give zero rows)
and all-reduces; the LM head computes its [N, Vp / tp] logits and gathers them to rank 0,
which drops the padding. At tp = 1 nothing is padded and both are the plain layers.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce, tp_gather
from kvserve.kernels.cpu import cpu_ops
from kvserve.layers.linear import ColumnParallelLinear, ShardSlice
from kvserve.quant.w16 import table_rows

VOCAB_PADDING = 64


def padded_vocab(vocab_size: int, tp: int) -> int:
    if tp == 1:
        return vocab_size
    m = VOCAB_PADDING * tp
    return -(-vocab_size // m) * m


def _load_rows(param: torch.Tensor, loaded: torch.Tensor, start: int, vocab: int) -> None:
    """Copy checkpoint rows [start, start + rows) that exist (< vocab) and zero the padding."""
    rows = param.shape[0]
    n = max(0, min(rows, vocab - start))
    if loaded.shape[0] != vocab or loaded.shape[1:] != param.shape[1:]:
        raise ValueError(f"shape mismatch: vocabulary table {tuple(loaded.shape)}, expected "
                         f"[{vocab}, {param.shape[1]}]")
    param.data[:n].copy_(loaded[start : start + n])
    param.data[n:].zero_()


class VocabParallelEmbedding(nn.Module):
    # rows are returned in this dtype when the table is stored narrower than the model
    # computes (a 16-bit table of an fp32-compute model, see model.loader); None: as stored
    out_dtype: torch.dtype | None = None

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        tp, r = get_tp_size(), get_tp_rank()
        self.vocab_size = vocab_size
        self.per_rank = padded_vocab(vocab_size, tp) // tp
        self.start = r * self.per_rank  # ids [start, start + per_rank) live here
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _load_rows(param, loaded, self.start, self.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            if (self.out_dtype or self.weight.dtype) == torch.float32:
                x = cpu_ops.gather_rows(self.weight, ids)  # fp32 rows: one C call on CPU
                if x is not None:
                    return x
            x = table_rows(self.weight, ids)
            return x if self.out_dtype is None else x.to(self.out_dtype)
        local = ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        x = table_rows(self.weight, torch.where(mask, local, 0))  # [T, hidden]
        if self.out_dtype is not None:
            x = x.to(self.out_dtype)
        x = x * mask.unsqueeze(-1).to(x.dtype)
        return tp_all_reduce(x)  # exactly one rank contributes a non-zero row per token


class ParallelLMHead(ColumnParallelLinear):
    """The LM head as a column-parallel linear over the padded vocabulary (a ``Linear``, so an
    untied INT4 head is swapped like any other). Tied: shares the embedding's rows."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        tp = get_tp_size()
        super().__init__(hidden, padded_vocab(vocab_size, tp), bias=False)
        self.vocab_size = vocab_size
        self.full_out_sizes = (vocab_size,)
        if tp > 1:
            self.tp_plan = {None: ShardSlice(0, get_tp_rank() * self.out_features,
                                             self.out_features, vocab_size)}

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if get_tp_size() == 1:
            super()._load(param, loaded, shard_id)
        else:
            _load_rows(param, loaded, get_tp_rank() * self.out_features, self.vocab_size)


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """[N, Vp / tp] per rank -> [N, V] on rank 0 (None on the others); identity at tp=1."""
    if get_tp_size() == 1:
        return local
    full = tp_gather(local, dim=-1)
    return None if full is None else full[:, :vocab_size]
