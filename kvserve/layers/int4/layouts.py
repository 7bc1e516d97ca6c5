"""INT4 weight layouts the compute methods read (``kvserve.layers.int4.methods``), each built
once from a canonical :class:`~kvserve.quant.int4.Int4Weight` (or from another layout's
unsigned nibbles). Pure torch: packing here, arithmetic there.

CPU layouts::

    op pack   torch's ``_convert_weight_to_int4pack_for_cpu`` bytes, uint8 [n_pad, k_pad / 2]
              (its per-CPU layout: ``int4pack_layout``) + pairs [k_pad / G', n_pad, 2] per op
              group G' | group: bf16 (s, z) with w = (u - 8) s + z, or for the GGUF min form
              fp16 (s, m) with w = u s + m (exactly as stored; bf16 would round them)
    wq tiles  integer-dot tiles of the GGUF min form (``kvserve.quant.wq``): codes + (s, m)
    canonical the compressed-tensors pack (int4.pack_int4), for what no faster layout takes

GPU layouts (``pack_triton`` / ``pack_tinygemm``), from unsigned nibbles u uint8 [N, K], fp32
scales [N, G] and unsigned zero points zp [N, G] (int16, or fp32 fractional -m / s for the min
form; None: symmetric, 8) with W = (u - zp) * scale::

    triton    packed int32 [N, ceil(K/8)] (nibble j of word w = column 8w + j), scales fp32
              [N, G], zeros int8 [N, G] or fp32 (min form) or None
    tinygemm  u8 uint8 [n_pad, k_pad / 2] (even column in the high nibble; torch's CUDA
              ``_convert_weight_to_int4pack`` turns it into int32 tiles on the device) + bf16
              [k_pad / g, n_pad, 2] (scale, zero) with W = (u - 8) * scale + zero
"""

from __future__ import annotations

import functools
import math

import torch

from kvserve.quant import int4, wq
from kvserve.quant.int4 import Int4Weight

OP_GROUPS = (256, 128, 64, 32)  # group sizes the CPU int4 op accepts
CUDA_KERNELS = ("triton", "tinygemm", "dense")  # "dense": irregular act-order groups


def ceil_to(x: int, m: int) -> int:
    return math.ceil(x / m) * m


# --------------------------------------------------------------------------------- op pack


@functools.cache
def int4pack_layout() -> tuple[int, str] | None:
    """How ``_convert_weight_to_int4pack_for_cpu`` lays out [N, K] nibbles on this CPU.

    Returns (block_n, mode): bytes view as [N / block_n, K, block_n / 2]; mode "halves": low
    nibbles are rows 0..block_n/2-1 of the block, high nibbles the rest (AVX2: 32, AVX512: 64);
    "pairs": byte j holds rows 2j (low) and 2j+1 (high) (scalar build). Found by packing a
    probe and checking each candidate; None if the op is missing or nothing matches.
    """
    op = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if op is None or getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None) is None:
        return None
    g = torch.Generator().manual_seed(0)
    n, k = 128, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    try:
        packed = op(q, 2)
    except RuntimeError:
        return None
    for block_n in (64, 32, 16):
        for mode in ("halves", "pairs"):
            try:
                got = unpack_blocks(packed, n, k, block_n, mode, 0, n // block_n)
            except RuntimeError:
                continue
            if torch.equal(got.permute(0, 2, 1).reshape(n, k).int(), q):
                return block_n, mode
    return None


def unpack_blocks(packed: torch.Tensor, n: int, k: int, block_n: int, mode: str, b0: int,
                  b1: int, k_major: bool = False) -> torch.Tensor:
    """uint8 nibbles of row blocks [b0, b1): [b1 - b0, K, block_n] (W^T per block), or with
    ``k_major`` [K, (b1 - b0) * block_n] (W^T of those rows, contiguous)."""
    blk = packed.view(n // block_n, k, block_n // 2)[b0:b1]  # [nb, K, block_n / 2]
    if k_major:
        blk = blk.permute(1, 0, 2)  # [K, nb, block_n / 2]; the cat/stack below copies
    lo, hi = blk & 15, blk >> 4
    u = torch.cat((lo, hi), -1) if mode == "halves" else torch.stack((lo, hi), -1)
    return u.reshape(k, -1) if k_major else u.view(b1 - b0, k, block_n)


def op_group(w: Int4Weight) -> int | None:
    """The CPU op's group G' for w: one that divides w's group (any, channel-wise); None if
    no op group fits."""
    if w.n_groups == 1:  # channel-wise: any op group, the scale is the same everywhere
        return next((g for g in OP_GROUPS if w.in_features >= g), OP_GROUPS[-1])
    return next((g for g in OP_GROUPS if w.group_size % g == 0), None)


def pack_for_op(w: Int4Weight, group: int, k_pad: int, n_pad: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [n_pad, k_pad / 2], pairs [k_pad / group, n_pad, 2]) of the op pack."""
    n, k = w.values.shape
    # unsigned nibbles; padded rows/columns hold 8 (weight 0; x is zero-padded anyway)
    u = torch.full((n_pad, k_pad), int4.OFFSET, dtype=torch.int32)
    u[:n, :k] = w.values.to(torch.int32) + int4.OFFSET
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2)
    # op groups: each original group spans group_size / group op groups
    n_op_groups = k_pad // group
    rep = 1 if w.n_groups == 1 else w.group_size // group
    s = w.scales.float()
    # w = (q - zp) * s = (u - 8) * s + zero  with  zero = -zp * s;  min form: (s, m) as is
    if w.mins is not None:
        z = w.mins.float()
    else:
        z = -w.zeros.float() * s if w.zeros is not None else torch.zeros_like(s)
    s = s.repeat_interleave(rep, 1) if rep > 1 else s
    z = z.repeat_interleave(rep, 1) if rep > 1 else z
    if w.n_groups == 1:
        s, z = s.expand(n, n_op_groups), z.expand(n, n_op_groups)
    assert s.shape == (n, n_op_groups), (s.shape, n_op_groups)
    # padded rows: w = 0. fp16 holds GGUF's fp16 (d, m) exactly; bf16 would round them
    pair_dtype = torch.float16 if w.mins is not None else torch.bfloat16
    sz = torch.zeros(n_op_groups, n_pad, 2, dtype=pair_dtype)
    sz[:, :n, 0] = s.t()
    sz[:, :n, 1] = z.t()
    return packed, sz


# ---------------------------------------------------------------------------------- wq tiles


def wq_form_ok(w: Int4Weight) -> bool:
    """GGUF-style groups the integer-dot layout holds: whole 32-column blocks, fp16 (s, m)."""
    if w.mins is None or w.g_idx is not None or w.n_groups == 1 or w.group_size % wq.BLOCK \
            or w.in_features % w.group_size:
        return False
    s, m = w.scales.float(), w.mins.float()
    return bool(torch.equal(s.half().float(), s) and torch.equal(m.half().float(), m))


def pack_wq(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes, (s, m) tiles, n_pad) of a min-form weight; padded rows: u = s = m = 0."""
    n, k = w.values.shape
    n_pad = ceil_to(n, wq.TILE)
    u = torch.zeros(n_pad, k, dtype=torch.uint8)
    u[:n] = (w.values.to(torch.int16) + int4.OFFSET).to(torch.uint8)
    s = torch.zeros(n_pad, w.n_groups, dtype=torch.float16)
    m = torch.zeros_like(s)
    s[:n], m[:n] = w.scales.to(torch.float16), w.mins.to(torch.float16)
    return wq.pack_codes(u, 4), wq.pack_scales(s, m), n_pad


# ----------------------------------------------------------------------------- GPU layouts


def min_form_zero_points(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp32 [N, G] zp with (u - zp) s == u s + m up to fp32 rounding (Q4_0: zp = 8, exact).
    A group with s == 0 and m != 0 has no such zp: refused (not in ggml output unless a whole
    block is one constant)."""
    m = m.float()
    if bool(((s == 0) & (m != 0)).any()):
        raise ValueError("a Q4_1 block with d == 0 and m != 0 has no GPU zero-point form")
    safe = torch.where(s == 0, torch.ones_like(s), s)
    return torch.where(s == 0, torch.full_like(s, float(int4.OFFSET)), -m / safe)


def pack_triton(u: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(packed int32 [N, ceil(K/8)], scales fp32 [N, G], zeros int8 / fp32 [N, G] or None)."""
    packed = int4.pack_int4((u.to(torch.int16) - int4.OFFSET).to(torch.int8))
    zeros = None if zp is None else (zp.float() if zp.is_floating_point() else zp.to(torch.int8))
    return packed, scales.contiguous(), None if zeros is None else zeros.contiguous()


def pack_tinygemm(u: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None, group: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(u8 uint8 [n_pad, k_pad / 2], pairs bf16 [k_pad / group, n_pad, 2]); group: a multiple
    of 32 (the op's groups)."""
    n, k = u.shape
    k_pad, n_pad = ceil_to(k, group), ceil_to(n, 8)
    up = torch.full((n_pad, k_pad), int4.OFFSET, dtype=torch.uint8)  # pad: weight 0
    up[:n, :k] = u
    u8 = ((up[:, ::2] << 4) | up[:, 1::2]).contiguous()  # [n_pad, k_pad/2]
    zpf = torch.full_like(scales, float(int4.OFFSET)) if zp is None else zp.float()
    sz = torch.zeros(k_pad // group, n_pad, 2, dtype=torch.bfloat16)
    sz[: scales.shape[1], :n, 0] = scales.t()
    sz[: scales.shape[1], :n, 1] = ((int4.OFFSET - zpf) * scales).t()  # zero
    return u8, sz


def tinygemm_ok(group: int) -> bool:
    return getattr(torch.ops.aten, "_weight_int4pack_mm", None) is not None \
        and group in OP_GROUPS
