"""Twins of the KV writers and of the checksum state (layout and formulas:
:mod:`kvserve.kernels.reference`): ``write_kv`` is what the C writer, the fused Triton writer and
``PagedKVCache``'s pure-torch writer compute, bit for bit."""

from __future__ import annotations

import torch

from kvserve.config import KVStorage
from kvserve.kernels.reference.quant import (
    fp8_compute_scales,
    fp8_quantize,
    int8_quantize_dynamic,
    static_scale_rows,
)


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
# Rotation of the rotated KV modes
# ---------------------------------------------------------------------------------------------


def rotate_heads(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Twin of ``kvs_rotate_heads`` (kvserve/csrc/cpu_ops.c): x [T, H, D] times R [D, D] fp32,
    per head (q, k, v by R before the write and the attention; the output by R^T after)."""
    return torch.matmul(x.float(), r)


# ---------------------------------------------------------------------------------------------
# Cache write
# ---------------------------------------------------------------------------------------------


def write_rows(x: torch.Tensor, rows: torch.Tensor, dst_rows: torch.Tensor,
               scale_rows: torch.Tensor | None = None,
               static_scales: torch.Tensor | None = None, row_offset: int = 0) -> None:
    """Twin of the C writer (:func:`kvserve.kernels.cpu.paged_attention.write_kv`, same
    arguments): ``x`` [T, H, D] into ``dst_rows`` [R, H, D] at rows ``rows + row_offset``
    (int64 [T]), in dst's dtype; FP8: dynamic bf16 scales, or the given bf16 ``static_scales``
    ([H], or [T, H]), into ``scale_rows`` [R, H]; INT8: 1-byte scale codes into ``scale_rows``;
    other dtypes: ``x.to(dtype)``."""
    r = rows if row_offset == 0 else rows + row_offset
    kind = KVStorage(dst_rows.dtype)
    if not kind.scaled:
        dst_rows.index_copy_(0, r, x.to(dst_rows.dtype))
        return
    assert scale_rows is not None, "an FP8 / INT8 cache needs scale rows"
    if kind.is_int8:
        q, s = int8_quantize_dynamic(x)
        dst_rows.index_copy_(0, r, q)
    else:
        s = fp8_compute_scales(x, dst_rows.dtype) if static_scales is None else \
            static_scales.expand(x.shape[0], -1)
        q = fp8_quantize(x, s, dst_rows.dtype)
        dst_rows.view(torch.uint8).index_copy_(0, r, q.view(torch.uint8))
    scale_rows.index_copy_(0, r, s)


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
      codes only (:func:`~kvserve.kernels.reference.quant.int8_quantize_dynamic`).
    * Other storage dtypes: ``x.to(storage dtype)`` (a plain copy when dtypes match).
    * Each component's rows are written by :func:`write_rows` (the C writer's twin).
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
    _, _, _, bs, n_heads, head_dim = kv_data.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(device=kv_data.device, dtype=torch.long)
    blocks, offs = slots // bs, slots % bs
    # row of (block, c, offset) in the layer's rows [(NB+1) * C * bs, H, D]: component 0 here
    rows = (blocks * n_comp) * bs + offs
    dst = kv_data[layer].view(-1, n_heads, head_dim)
    scale_rows = None if kv_scales is None else kv_scales[layer].view(-1, n_heads)
    comps = [(k, k_scale)] + ([] if v is None else [(v, v_scale)])
    for c, (x, static) in enumerate(comps):
        x = x[valid.to(x.device)].to(kv_data.device)  # [n, H, D]
        if static is not None and fp8:
            static = static_scale_rows(static, x.shape[:-1])
        write_rows(x, rows, dst, scale_rows if fp8 or i8 else None, static, row_offset=c * bs)
    if csum_state is not None and slots.numel():
        contrib = token_checksum_contrib(kv_data, kv_scales if fp8 or i8 else None, layer,
                                         slots)
        csum_state[layer].index_add_(0, blocks, contrib)
