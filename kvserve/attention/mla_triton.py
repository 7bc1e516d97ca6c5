"""MLA attention on the GPU: mla_torch's planning and prefill, Triton for the write and decode.

Chosen automatically for an MLA model (latent cache, components == 1) when the KV cache lives
on CUDA (``attention_backend="auto"`` or ``"triton"``, see ``resolve_backend_name``); on CPU it
runs under ``TRITON_INTERPRET=1`` (tests only). Per layer and step:

    write   PagedKVCache.write(latent [T, 1, R + dr]) -> the fused Triton write (copy / FP8)
            (+ the per-block checksum state sealing uses, when integrity is on)
    decode  every q_len = 1 sequence in ONE split-K kernel launch (triton_attention.mla_decode):
              q_lat = W_UK^T q_nope                 [n, H, R]   (torch bmm, as mla_torch)
              o_lat = mla_decode(q_lat, q_pe, rows)  [n, H, R]   (reads each latent row once
                                                                 per split for all H heads)
              o     = W_UV o_lat                    [n, H, dv]  (torch bmm)
    prefill / extend (q_len > 1): mla_torch's path (expand the latent, SDPA).

FP8 latent rows (one bf16 scale per row) are read by the kernel directly: the scale is applied
to the scores and to the probabilities (it covers c_kv and k_pe alike). On CUDA with a bf16
model the kernel's dots take bf16 operands (fp32 accumulation); otherwise fp32.
"""

from __future__ import annotations

import torch

from kvserve.attention.metadata import AttentionMetadata, plan_decode_tables
from kvserve.attention.mla_torch import (
    MlaDecodeTables,
    MlaPlan,
    MlaTorchAttentionBackend,
    absorb_query,
    up_project,
)
from kvserve.cache.kv_cache import PagedKVCache


class MlaTritonAttentionBackend(MlaTorchAttentionBackend):
    name = "mla_triton"
    kv_writer = "triton"  # the fused write kernel (+ the integrity checksum state)

    def __init__(
        self, kv_cache: PagedKVCache, num_heads: int, num_kv_heads: int, head_dim: int,
        scale: float, max_model_len: int,
    ) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale, max_model_len)
        from kvserve.kernels.triton import attention as triton_attention

        self._attn = triton_attention
        self._check_writer(kv_cache)

    # ---- per-step planning (shared by all layers) -------------------------------------------
    def _build_plan(self, meta: AttentionMetadata) -> MlaPlan:
        cache, dev = self.kv_cache, self.kv_cache.data.device
        decode = [b for b, q in enumerate(meta.query_lens) if q == 1]
        tri = None
        if decode:  # one launch for all decodes: the kernel needs no gather workspace
            tok, tables, lens = plan_decode_tables(meta, decode, cache.block_size, cache.null_block)
            tri = MlaDecodeTables(tok.to(dev), tables.to(dev, torch.int32),
                                  lens.to(dev, torch.int32), int(lens.max()))
        plan = MlaPlan([], self._plan_prefills(meta), tri, meta.slot_mapping.to(dev))
        return plan

    # ---- hooks --------------------------------------------------------------------------
    def _write(self, layer: int, rows: torch.Tensor, meta: AttentionMetadata) -> None:
        self.kv_cache.write(layer, meta.write_rows, rows, slots=self._plan(meta).slots)

    def _decode_all(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, w: torch.Tensor,
        plan: MlaPlan, out: torch.Tensor,
    ) -> None:
        p = plan.triton_decode
        if p is None:
            return
        tok = p.tok
        dn, r = q_nope.shape[-1], w.shape[2]
        # bf16 tensor-core dots on CUDA for a bf16 model; fp32 otherwise (and in the interpreter)
        qd = (torch.bfloat16 if self.kv_cache.data.is_cuda and q_nope.dtype == torch.bfloat16
              else torch.float32)
        q_lat = absorb_query(q_nope[tok], w).to(qd)  # [n, H, R]
        q_rope = q_pe[tok].to(qd)  # [n, H, dr]
        o_lat = self._attn.mla_decode(
            q_lat, q_rope, self.kv_cache.data, self.kv_cache.scales, layer, p.tables, p.seq_lens,
            self.scale, r, max_seq_len=p.max_seq_len)  # [n, H, R] in qd
        out[tok] = up_project(o_lat.float(), w, dn)
