"""Twins of the paged-attention kernels (layout: :mod:`kvserve.kernels.reference`): the
Triton decode / prefill / MLA-decode kernels and the C kernel (kvserve/csrc/paged_attention.c)
agree with ``paged_attention`` / ``mla_decode`` within floating-point tolerance. Clarity beats
speed: loops over sequences. The CPU backend's own pure-torch path (workspaces, the scales
folded into the scores) is :mod:`kvserve.kernels.reference.cpu_attention`."""

from __future__ import annotations

import torch

from kvserve.config import KVStorage
from kvserve.kernels.reference.quant import dequantize_rows


def gather_kv(
    kv_data: torch.Tensor,
    kv_scales: torch.Tensor | None,
    layer: int,
    block_table: torch.Tensor,
    seq_len: int,
) -> torch.Tensor:
    """Dequantised fp32 rows of one sequence: [C, seq_len, H, D] for token positions 0..S-1."""
    bs = kv_data.shape[3]
    pos = torch.arange(seq_len, device=kv_data.device)
    blocks = block_table.to(kv_data.device).long()[pos // bs]
    offs = pos % bs
    data = kv_data[layer, blocks, :, offs]  # [S, C, H, D]
    scales = None if kv_scales is None else kv_scales[layer, blocks, :, offs]  # [S, C, H]
    return dequantize_rows(data, scales if KVStorage(kv_data.dtype).scaled else None
                           ).transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    kv_data: torch.Tensor,
    kv_scales: torch.Tensor | None,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sm_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Ragged causal attention over the paged cache: ``q[T, Hq, D] -> out[T, Hq, D]``;
    ``window`` > 0 (a sliding-window layer): the query at position p sees keys
    (p - window, p] only.

    Sequence b owns queries ``q[qsl[b]:qsl[b+1]]`` (q_len of them), which are its LAST q_len
    tokens, and its seq_len tokens are already in the cache::

        key position      0 1 2 ... ctx-1 | ctx ... seq_len-1        ctx = seq_len - q_len
        query i (0-based) ................. sits at position ctx + i, sees keys 0..ctx+i

    GQA: Hq = G * Hkv, query head h reads kv head h // G. Math in fp32; a sequence with
    seq_len = 0 (batch padding) yields zeros.
    """
    T, n_qh, _ = q.shape
    n_kvh = kv_data.shape[4]
    if n_qh % n_kvh:
        raise ValueError(f"{n_qh} query heads not a multiple of {n_kvh} kv heads")
    group = n_qh // n_kvh
    out = torch.zeros(T, n_qh, kv_data.shape[5], dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[b], qsl[b + 1]
        q_len = q1 - q0
        if q_len == 0 or seq_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: q_len {q_len} > seq_len {seq_len}")
        kv = gather_kv(kv_data, kv_scales, layer, block_tables[b], seq_len).to(q.device)
        k = kv[0].repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = kv[1].repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale  # [Hq, q_len, S]
        ctx = seq_len - q_len
        qpos = ctx + torch.arange(q_len, device=q.device)
        kpos = torch.arange(seq_len, device=q.device)
        hidden = kpos[None, None, :] > qpos[None, :, None]
        if window:
            hidden |= kpos[None, None, :] <= qpos[None, :, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


def paged_decode_attention(q: torch.Tensor, kv_data: torch.Tensor,
                           kv_scales: torch.Tensor | None, layer: int,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           sm_scale: float, window: int = 0) -> torch.Tensor:
    """Decode (one query per sequence, ``q[B, Hq, D]``): :func:`paged_attention` with q_len=1."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention(q, kv_data, kv_scales, layer, block_tables, seq_lens, qsl, sm_scale,
                           window)


def mla_decode(
    q_nope_absorbed: torch.Tensor,
    q_rope: torch.Tensor,
    kv_data: torch.Tensor,
    kv_scales: torch.Tensor | None,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """MLA decode over the latent cache (C = 1, one kv head).

    Cached row of token t: ``[c_kv (kv_lora_rank) | k_rope (rope_dim)]``. For query head h::

        score[h, t] = (q_nope_absorbed[h] . c_kv[t] + q_rope[h] . k_rope[t]) * sm_scale
        out[h]      = sum_t softmax_t(score[h]) * c_kv[t]          (latent; caller up-projects)

    ``q_nope_absorbed[B, Hq, L]``, ``q_rope[B, Hq, R]`` -> ``out[B, Hq, L]`` in q's dtype.
    """
    if kv_data.shape[2] != 1 or kv_data.shape[4] != 1:
        raise ValueError("MLA cache must have C = 1 and num_kv_heads = 1")
    L = kv_lora_rank
    B, n_qh, _ = q_nope_absorbed.shape
    out = torch.zeros(B, n_qh, L, dtype=torch.float32, device=q_nope_absorbed.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        row = gather_kv(kv_data, kv_scales, layer, block_tables[b], seq_len)[0, :, 0]  # [S, L+R]
        row = row.to(q_nope_absorbed.device)
        c_kv, k_rope = row[:, :L], row[:, L:]
        scores = q_nope_absorbed[b].float() @ c_kv.T + q_rope[b].float() @ k_rope.T  # [Hq, S]
        out[b] = (scores * sm_scale).softmax(dim=-1) @ c_kv
    return out.to(q_nope_absorbed.dtype)
