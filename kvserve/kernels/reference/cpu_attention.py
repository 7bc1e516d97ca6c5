"""The CPU attention backend's pure-torch path: the twin of the C kernel
(kvserve/csrc/paged_attention.c), used where the kernel does not build (and by the tests that
compare the two). Math in fp32, over a K/V cache (C = 2).

Decode sequences (one query token) are batched: their blocks are gathered into a preallocated
workspace, converted to fp32 in the layout the matmuls want, and attended with GQA folded into
the matmul (the G query heads of a KV head form the M dimension)::

    raw  [n, mb, C, bs, H, D]  (storage dtype, gathered by block table, pad = null block)
      -> f32 [n, C, H, mb*bs, D]
    q    [n, H, G, D] @ K^T [n, H, D, L] -> scores [n, H, G, L] -> softmax -> @ V -> [n, H, G, D]

FP8 / INT8 scales are folded into the scores (K) and probabilities (V) instead of the D-wide
payload. Prefill/extend sequences are attended one at a time with SDPA over the dequantized
context. The caller chunks sequences so that the workspace stays bounded; nothing large is
allocated per step.

``data`` below is one layer of the cache, [NB + 1, 2, bs, H, D]; ``scales`` its [NB + 1, 2, bs,
H] scales (FP8 / INT8) or None; ``ids`` the gathered block ids, [n * mb].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.config import KVMode
from kvserve.quant import fp8, int8


@dataclass(frozen=True, slots=True)
class Workspace:
    """Buffers for ``tokens`` gathered tokens (2 components x H x D each)."""

    mode: KVMode
    raw: torch.Tensor  # storage dtype: the gathered bytes
    f32: torch.Tensor  # fp32: the same, widened and permuted
    i16: torch.Tensor | None  # FP8: fp16 bit patterns (``fp8.fp8_to_half_bits``)
    scales: torch.Tensor | None  # FP8 / INT8: the gathered scales
    factor: float  # FP8: the half-bits factor folded into the scales (1 otherwise)

    @classmethod
    def allocate(cls, mode: KVMode, tokens: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> Workspace:
        row = 2 * num_kv_heads * head_dim
        return cls(
            mode,
            torch.empty(tokens * row, dtype=mode.dtype, device=device),
            torch.empty(tokens * row, dtype=torch.float32, device=device),
            torch.empty(tokens * row, dtype=torch.int16, device=device) if mode.is_fp8
            else None,
            torch.empty(tokens * 2 * num_kv_heads, dtype=mode.scale_dtype, device=device)
            if mode.scaled else None,
            fp8.HALF_BITS_FACTOR.get(mode.dtype, 1.0),
        )


def gather_f32(ws: Workspace, data: torch.Tensor, ids: torch.Tensor, n: int, mb: int
               ) -> torch.Tensor:
    """Blocks ``ids`` ([n*mb]) -> fp32 [n, 2, H, mb*bs, D] (unscaled for FP8 / INT8; INT8
    widens exactly by the copy)."""
    _, _, bs, H, D = data.shape
    numel = n * mb * 2 * bs * H * D
    raw = ws.raw[:numel].view(n * mb, 2 * bs * H * D)
    torch.index_select(data.view(data.shape[0], -1), 0, ids, out=raw)
    src = raw
    if ws.mode.is_fp8:
        src = fp8.fp8_to_half_bits(raw, ws.i16[:numel].view(raw.shape))
    dst = ws.f32[:numel].view(n, 2, H, mb, bs, D)
    dst.copy_(src.view(n, mb, 2, bs, H, D).permute(0, 2, 4, 1, 3, 5))
    return dst.view(n, 2, H, mb * bs, D)


def gather_scales(ws: Workspace, scales: torch.Tensor, ids: torch.Tensor, n: int, mb: int
                  ) -> torch.Tensor:
    """FP8 / INT8 scales of blocks ``ids`` -> fp32 [n, 2, H, mb*bs] (times the FP8 half-bits
    factor; INT8: its 1-byte codes through ``int8.code_to_scale``)."""
    _, _, bs, H = scales.shape
    numel = n * mb * 2 * bs * H
    raw = ws.scales[:numel].view(n * mb, 2 * bs * H)
    torch.index_select(scales.view(scales.shape[0], -1), 0, ids, out=raw)
    s = raw.view(n, mb, 2, bs, H).permute(0, 2, 4, 1, 3)
    s = int8.code_to_scale(s) if ws.mode.is_int8 else s.float()
    return s.reshape(n, 2, H, mb * bs).mul_(ws.factor)


def decode(ws: Workspace, data: torch.Tensor, scales: torch.Tensor | None, q: torch.Tensor,
           ids: torch.Tensor, mb: int, mask: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """``q`` [n, Hq, D] (one token of each of n sequences) -> fp32 [n, Hq, D]; ``mask``
    [n, 1, 1, mb*bs] is True past each sequence's length."""
    n, n_qh, D = q.shape
    H = data.shape[3]
    G = n_qh // H
    kvf = gather_f32(ws, data, ids, n, mb)
    k, v = kvf[:, 0], kvf[:, 1]  # [n, H, L, D]
    qh = q.float().view(n, H, G, D)
    scores = torch.matmul(qh, k.transpose(-1, -2))  # [n, H, G, L]
    if ws.mode.scaled:
        s = gather_scales(ws, scales, ids, n, mb)
        scores.mul_(s[:, 0].unsqueeze(2))
    scores.mul_(sm_scale).masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if ws.mode.scaled:
        probs.mul_(s[:, 1].unsqueeze(2))
    return torch.matmul(probs, v).view(n, H * G, D)


def prefill(ws: Workspace, data: torch.Tensor, scales: torch.Tensor | None, q: torch.Tensor,
            ids: torch.Tensor, seq_len: int, sm_scale: float, window: int = 0) -> torch.Tensor:
    """The last ``q_len`` query tokens ``q`` [q_len, Hq, D] of one sequence of ``seq_len``
    tokens (blocks ``ids``), causal -> fp32 [q_len, Hq, D]; ``window`` > 0: the query at
    position p sees keys (p - window, p] only (a sliding-window layer)."""
    qlen = q.shape[0]
    mb = ids.numel()
    gqa = q.shape[1] > data.shape[3]
    kvf = gather_f32(ws, data, ids, 1, mb)[0]  # [2, H, L, D]
    if ws.mode.scaled:
        s = gather_scales(ws, scales, ids, 1, mb)[0]  # [2, H, L]
        kvf.mul_(s.unsqueeze(-1))
    k = kvf[0, :, :seq_len].unsqueeze(0)
    v = kvf[1, :, :seq_len].unsqueeze(0)
    qh = q.float().transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
    if qlen == seq_len and not window:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=sm_scale,
                                           enable_gqa=gqa)
    else:
        start = seq_len - qlen
        kpos, qpos = torch.arange(seq_len).unsqueeze(0), (torch.arange(qlen) + start).unsqueeze(1)
        allowed = kpos <= qpos
        if window:
            allowed &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=allowed, scale=sm_scale,
                                           enable_gqa=gqa)
    return o[0].transpose(0, 1)
