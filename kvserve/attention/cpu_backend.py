"""Reference + CPU attention over the paged KV cache (math in fp32).

On CPU every query row (decode and prefill alike) goes through the C kernel
(``kvserve/csrc/paged_attention.c``), which reads the storage dtype in place; what follows is
its pure-torch twin, used where the kernel does not build.

Decode sequences (one query token) are batched: their blocks are gathered into a preallocated
workspace, converted to fp32 in the layout the matmuls want, and attended with GQA folded into
the matmul (the G query heads of a KV head form the M dimension):

    raw  [n, mb, C, bs, H, D]  (storage dtype, gathered by block table, pad = null block)
      -> f32 [n, C, H, mb*bs, D]
    q    [n, H, G, D] @ K^T [n, H, D, L] -> scores [n, H, G, L] -> softmax -> @ V -> [n, H, G, D]

FP8 / INT8 scales are folded into the scores (K) and probabilities (V) instead of the D-wide
payload. Rotated modes (``kv.rotation``, e.g. ``int8``): q, k, v are multiplied by R before the
write and the attention, the output by R^T after (kvserve/quant/rotation.py), on both paths.
Prefill/extend sequences are attended one at a time with SDPA over the dequantized context.
Chunks of sequences keep the workspace bounded; nothing large is allocated per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.base import BackendBase
from kvserve.attention.metadata import (
    AttentionMetadata,
    plan_decode_chunks,
    plan_prefills,
    plan_rows,
)
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.kernels.cpu import paged_attention as cpu_attention
from kvserve.quant import fp8, int8

_WORKSPACE_MIN_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class CpuPlan:
    """One step's plan: every row through the C kernel (``kernel`` = plan_rows' (row_seq,
    tables, lens)), or the pure-torch decode chunks (tok, block ids, max blocks, pad
    [n, 1, 1, L]) and prefills (start, q_len, seq_len, block ids)."""

    kernel: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None
    decode: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]]
    prefill: list[tuple[int, int, int, torch.Tensor]]


class CpuAttentionBackend(BackendBase[CpuPlan]):
    name = "cpu"  # "torch" is accepted too (its old name)

    def __init__(
        self, kv_cache: PagedKVCache, num_heads: int, num_kv_heads: int, head_dim: int,
        scale: float, max_model_len: int,
    ) -> None:
        assert kv_cache.components == 2 and num_heads % num_kv_heads == 0
        self.kv = kv_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        bs = kv_cache.block_size
        # Workspace in tokens: at least one full-length sequence (rounded up to blocks).
        self.ws_tokens = max(_WORKSPACE_MIN_TOKENS, -(-max_model_len // bs) * bs)
        row = 2 * num_kv_heads * head_dim
        dev = kv_cache.data.device
        self.ws_raw = torch.empty(self.ws_tokens * row, dtype=kv_cache.dtype, device=dev)
        self.ws_f32 = torch.empty(self.ws_tokens * row, dtype=torch.float32, device=dev)
        self.ws_i16 = (
            torch.empty(self.ws_tokens * row, dtype=torch.int16, device=dev)
            if kv_cache.is_fp8 else None
        )
        self.ws_scales = (
            torch.empty(self.ws_tokens * 2 * num_kv_heads, dtype=kv_cache.scales.dtype,
                        device=dev)
            if kv_cache.has_scales else None
        )
        self.factor = fp8.HALF_BITS_FACTOR.get(kv_cache.dtype, 1.0)
        # Every row through the C kernel when it builds (kvserve/csrc); this class's pure-torch
        # decode / prefill paths are its twin and the fallback.
        self.use_kernel = (
            not kv_cache.data.is_cuda and self.group <= 64 and cpu_attention.load() is not None
        )

    # ---- per-step planning (shared by all layers) -------------------------------------------
    def _build_plan(self, meta: AttentionMetadata) -> CpuPlan:
        bs, null = self.kv.block_size, self.kv.null_block
        if self.use_kernel:  # every row, in step order: no workspace, padding or gather
            plan = CpuPlan(plan_rows(meta, bs, null), [], [])
        else:
            decode = [b for b, q in enumerate(meta.query_lens) if q == 1]
            chunks = [(c.tok, c.block_ids, c.max_blocks, c.pad[:, None, None, :])
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
        rot = self.kv.rotation
        if rot is None:
            return self._attend(layer, q, k, v, meta)
        # q . k and p . v commute with the orthogonal R: attend in the rotated basis.
        out = self._attend(layer, rot.apply(q), rot.apply(k), rot.apply(v), meta)
        return rot.invert(out)

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.kv.write(layer, meta.write_rows, k, v)
        plan = self._plan(meta)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if plan.kernel is not None:
            row_seq, tables, lens = plan.kernel
            scales = self.kv.scales[layer] if self.kv.has_scales else None
            if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
                q = q.float().contiguous()
            return cpu_attention.paged_attention(self.kv.data[layer], scales, q, tables,
                                                 row_seq, lens, self.scale, out)
        for tok, ids, mb, mask in plan.decode:
            out[tok] = self._decode(layer, q[tok], ids, mb, mask)
        for start, qlen, slen, ids in plan.prefill:
            out[start : start + qlen] = self._prefill(layer, q[start : start + qlen], ids, slen)
        return out

    def _gather_f32(self, layer: int, ids: torch.Tensor, n: int, mb: int) -> torch.Tensor:
        """Blocks ``ids`` ([n*mb]) of ``layer`` -> fp32 [n, 2, H, mb*bs, D] (unscaled for
        FP8 / INT8; INT8 widens exactly by the copy)."""
        kv, bs, H, D = self.kv, self.kv.block_size, self.num_kv_heads, self.head_dim
        numel = n * mb * 2 * bs * H * D
        raw = self.ws_raw[:numel].view(n * mb, 2 * bs * H * D)
        torch.index_select(kv.data[layer].view(kv.num_blocks + 1, -1), 0, ids, out=raw)
        src = raw
        if kv.is_fp8:
            src = fp8.fp8_to_half_bits(raw, self.ws_i16[:numel].view(raw.shape))
        dst = self.ws_f32[:numel].view(n, 2, H, mb, bs, D)
        dst.copy_(src.view(n, mb, 2, bs, H, D).permute(0, 2, 4, 1, 3, 5))
        return dst.view(n, 2, H, mb * bs, D)

    def _gather_scales(self, layer: int, ids: torch.Tensor, n: int, mb: int) -> torch.Tensor:
        """FP8 / INT8 scales of blocks ``ids`` -> fp32 [n, 2, H, mb*bs] (times the FP8
        half-bits factor; INT8: its 1-byte codes through ``int8.code_to_scale``)."""
        bs, H = self.kv.block_size, self.num_kv_heads
        numel = n * mb * 2 * bs * H
        raw = self.ws_scales[:numel].view(n * mb, 2 * bs * H)
        torch.index_select(self.kv.scales[layer].view(self.kv.num_blocks + 1, -1), 0, ids,
                           out=raw)
        s = raw.view(n, mb, 2, bs, H).permute(0, 2, 4, 1, 3)
        s = int8.code_to_scale(s) if self.kv.is_int8 else s.float()
        return s.reshape(n, 2, H, mb * bs).mul_(self.factor)

    def _decode(
        self, layer: int, q: torch.Tensor, ids: torch.Tensor, mb: int, mask: torch.Tensor
    ) -> torch.Tensor:
        n = q.shape[0]
        H, G, D = self.num_kv_heads, self.group, self.head_dim
        kvf = self._gather_f32(layer, ids, n, mb)
        k, v = kvf[:, 0], kvf[:, 1]  # [n, H, L, D]
        qh = q.float().view(n, H, G, D)
        scores = torch.matmul(qh, k.transpose(-1, -2))  # [n, H, G, L]
        if self.kv.has_scales:
            s = self._gather_scales(layer, ids, n, mb)
            scores.mul_(s[:, 0].unsqueeze(2))
        scores.mul_(self.scale).masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.kv.has_scales:
            probs.mul_(s[:, 1].unsqueeze(2))
        return torch.matmul(probs, v).view(n, H * G, D)

    def _prefill(
        self, layer: int, q: torch.Tensor, ids: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        qlen = q.shape[0]
        mb = ids.numel()
        kvf = self._gather_f32(layer, ids, 1, mb)[0]  # [2, H, L, D]
        if self.kv.has_scales:
            s = self._gather_scales(layer, ids, 1, mb)[0]  # [2, H, L]
            kvf.mul_(s.unsqueeze(-1))
        k = kvf[0, :, :seq_len].unsqueeze(0)
        v = kvf[1, :, :seq_len].unsqueeze(0)
        qh = q.float().transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
        if qlen == seq_len:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=self.group > 1)
        else:
            start = seq_len - qlen
            allowed = (torch.arange(seq_len).unsqueeze(0)
                       <= (torch.arange(qlen) + start).unsqueeze(1))
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=allowed, scale=self.scale,
                                               enable_gqa=self.group > 1)
        return o[0].transpose(0, 1)
