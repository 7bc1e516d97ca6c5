"""GPU attention backend: the Triton kernels of ``kvserve/kernels`` over the paged cache.

Chosen automatically when the KV cache lives on CUDA (``attention_backend="auto"``). Per layer:
one fused write kernel (+ FP8 quantize, + the per-block checksum state sealing uses when
integrity is on), then either the split-K decode kernel (every sequence has one query token)
or the ragged prefill/extend kernel. Imported lazily (registry), so the
CPU path never imports triton. On CPU it runs under ``TRITON_INTERPRET=1`` (tests only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.base import BackendBase
from kvserve.attention.metadata import AttentionMetadata, plan_decode_tables
from kvserve.cache.kv_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class TritonPlan:
    tables: torch.Tensor  # int32 [B, mb] on the cache's device
    seq_lens: torch.Tensor  # int32 [B]
    qsl: torch.Tensor  # int32 [B + 1] query start locations
    slots: torch.Tensor  # int64 [T] cache slot of each new token
    decode: bool  # every sequence has one query token: the split-K decode kernel
    max_seq_len: int  # bounds the splits (no host sync)
    max_query_len: int


class TritonAttentionBackend(BackendBase[TritonPlan]):
    name = "triton"
    cuda_graphs = True
    windowed = True
    kv_writer = "triton"  # the fused write kernel (+ the integrity checksum state)

    def __init__(self, kv_cache: PagedKVCache, num_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float, max_model_len: int,
                 layer_windows: tuple[int, ...] = ()) -> None:
        from kvserve.kernels.triton import attention as triton_attention

        if kv_cache.components != 2:
            raise ValueError("the triton backend serves K/V caches; MLA models use mla_triton")
        self._attn = triton_attention
        self.kv_cache = kv_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_windows = layer_windows  # per layer: 0 (full) or its sliding window
        self._check_writer(kv_cache)

    def _build_plan(self, meta: AttentionMetadata) -> TritonPlan:
        dev = self.kv_cache.data.device
        _, tables, lens = plan_decode_tables(meta, range(meta.num_seqs), self.kv_cache.block_size,
                                             self.kv_cache.null_block)
        plan = TritonPlan(
            tables=tables.to(dev, torch.int32, non_blocking=True),
            seq_lens=lens.to(dev, torch.int32),
            qsl=torch.tensor(meta.query_start_loc, dtype=torch.int32).to(dev),
            slots=meta.slot_mapping.to(dev),
            decode=all(q == 1 for q in meta.query_lens),
            max_seq_len=max(meta.seq_lens), max_query_len=max(meta.query_lens),
        )
        return plan

    def graph_plan(self, meta: AttentionMetadata, tables: torch.Tensor, seq_lens: torch.Tensor,
                   slots: torch.Tensor, max_seq_len: int) -> None:
        """``max_seq_len`` (the table capacity MB * block_size) bounds the splits without a
        host sync (kvserve/engine/cuda_graphs.py)."""
        b = seq_lens.shape[0]
        qsl = torch.arange(b + 1, dtype=torch.int32, device=seq_lens.device)
        meta.cache[self.name] = TritonPlan(tables, seq_lens, qsl, slots, True, max_seq_len, 1)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        rot = self.kv_cache.rotation
        if rot is None:
            return self._attend(layer, q, k, v, meta)
        # rotated modes (fp8_rot...): attend in the basis of R, rotate the output back
        dt = q.dtype  # the kernels take the model's dtype
        return rot.invert(self._attend(layer, rot.apply(q).to(dt), rot.apply(k).to(dt),
                                       rot.apply(v).to(dt), meta))

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        p = self._plan(meta)
        cache = self.kv_cache
        cache.write(layer, meta.write_rows, k, v, slots=p.slots)
        q = q.contiguous()
        window = self.layer_windows[layer] if self.layer_windows else 0
        if p.decode:
            return self._attn.paged_decode_attention(
                q, cache.data, cache.scales, layer, p.tables, p.seq_lens, self.scale,
                max_seq_len=p.max_seq_len, window=window).float()
        return self._attn.paged_attention(
            q, cache.data, cache.scales, layer, p.tables, p.seq_lens, p.qsl, self.scale,
            max_query_len=p.max_query_len, window=window).float()
