"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over the paged KV cache, CPU/torch.

Cache: one row per token and layer (C = 1 component, num_kv_heads = 1)::

    row [R + dr] = [ c_kv (R = kv_lora_rank, after kv_a_layernorm) | k_pe (dr, after rope) ]
    data [L, NB+1, 1, bs, 1, R + dr]      scales [L, NB+1, 1, bs, 1]  (FP8: one bf16 per row;
                                                                      INT8: one 1-byte code)

The per-head keys/values are never stored; with W = kv_b_proj.weight viewed [H, dn + dv, R],
W_UK = W[:, :dn] [H, dn, R] and W_UV = W[:, dn:] [H, dv, R]:

    k_h[s] = [ W_UK[h] c_kv[s] | k_pe[s] ]        v_h[s] = W_UV[h] c_kv[s]

Prefill / extend (q_len > 1): the context's latent rows are expanded once per layer (one GEMM
c_kv @ W^T -> [L, H, dn + dv]) and attended with SDPA under the causal offset.
Decode (q_len = 1), weight absorption -- no per-step re-expansion of the latent::

    q_lat[h] = W_UK[h]^T q_nope[h]                    [H, R]
    score[h, s] = ([q_lat[h] | q_pe[h]] . row[s]) * scale        (an MQA over the rows)
    o_lat[h] = sum_s p[h, s] c_kv[s]                  [H, R]
    o[h] = W_UV[h] o_lat[h]                           [H, dv]

FP8 / INT8 rows are dequantized on read; in decode the per-row scales are folded into the
scores and the probabilities (as the GQA torch backend does) instead of the R-wide payload.

Rotated modes (``int8``, ``fp8_rot``; kvserve/quant/rotation.py with ``split=(R, dr)``): the
row stored is ``[c_kv R_c | k_pe R_pe]``; R_c was folded into ``kv_b_proj.weight`` at load
(``DeepseekV3ForCausalLM.fold_kv_rotation``), so the weight this backend is handed already
reads rotated latents, and only q_pe is rotated here (by R_pe, after RoPE, like k_pe).

``mla_triton`` (kvserve/attention/mla_triton.py, the CUDA default) subclasses this backend and
replaces the ``_write`` / ``_decode_all`` hooks with the Triton kernels; planning of prefill
chunks and the prefill path are shared.

The backend holds no weights: the layer passes ``kv_b_proj.weight`` with each call
(``forward_mla``), and per-step planning lives in ``meta.cache`` (no module globals).

KV bytes per token (bytes_per_block / block_size), DeepSeek-V3 (61 layers, R = 512, dr = 64,
128 heads x (128 + 64) qk / 128 v):

    MLA  BF16  61 * 576 * 2              =    70,272 B  (68.6 KiB)
    MLA  FP8   61 * (576 + 2 scale)      =    35,258 B  (34.4 KiB)
    MHA  BF16  61 * 128 * (192 + 128) * 2 = 4,997,120 B  (4.77 MiB, 71x MLA BF16)
    MHA  FP8   61 * 128 * (192+128 + 2*2) = 2,529,792 B  (2.41 MiB, 72x MLA FP8)

(MHA = K [128 x 192] + V [128 x 128] per layer, FP8 with one bf16 scale per head row. In
kvserve's GQA layout [C=2, H, D] V would be padded to D = 192: 5,996,544 B BF16.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.base import BackendBase
from kvserve.attention.metadata import AttentionMetadata, plan_decode_chunks, plan_prefills
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.quant import fp8, int8

_WORKSPACE_MIN_TOKENS = 8192


def absorb_query(q_nope: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q_lat [n, H, R] = W_UK[h]^T q_nope[h]: q_nope [n, H, dn], w fp32 [H, dn + dv, R]."""
    dn = q_nope.shape[-1]
    # [H, n, dn] @ [H, dn, R] -> [H, n, R] -> [n, H, R]
    return torch.bmm(q_nope.float().transpose(0, 1), w[:, :dn]).transpose(0, 1)


def up_project(o_lat: torch.Tensor, w: torch.Tensor, dn: int) -> torch.Tensor:
    """o [n, H, dv] = W_UV[h] o_lat[h]: o_lat fp32 [n, H, R], w fp32 [H, dn + dv, R]."""
    # [H, n, R] @ [H, R, dv] -> [H, n, dv] -> [n, H, dv]
    return torch.bmm(o_lat.transpose(0, 1), w[:, dn:].transpose(1, 2)).transpose(0, 1)


@dataclass(frozen=True, slots=True)
class MlaDecodeTables:
    """mla_triton: every decode sequence of the step in one kernel launch."""

    tok: torch.Tensor  # [n] the step token of each decode sequence
    tables: torch.Tensor  # int32 [n, mb]
    seq_lens: torch.Tensor  # int32 [n]
    max_seq_len: int  # bounds the splits, no host sync


@dataclass(frozen=True, slots=True)
class MlaPlan:
    # pure-torch decode chunks: (tok, block ids, max blocks, pad [n, 1, L])
    decode: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]]
    prefill: list[tuple[int, int, int, torch.Tensor]]  # (start, q_len, seq_len, block ids)
    triton_decode: MlaDecodeTables | None = None  # mla_triton (then ``decode`` is empty)
    slots: torch.Tensor | None = None  # mla_triton: int64 [T] slots of the fused write


class MlaTorchAttentionBackend(BackendBase[MlaPlan]):
    name = "mla_torch"
    latent = True

    def __init__(
        self, kv_cache: PagedKVCache, num_heads: int, num_kv_heads: int, head_dim: int,
        scale: float, max_model_len: int,
    ) -> None:
        if kv_cache.components != 1 or num_kv_heads != 1 or kv_cache.num_kv_heads != 1:
            raise ValueError("mla_torch needs an MLA cache layout (components=1, 1 KV head); "
                             f"got components={kv_cache.components}, kv heads={num_kv_heads}")
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.row_dim = head_dim  # R + dr
        self.scale = scale
        bs = kv_cache.block_size
        # Workspace in tokens: at least one full-length sequence (rounded up to blocks).
        self.ws_tokens = max(_WORKSPACE_MIN_TOKENS, -(-max_model_len // bs) * bs)
        dev = kv_cache.data.device
        n = self.ws_tokens * head_dim
        self.ws_raw = torch.empty(n, dtype=kv_cache.dtype, device=dev)
        self.ws_f32 = torch.empty(n, dtype=torch.float32, device=dev)
        self.ws_i16 = torch.empty(n, dtype=torch.int16, device=dev) if kv_cache.is_fp8 else None
        self.ws_scales = (torch.empty(self.ws_tokens, dtype=kv_cache.scales.dtype, device=dev)
                          if kv_cache.has_scales else None)
        self.factor = fp8.HALF_BITS_FACTOR.get(kv_cache.dtype, 1.0)

    # ---- per-step planning (shared by all layers) -------------------------------------------
    def _build_plan(self, meta: AttentionMetadata) -> MlaPlan:
        bs, dev = self.kv_cache.block_size, self.kv_cache.data.device
        decode = [b for b, q in enumerate(meta.query_lens) if q == 1]
        chunks = [(c.tok.to(dev), c.block_ids.to(dev), c.max_blocks,
                   c.pad.unsqueeze(1).to(dev))  # pad [n, 1, L]
                  for c in plan_decode_chunks(meta, decode, bs, self.kv_cache.null_block,
                                              self.ws_tokens)]
        pre = self._plan_prefills(meta)
        plan = MlaPlan(chunks, pre)
        return plan

    def _plan_prefills(
        self, meta: AttentionMetadata
    ) -> list[tuple[int, int, int, torch.Tensor]]:
        """plan_prefills with the block ids on the cache's device (index_select needs it)."""
        dev = self.kv_cache.data.device
        return [(start, qlen, slen, ids.to(dev))
                for start, qlen, slen, ids in plan_prefills(meta, self.kv_cache.block_size)]

    # ---- forward --------------------------------------------------------------------------
    def forward_mla(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
        meta: AttentionMetadata, kv_b_weight: torch.Tensor,
    ) -> torch.Tensor:
        """Write ``latent`` [T, R + dr] (this step's rows), attend; returns fp32 [T, H, dv].

        q_nope [T, H, dn], q_pe [T, H, dr] (rope applied); kv_b_weight [H * (dn + dv), R].
        """
        t, h, dn = q_nope.shape
        r = kv_b_weight.shape[1]
        dv = kv_b_weight.shape[0] // h - dn
        assert h == self.num_heads and latent.shape == (t, self.row_dim)
        rot = self.kv_cache.rotation
        if rot is not None:  # R_c is already in kv_b_weight (folded at load)
            latent = rot.apply(latent)
            q_pe = torch.matmul(q_pe.float(), rot.parts[1])
        self._write(layer, latent.view(t, 1, self.row_dim), meta)
        plan = self._plan(meta)
        w = kv_b_weight.float().view(h, dn + dv, r)
        out = torch.empty((t, h, dv), dtype=torch.float32, device=q_nope.device)
        self._decode_all(layer, q_nope, q_pe, w, plan, out)
        for start, qlen, slen, ids in plan.prefill:
            sl = slice(start, start + qlen)
            out[sl] = self._prefill(layer, q_nope[sl], q_pe[sl], w, ids, slen)
        return out

    # ---- hooks a subclass replaces (mla_triton: fused write kernel, Triton decode) ---------
    def _write(self, layer: int, rows: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store this step's latent rows [T, 1, R + dr]."""
        self.kv_cache.write(layer, meta.write_rows, rows)

    def _decode_all(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, w: torch.Tensor,
        plan: MlaPlan, out: torch.Tensor,
    ) -> None:
        """Attend every decode (q_len = 1) sequence of the step into ``out`` [T, H, dv]."""
        for tok, ids, mb, pad in plan.decode:
            out[tok] = self._decode(layer, q_nope[tok], q_pe[tok], w, ids, mb, pad)

    def _gather(self, layer: int, ids: torch.Tensor, n: int, mb: int) -> torch.Tensor:
        """Rows of blocks ``ids`` ([n*mb]) -> fp32 [n, mb*bs, R+dr] (FP8: unscaled)."""
        cache, bs, d = self.kv_cache, self.kv_cache.block_size, self.row_dim
        numel = n * mb * bs * d
        raw = self.ws_raw[:numel].view(n * mb, bs * d)
        torch.index_select(cache.data[layer].view(cache.num_blocks + 1, -1), 0, ids, out=raw)
        src = raw
        if cache.is_fp8:
            src = fp8.fp8_to_half_bits(raw, self.ws_i16[:numel].view(raw.shape))
        dst = self.ws_f32[:numel].view(raw.shape)
        dst.copy_(src)
        return dst.view(n, mb * bs, d)

    def _gather_scales(self, layer: int, ids: torch.Tensor, n: int, mb: int) -> torch.Tensor:
        """FP8 / INT8 row scales of blocks ``ids`` -> fp32 [n, mb*bs] (FP8: times the
        half-bits factor; INT8: its codes through ``int8.code_to_scale``)."""
        bs = self.kv_cache.block_size
        raw = self.ws_scales[: n * mb * bs].view(n * mb, bs)
        cache = self.kv_cache
        torch.index_select(cache.scales[layer].view(cache.num_blocks + 1, -1), 0, ids, out=raw)
        if self.kv_cache.is_int8:
            return int8.code_to_scale(raw.view(n, mb * bs))
        return raw.view(n, mb * bs).float().mul_(self.factor)

    def _decode(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, w: torch.Tensor,
        ids: torch.Tensor, mb: int, pad: torch.Tensor,
    ) -> torch.Tensor:
        n, h, dn = q_nope.shape
        r = w.shape[2]
        rows = self._gather(layer, ids, n, mb)  # [n, L, R+dr]
        q = torch.cat((absorb_query(q_nope, w), q_pe.float()), dim=-1)  # [n, H, R+dr]
        scores = torch.bmm(q, rows.transpose(1, 2))  # [n, H, L]
        if self.kv_cache.has_scales:
            s = self._gather_scales(layer, ids, n, mb).unsqueeze(1)  # [n, 1, L]
            scores.mul_(s)
        scores.mul_(self.scale).masked_fill_(pad, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.kv_cache.has_scales:
            probs.mul_(s)
        return up_project(torch.bmm(probs, rows[..., :r]), w, dn)  # o_lat [n, H, R]

    def _prefill(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, w: torch.Tensor,
        ids: torch.Tensor, seq_len: int,
    ) -> torch.Tensor:
        qlen, h, dn = q_nope.shape
        r = w.shape[2]
        rows = self._gather(layer, ids, 1, ids.numel())[0, :seq_len]  # [L, R+dr]
        if self.kv_cache.has_scales:
            rows = rows * self._gather_scales(layer, ids, 1, ids.numel())[0, :seq_len, None]
        c_kv, k_pe = rows[:, :r], rows[:, r:]
        kv = F.linear(c_kv, w.view(-1, r)).view(seq_len, h, -1)  # [L, H, dn+dv]
        k = torch.cat((kv[..., :dn], k_pe.unsqueeze(1).expand(-1, h, -1)), dim=-1)
        v = kv[..., dn:]
        q = torch.cat((q_nope.float(), q_pe.float()), dim=-1)  # [qlen, H, dn+dr]
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, *, *]
        if qlen == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            start = seq_len - qlen
            dev = q.device
            allowed = (torch.arange(seq_len, device=dev).unsqueeze(0)
                       <= (torch.arange(qlen, device=dev) + start).unsqueeze(1))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        return o[0].transpose(0, 1)  # [qlen, H, dv]
