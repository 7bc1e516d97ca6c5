"""GPU attention backend: the Triton kernels of ``kvserve/kernels`` over the paged cache.

Chosen automatically when the KV cache lives on CUDA (``attention_backend="auto"``). Per layer:
one fused write kernel (+ FP8 quantize, + the per-block checksum state sealing uses when
integrity is on), then either the split-K decode kernel (every sequence has one query token)
or the ragged prefill/extend kernel. Imported lazily (registry), so the
CPU path never imports triton. On CPU it runs under ``TRITON_INTERPRET=1`` (tests only).
"""

from __future__ import annotations

import torch

from kvserve.attention.metadata import AttentionMetadata, plan_decode_tables
from kvserve.cache.kv_cache import PagedKVCache


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, kv_cache: PagedKVCache, num_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float, max_model_len: int) -> None:
        from kvserve.kernels import triton_attention, triton_cache

        if kv_cache.components != 2:
            raise ValueError("the triton backend serves K/V caches; MLA models use mla_triton")
        self._attn, self._cache = triton_attention, triton_cache
        self.kv = kv_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # The write kernel keeps the per-block checksum state the integrity checker seals from
        # (None when integrity is off: no atomics).
        self.csum_state = kv_cache.enable_checksum_state()

    def _plan(self, meta: AttentionMetadata) -> dict:
        plan = meta.cache.get("triton")
        if plan is not None:
            return plan
        dev = self.kv.data.device
        _, tables, lens = plan_decode_tables(meta, range(meta.num_seqs), self.kv.block_size,
                                             self.kv.null_block)
        plan = {
            "tables": tables.to(dev, torch.int32, non_blocking=True),  # [B, mb]
            "seq_lens": lens.to(dev, torch.int32),
            "qsl": torch.tensor(meta.query_start_loc, dtype=torch.int32).to(dev),
            "slots": meta.slot_mapping.to(dev),
            "decode": all(q == 1 for q in meta.query_lens),
            "max_seq_len": max(meta.seq_lens),
            "max_query_len": max(meta.query_lens),
        }
        meta.cache["triton"] = plan
        return plan

    def graph_plan(self, tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                   max_seq_len: int) -> dict:
        """``meta.cache`` entries for a decode step over static device tensors (CUDA graphs,
        kvserve/engine/cuda_graphs.py): tables int32 [B, MB], seq_lens int32 [B], slots int64
        [B]; ``max_seq_len`` (the table capacity MB * block_size) bounds the splits without a
        host sync. Nothing here is rebuilt per step: the caller refills the tensors."""
        b = seq_lens.shape[0]
        qsl = torch.arange(b + 1, dtype=torch.int32, device=seq_lens.device)
        return {"triton": {"tables": tables, "seq_lens": seq_lens, "qsl": qsl, "slots": slots,
                           "decode": True, "max_seq_len": max_seq_len, "max_query_len": 1}}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        rot = self.kv.rotation
        if rot is None:
            return self._attend(layer, q, k, v, meta)
        # rotated modes (fp8_rot...): attend in the basis of R, rotate the output back
        dt = q.dtype  # the kernels take the model's dtype
        return rot.invert(self._attend(layer, rot.apply(q).to(dt), rot.apply(k).to(dt),
                                       rot.apply(v).to(dt), meta))

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        p = self._plan(meta)
        kv = self.kv
        ks = vs = None
        if kv.static_scales is not None:
            ks, vs = kv.static_scales[layer, 0], kv.static_scales[layer, 1]
        self._cache.write_kv(kv.data, kv.scales, layer, p["slots"], k, v, self.csum_state,
                             ks, vs)
        q = q.contiguous()
        if p["decode"]:
            return self._attn.paged_decode_attention(
                q, kv.data, kv.scales, layer, p["tables"], p["seq_lens"], self.scale,
                max_seq_len=p["max_seq_len"]).float()
        return self._attn.paged_attention(
            q, kv.data, kv.scales, layer, p["tables"], p["seq_lens"], p["qsl"], self.scale,
            max_query_len=p["max_query_len"]).float()
