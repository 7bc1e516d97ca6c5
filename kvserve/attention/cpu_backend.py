"""CPU attention over the paged KV cache (math in fp32).

On CPU every query row (decode and prefill alike) goes through the C kernel
(``kvserve/csrc/paged_attention.c``), which reads the storage dtype in place. Where the kernel
does not build, its pure-torch twin runs instead: decode sequences batched through a
preallocated workspace, prefills one at a time with SDPA
(``kvserve/kernels/reference/cpu_attention.py``, which draws the layouts). This backend plans
the step (chunks of decode sequences keep the workspace bounded) and writes the step's K/V.

Rotated modes (``rotation``, e.g. ``int8``): q, k, v are multiplied by R before the write and
the attention, the output by R^T after (kvserve/quant/rotation.py), on both paths: the C kernel
``kvs_rotate_heads`` (recordable in a CPU decode graph) where it applies, else its twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.base import BackendBase
from kvserve.attention.metadata import (
    AttentionMetadata,
    plan_decode_chunks,
    plan_prefills,
    plan_rows,
)
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.kernels import reference
from kvserve.kernels.cpu import cpu_ops
from kvserve.kernels.cpu import paged_attention as cpu_attention
from kvserve.kernels.reference import cpu_attention as twin

_WORKSPACE_MIN_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class CpuPlan:
    """One step's plan: every row through the C kernel (``kernel`` = plan_rows' (row_seq,
    tables, lens)), or the pure-torch decode chunks (tok, block ids, max blocks, pad
    [n, 1, 1, L], seq lens [n]) and prefills (start, q_len, seq_len, block ids)."""

    kernel: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None
    decode: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]]
    prefill: list[tuple[int, int, int, torch.Tensor]]


class CpuAttentionBackend(BackendBase[CpuPlan]):
    name = "cpu"  # "torch" is accepted too (its old name)
    windowed = True

    def __init__(
        self, kv_cache: PagedKVCache, num_heads: int, num_kv_heads: int, head_dim: int,
        scale: float, max_model_len: int, layer_windows: tuple[int, ...] = (),
    ) -> None:
        assert kv_cache.components == 2 and num_heads % num_kv_heads == 0
        self.kv_cache = kv_cache
        # per layer: 0 (full causal) or the sliding window a local layer reads (KVSpec)
        self.layer_windows = layer_windows
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        bs = kv_cache.block_size
        # Workspace in tokens: at least one full-length sequence (rounded up to blocks).
        self.ws_tokens = max(_WORKSPACE_MIN_TOKENS, -(-max_model_len // bs) * bs)
        self.ws = twin.Workspace.allocate(kv_cache.mode, self.ws_tokens, num_kv_heads, head_dim,
                                          kv_cache.data.device)
        # Every row through the C kernel when it builds (kvserve/csrc); this class's pure-torch
        # decode / prefill paths are its twin and the fallback.
        self.use_kernel = (
            not kv_cache.data.is_cuda and self.group <= 64 and cpu_attention.load() is not None
        )

    # ---- per-step planning (shared by all layers) -------------------------------------------
    def _build_plan(self, meta: AttentionMetadata) -> CpuPlan:
        bs, null = self.kv_cache.block_size, self.kv_cache.null_block
        if self.use_kernel:  # every row, in step order: no workspace, padding or gather
            plan = CpuPlan(plan_rows(meta, bs, null), [], [])
        else:
            decode = [b for b, q in enumerate(meta.query_lens) if q == 1]
            chunks = [(c.tok, c.block_ids, c.max_blocks, c.pad[:, None, None, :], c.seq_lens)
                      for c in plan_decode_chunks(meta, decode, bs, null, self.ws_tokens)]
            plan = CpuPlan(None, chunks, plan_prefills(meta, bs))
        return plan

    def graph_plan(self, meta: AttentionMetadata, tables: torch.Tensor, seq_lens: torch.Tensor,
                   slots: torch.Tensor, max_seq_len: int) -> None:
        """Recorded CPU graphs (kvserve/engine/cpu_graphs.py): decode row r attends
        seq_lens[r] tokens of table row r (int64 static buffers, filled per step)."""
        if not self.use_kernel:
            raise NotImplementedError("the torch backend records graphs only with its C kernel")
        assert tables.dtype == seq_lens.dtype == torch.int64
        meta.cache[self.name] = CpuPlan((None, tables, seq_lens), [], [])

    # ---- forward --------------------------------------------------------------------------
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        rot = self.kv_cache.rotation
        if rot is None:
            return self._attend(layer, q, k, v, meta)
        # q . k and p . v commute with the orthogonal R: attend in the rotated basis.
        out = self._attend(layer, self._rotate(q, rot.matrix), self._rotate(k, rot.matrix),
                           self._rotate(v, rot.matrix), meta)
        return self._rotate(out, rot.inverse)

    @staticmethod
    def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] times R (or R^T): the C kernel where it applies (recordable in a CPU
        graph), else its twin."""
        y = cpu_ops.rotate_heads(x, r)
        return y if y is not None else reference.rotate_heads(x, r)

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.kv_cache.write(layer, meta.write_rows, k, v)
        plan = self._plan(meta)
        window = self.layer_windows[layer] if self.layer_windows else 0
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if plan.kernel is not None:
            row_seq, tables, lens = plan.kernel
            scales = self.kv_cache.scales[layer] if self.kv_cache.has_scales else None
            if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
                q = q.float().contiguous()
            return cpu_attention.paged_attention(self.kv_cache.data[layer], scales, q, tables,
                                                 row_seq, lens, self.scale, out,
                                                 window=window)
        # the kernel's pure-torch twin (kvserve/kernels/reference/cpu_attention.py)
        cache = self.kv_cache
        data, scales = cache.data[layer], cache.scales[layer] if cache.has_scales else None
        for tok, ids, mb, mask, lens in plan.decode:
            if window:  # and before the window: keys [len - window, len) only
                mask = mask | (torch.arange(mask.shape[-1]) < (lens - window)[:, None, None,
                                                                              None])
            out[tok] = twin.decode(self.ws, data, scales, q[tok], ids, mb, mask, self.scale)
        for start, qlen, slen, ids in plan.prefill:
            out[start : start + qlen] = twin.prefill(self.ws, data, scales,
                                                     q[start : start + qlen], ids, slen,
                                                     self.scale, window)
        return out
