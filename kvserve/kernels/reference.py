"""Pure-torch twins of the kernels: these functions ARE the specification.

Every Triton kernel in ``kvserve/kernels/triton/*.py`` must agree with its twin here (bit-exact
for the cache write and the checksum state, within floating-point tolerance for attention and
the INT4 GEMM), and so must the C kernels whose twins live here (the 16-bit GEMM of
``kvserve/csrc/w16_gemm.c``, the integer-dot GEMM of ``kvserve/csrc/wq_gemm.c``). Clarity beats
speed: loops over sequences are fine. This module never imports triton and runs on CPU and CUDA
alike.

Paged KV cache layout (fixed; the engine's CPU path uses exactly this)::

    kv_data   [num_layers, num_blocks, C, block_size, num_kv_heads, head_dim]   storage dtype
    kv_scales [num_layers, num_blocks, C, block_size, num_kv_heads]     bfloat16 (FP8) or
                                                                        int8 codes (INT8) only

    C = 2 (K at c=0, V at c=1) for MHA/GQA; C = 1 for MLA (one latent row [c_kv | k_rope],
    num_kv_heads = 1, head_dim = kv_lora_rank + qk_rope_head_dim).

    slot id = block_id * block_size + offset_in_block
    block_tables int32 [B, max_blocks_per_seq]: logical block j of sequence b -> physical block

    sequence b, token position p  ->  block block_tables[b, p // bs], offset p % bs

FP8 / INT8 dequantisation: ``x = stored_value.float() * scale`` with one scale per (token,
head, component), chosen at write time from the row's absolute maximum. FP8 stores the scale
as bf16. INT8 (symmetric, round half to even) stores a 1-byte code e, ``scale = 2^(e/8)``, the
smallest such step with ``127 * scale >= amax``; its twin is :mod:`kvserve.quant.int8`, shared
with the C kernel.

Integrity checksum over one block ``kv_data[l, b]`` (shape [C, bs, H, D], row-major), viewed as
signed int16 words w_0 .. w_{N-1}::

    S1 = sum_i w_i            S2 = sum_i (i + 1) * w_i          (exact, int64)

and the same over ``kv_scales[l, b]`` (shape [C, bs, H]: one bf16 = one word; INT8's 1-byte
codes pair up into words like FP8 payload bytes, whatever token they belong to). The state of a
block is int64 [4] = (S1_payload, S2_payload, S1_scales, S2_scales). Any single-word change
alters S1 (w is a bijection of the bits), two changes that cancel in S1 alter S2 by
(i - j) * delta != 0, and swapping two distinct words alters S2 by (i - j) * (w_j - w_i) != 0.
Because both sums are linear in the words, each token's write adds an independent contribution,
so a fused write kernel can accumulate the state with atomics and sealing a block needs no
re-read of the KV bytes.
"""

from __future__ import annotations

import torch

from kvserve.config import FP8_DTYPES, KVStorage, is_fp8, is_scaled
from kvserve.quant import fp8, int4, int8, wq

__all__ = [
    "FP8_DTYPES",
    "fp8_max",
    "is_fp8",
    "is_scaled",
    "quantize_fp8_rows",
    "dequantize_rows",
    "write_kv",
    "block_checksum_state",
    "token_checksum_contrib",
    "gather_kv",
    "paged_attention",
    "paged_decode_attention",
    "mla_decode",
    "quantize_int4",
    "unpack_int4",
    "unpack_zero_points",
    "dequantize_int4",
    "int4_matmul",
    "bf16_round",
    "w16_linear",
    "w16_linear_bf16_dot",
]

def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value: 448 for e4m3fn, 57344 for e5m2."""
    if not KVStorage(dtype).is_fp8:
        raise ValueError(f"{dtype} is not an FP8 storage dtype")
    return fp8.FP8_MAX[dtype]


# ---------------------------------------------------------------------------------------------
# FP8 quantisation
# ---------------------------------------------------------------------------------------------


def _static_scale_rows(scale: float | torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Broadcast a per-tensor (scalar) or per-head ([H]) static scale to ``shape`` = [..., H]."""
    s = torch.as_tensor(scale, dtype=torch.float32)
    if s.numel() != 1 and s.shape != (shape[-1],):
        raise ValueError(f"static scale must be a scalar or [num_kv_heads], got {tuple(s.shape)}")
    return s.reshape(-1).to(torch.bfloat16).expand(shape)


def quantize_fp8_rows(
    x: torch.Tensor, dtype: torch.dtype, static_scale: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x[..., D]`` row by row to FP8.

    Returns ``(q [..., D] dtype, scale [...] bfloat16)``. Dynamic (default)::

        amax  = max_d |x| (fp32)
        scale = (max(amax, 1e-12) / FP8_MAX).to(bfloat16)
        q     = clamp(x.float() / scale.float(), -FP8_MAX, FP8_MAX).to(dtype)   # RNE

    The bf16 rounding of the scale may push amax/scale slightly past FP8_MAX; the clamp absorbs
    it. With ``static_scale`` (scalar or per-head [H], where x is [..., H, D]) the same formula is
    used with that scale (rounded to bf16) instead of the dynamic one.
    """
    xf = x.float()
    if static_scale is None:
        scale = fp8.compute_scales(xf, dtype)
    else:
        scale = _static_scale_rows(static_scale, xf.shape[:-1]).clone()
    return fp8.quantize(xf, scale, dtype), scale


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of stored rows ``data[..., D]`` (``scales[...]`` for FP8 / INT8, else
    None)."""
    kind = KVStorage(data.dtype)
    if kind.scaled:
        assert scales is not None, "FP8 / INT8 cache needs kv_scales"
        if kind.is_int8:
            return int8.dequantize(data, scales)
        return fp8.dequantize(data, scales)
    return data.float()


# ---------------------------------------------------------------------------------------------
# Checksum state
# ---------------------------------------------------------------------------------------------


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """Row-major int16 words of ``x`` as int64, flattened over all dims but the first.

    ``x`` is [n, ...] contiguous-able; returns [n, W]. Little-endian byte order, so for FP8 word
    k of a row is ``byte[2k] | byte[2k+1] << 8`` (signed), for fp32 element e gives words 2e (low
    half) and 2e+1 (high half).
    """
    n = x.shape[0]
    flat = x.contiguous().reshape(n, -1)
    if flat.element_size() == 1 and flat.shape[1] % 2:
        raise ValueError("FP8 rows need an even number of bytes to form int16 words")
    return flat.view(torch.int16).to(torch.int64)


def _s1_s2(words: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """(S1, S2) [n, 2] of ``words[n, W]`` whose first word sits at block word index
    ``base[n]``."""
    idx1 = base.unsqueeze(1) + torch.arange(1, words.shape[1] + 1, device=words.device)  # i+1
    return torch.stack((words.sum(dim=1), (idx1 * words).sum(dim=1)), 1)


def _byte_s1_s2(b: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """(S1, S2) [n, 2] of 1-byte data ``b[n, B]`` whose first byte sits at block byte index
    ``base[n]``: byte e is half of word e // 2 (even: its unsigned value, odd: 256 * its
    signed value), so a run of bytes that does not start or end on a word boundary still adds
    exactly its share of the block's sums."""
    u = b.contiguous().view(torch.uint8).to(torch.int64)
    e = base.unsqueeze(1) + torch.arange(u.shape[1], device=u.device)
    contrib = torch.where(e % 2 == 0, u, 256 * (u - 256 * (u >= 128).to(torch.int64)))
    return torch.stack((contrib.sum(dim=1), ((e // 2 + 1) * contrib).sum(dim=1)), 1)


def block_checksum_state(
    kv_data: torch.Tensor,
    kv_scales: torch.Tensor | None,
    layer: int,
    block_ids: torch.Tensor,
) -> torch.Tensor:
    """Checksum state recomputed from the bytes: int64 [n, 4] for ``block_ids[n]``.

    Columns: (S1_payload, S2_payload, S1_scales, S2_scales); the scale columns are 0 when
    ``kv_scales`` is None.
    """
    ids = block_ids.to(device=kv_data.device, dtype=torch.long)
    n = ids.numel()
    out = torch.zeros(n, 4, dtype=torch.int64, device=kv_data.device)
    if n == 0:
        return out
    zero = torch.zeros(n, dtype=torch.int64, device=kv_data.device)
    out[:, 0:2] = _s1_s2(_as_words(kv_data[layer, ids]), zero)
    if kv_scales is not None:
        out[:, 2:4] = _s1_s2(_as_words(kv_scales[layer, ids]), zero)
    return out


def token_checksum_contrib(kv_data: torch.Tensor, kv_scales: torch.Tensor | None, layer: int,
                           slots: torch.Tensor) -> torch.Tensor:
    """Contribution of the rows stored at ``slots[n]`` (all components) to their block's state.

    Returns int64 [n, 4]. A token at offset o, component c of a block owns the words::

        payload words  [(c*bs + o) * Wp, (c*bs + o + 1) * Wp)   Wp = H*D*itemsize/2
        scale words    [(c*bs + o) * H,  (c*bs + o + 1) * H)       (bf16 scales)
        scale bytes    [(c*bs + o) * H,  (c*bs + o + 1) * H)       (INT8's 1-byte codes)

    so the per-token sums add up, over a fully written block, to ``block_checksum_state``.
    """
    bs = kv_data.shape[3]
    n_comp = kv_data.shape[2]
    slots = slots.to(device=kv_data.device, dtype=torch.long)
    blocks, offs = slots // bs, slots % bs
    out = torch.zeros(slots.numel(), 4, dtype=torch.int64, device=kv_data.device)
    for c in range(n_comp):
        words = _as_words(kv_data[layer, blocks, c, offs])  # [n, Wp]
        out[:, 0:2] += _s1_s2(words, (c * bs + offs) * words.shape[1])
        if kv_scales is not None:
            sc = kv_scales[layer, blocks, c, offs]  # [n, H]
            base = (c * bs + offs) * sc.shape[1]
            one_byte = sc.element_size() == 1
            out[:, 2:4] += _byte_s1_s2(sc, base) if one_byte else _s1_s2(_as_words(sc), base)
    return out


# ---------------------------------------------------------------------------------------------
# Cache write
# ---------------------------------------------------------------------------------------------


def write_kv(
    kv_data: torch.Tensor,
    kv_scales: torch.Tensor | None,
    layer: int,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    csum_state: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Write ``k[T, H, D]`` (and ``v``, None for MLA's C = 1) into their slots, in place.

    * ``slot_mapping[T]`` int64; a slot < 0 is padding and skipped. Slots in one call must be
      distinct.
    * FP8 storage: quantised per (token, head, component) with dynamic scales, or with the
      static ``k_scale`` / ``v_scale`` (scalar or [H]) broadcast into ``kv_scales``.
    * INT8 storage: symmetric per (token, head, component), dynamic 1-byte log-domain scale
      codes only (:func:`kvserve.quant.int8.quantize_dynamic`).
    * Other storage dtypes: ``x.to(storage dtype)`` (a plain copy when dtypes match).
    * ``csum_state`` int64 [num_layers, num_blocks, 4]: each written token's contribution
      (:func:`token_checksum_contrib`) is added to ``csum_state[layer, block]``. The state equals
      :func:`block_checksum_state` once every slot of a block has been written exactly once
      since the state (and, for a partially written block's unwritten rows, the bytes) was zero.
    """
    n_comp = kv_data.shape[2]
    if (v is None) != (n_comp == 1):
        raise ValueError("pass v for a C=2 (K/V) cache and v=None for a C=1 (MLA) cache")
    kind = KVStorage(kv_data.dtype)
    fp8, i8 = kind.is_fp8, kind.is_int8
    if (fp8 or i8) and kv_scales is None:
        raise ValueError("an FP8 / INT8 cache needs kv_scales")
    if i8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale / v_scale: an INT8 cache takes dynamic scales only")
    bs = kv_data.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(device=kv_data.device, dtype=torch.long)
    blocks, offs = slots // bs, slots % bs
    comps = [(k, k_scale)] + ([] if v is None else [(v, v_scale)])
    for c, (x, static) in enumerate(comps):
        rows = x[valid.to(x.device)].to(kv_data.device)  # [n, H, D]
        if fp8:
            q, scale = quantize_fp8_rows(rows, kv_data.dtype, static)
            kv_data[layer, blocks, c, offs] = q
            kv_scales[layer, blocks, c, offs] = scale  # type: ignore[index]
        elif i8:
            q, scale = int8.quantize_dynamic(rows)
            kv_data[layer, blocks, c, offs] = q
            kv_scales[layer, blocks, c, offs] = scale  # type: ignore[index]
        else:
            kv_data[layer, blocks, c, offs] = rows.to(kv_data.dtype)
    if csum_state is not None and slots.numel():
        contrib = token_checksum_contrib(kv_data, kv_scales if fp8 or i8 else None, layer,
                                         slots)
        csum_state[layer].index_add_(0, blocks, contrib)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


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
) -> torch.Tensor:
    """Ragged causal attention over the paged cache: ``q[T, Hq, D] -> out[T, Hq, D]``.

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
        scores = scores.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


def paged_decode_attention(q: torch.Tensor, kv_data: torch.Tensor,
                           kv_scales: torch.Tensor | None, layer: int,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           sm_scale: float) -> torch.Tensor:
    """Decode (one query per sequence, ``q[B, Hq, D]``): :func:`paged_attention` with q_len=1."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention(q, kv_data, kv_scales, layer, block_tables, seq_lens, qsl, sm_scale)


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


# ---------------------------------------------------------------------------------------------
# INT4 weight-only GEMM (compressed-tensors "pack-quantized")
# ---------------------------------------------------------------------------------------------
#
#   weight_packed int32 [N, ceil(K/8)]: word j of row n holds input columns 8j .. 8j+7,
#
#        bit 31                                                  bit 0
#        | k=8j+7 | k=8j+6 | k=8j+5 | k=8j+4 | k=8j+3 | k=8j+2 | k=8j+1 | k=8j |
#
#   4-bit value u in [0, 15]. Symmetric: w = (u - 8) * scale. Asymmetric: w = (u - zp) * scale.
#   weight_scale [N, ceil(K/group)] (fp16/bf16/fp32); weight_zero_point either unpacked
#   [N, ceil(K/group)] integers in [0, 15], or packed like compressed-tensors does it: int32
#   [ceil(N/8), ceil(K/group)], 8 consecutive OUTPUT rows per word, low nibble first.


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """``weight_packed`` int32 [N, ceil(K/8)] -> unsigned nibbles int64 [N, K] in [0, 15]
    (the format's own unpacker, :func:`kvserve.quant.int4.unpack_nibbles`)."""
    return int4.unpack_nibbles(packed, k).long()


def unpack_zero_points(zeros: torch.Tensor, n: int) -> torch.Tensor:
    """Zero points as float32 [N, G] from the unpacked or dim-0-packed form."""
    if zeros.dtype == torch.int32 and zeros.shape[0] != n and zeros.shape[0] == (n + 7) // 8:
        return int4.unpack_nibbles(zeros, n, dim=0).float()  # 8 output rows per word
    return zeros.float()


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    k: int | None = None,
) -> torch.Tensor:
    """fp32 weight [N, K] from the pack-quantized tensors (K defaults to 8 * packed width)."""
    k = packed.shape[1] * 8 if k is None else k
    n = packed.shape[0]
    u = unpack_int4(packed, k).float()  # [N, K]
    zp = (
        8.0
        if zeros is None
        else unpack_zero_points(zeros, n).repeat_interleave(group_size, 1)[:, :k]
    )
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :k]  # [N, K]
    return (u - zp) * s


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """``x[M, K] @ W.T -> [M, N]`` in x's dtype, W dequantised from the pack-quantized layout."""
    w = dequantize_int4(packed, scales, zeros, group_size, k=x.shape[1])
    return (x.float() @ w.to(x.device).T).to(x.dtype)


def quantize_int4(
    w: torch.Tensor, group_size: int, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest group quantisation of ``w[N, K]`` into the pack-quantized layout.

    Returns ``(weight_packed int32 [N, ceil(K/8)], weight_scale [N, G] in w's dtype,
    weight_zero_point int32 [N, G] unpacked, or None when symmetric)``. A test/helper utility;
    the canonical packer lives in ``kvserve.quant.int4``.
    """
    n, k = w.shape
    n_groups = -(-k // group_size)
    pad = n_groups * group_size - k
    wg = torch.nn.functional.pad(w.float(), (0, pad)).view(n, n_groups, group_size)
    if symmetric:
        scale = (wg.abs().amax(-1) / 7.0).clamp_min(1e-8).to(w.dtype)
        zp_f = torch.full_like(scale, 8.0, dtype=torch.float32)
        zeros = None
    else:
        lo, hi = wg.amin(-1).clamp(max=0.0), wg.amax(-1).clamp(min=0.0)
        scale = ((hi - lo) / 15.0).clamp_min(1e-8).to(w.dtype)
        zp_f = (-lo / scale.float()).round().clamp(0, 15)
        zeros = zp_f.to(torch.int32)
    u = (wg / scale.float().unsqueeze(-1) + zp_f.unsqueeze(-1)).round().clamp(0, 15)
    u = u.view(n, -1)[:, :k]
    # the format's packer (pack-quantized: signed values + 8 in nibbles, low nibble first)
    return int4.pack_int4((u - int4.OFFSET).to(torch.int8)), scale, zeros


# ---- 16-bit weights with fp32 activations on CPU (kvserve/csrc/w16_gemm.c) -------------------


def w16_linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of kvserve/csrc/w16_gemm.c: fp32 x [..., K], bf16 / fp16 weight [N, K] (bias [N] or
    None) -> fp32 [..., N]. The kernel widens the weights in registers (exact), so it differs
    from this only in the order of the fp32 additions."""
    assert weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == torch.float32
    y = x @ weight.float().t()
    return y if bias is None else y + bias.float()


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest bf16 value (ties to even), subnormals flushed to zero, back in fp32:
    what vcvtne2ps2bf16 (AVX512-BF16) makes of each activation."""
    x = x.float()
    tiny = x.abs() < torch.finfo(torch.float32).tiny
    return torch.where(tiny, torch.zeros_like(x), x).to(torch.bfloat16).float().copysign(x)


def w16_linear_bf16_dot(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Twin of kvserve/csrc/w16_gemm.c's bf16 dot-product path (AVX512-BF16 vdpbf16ps, taken
    for GEMMs of >= ``bf16_dot_rows`` rows): x [..., K] fp32 rounded to bf16 (``bf16_round``),
    times the bf16 weight [N, K], every product exact and summed in fp32 -> fp32 [..., N]. The
    kernel differs only in the order of the fp32 additions (and flushes subnormal sums)."""
    assert weight.dtype == torch.bfloat16
    return bf16_round(x) @ weight.float().t()


# ---- integer-dot GEMM for GGUF Q4 / Q8 weights on CPU (kvserve/csrc/wq_gemm.c) ---------------
#
# Weights: unsigned codes u with a (scale s, min m) per group of G input columns, w = u * s + m;
# activations quantized per row in blocks of wq.BLOCK columns to int8 (layout and formulas:
# kvserve.quant.wq). The C quantizer is bit-identical with ``wq_quantize_act``; the GEMM
# matches ``wq_matmul`` (float64) within fp32 rounding.


def wq_quantize_act(x: torch.Tensor, terms: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> (q int8 [T M, K], dx fp32 [T M, K/32], qs int32 [T M, K/32]), T = terms;
    the twin of ``kvs_wq_quant_act`` (same fp32 operations: bit-identical). Rows M + m of a
    second term hold the remainder: x ~ dx q + dx' q' (:mod:`kvserve.quant.wq`)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // wq.BLOCK, wq.BLOCK)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    v = xb * inv.unsqueeze(-1)
    q = torch.round(v).clamp_(-127, 127)
    dx = amax / 127.0
    qs_, dxs, sums = [q], [dx], [q.sum(-1)]
    if terms == 2:
        q2 = torch.round((v - q) * 254.0).clamp_(-127, 127)
        qs_.append(q2)
        dxs.append(dx / 254.0)
        sums.append(q2.sum(-1))
    return (torch.cat(qs_).to(torch.int8).view(terms * m, k), torch.cat(dxs),
            torch.cat(sums).to(torch.int32))


def wq_fake_quant_act(x: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """fp32 x^ = sum over terms of dx q: what the kernel multiplies the weights with."""
    q, dx, _ = wq_quantize_act(x, terms)
    tm, k = q.shape
    xh = q.float().view(tm, k // wq.BLOCK, wq.BLOCK) * dx.unsqueeze(-1)
    xh = xh.view(terms, tm // terms, k)
    return xh[0] if terms == 1 else xh[0] + xh[1]


def wq_dequantize(u: torch.Tensor, s: torch.Tensor, m: torch.Tensor, group: int
                  ) -> torch.Tensor:
    """fp32 [N, K] = fl(fl(u * s) + m) per group (GGUF's own dequantization order)."""
    w = u.float() * s.float().repeat_interleave(group, -1)
    return w + m.float().repeat_interleave(group, -1)


def wq_matmul(x: torch.Tensor, u: torch.Tensor, s: torch.Tensor, m: torch.Tensor,
              group: int, terms: int = 1) -> torch.Tensor:
    """The twin of ``kvs_wq_gemm``: fp32 [M, N] = x^ @ W^T in float64, x^ the int8
    fake-quantized x (:mod:`kvserve.quant.wq`), W = u * s + m."""
    q, dx, _ = wq_quantize_act(x, terms)
    xh = (q.double().view(q.shape[0], -1, wq.BLOCK) * dx.double().unsqueeze(-1)).view(q.shape)
    xh = xh.view(terms, x.shape[0], -1).sum(0)
    w = u.double() * s.double().repeat_interleave(group, -1) + \
        m.double().repeat_interleave(group, -1)
    return (xh @ w.t()).float()
