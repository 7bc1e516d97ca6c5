"""Triton attention over the paged KV cache: split-K decode, ragged causal prefill, MLA decode.

Twins (the spec): ``paged_decode_attention``, ``paged_attention`` and ``mla_decode`` in
:mod:`kvserve.kernels.reference`; every wrapper here takes the same arguments as its twin.

Cache layout (see kernels/reference): ``kv_data[L, NB, C, bs, Hkv, D]``, FP8 scales
``kv_scales[L, NB, C, bs, Hkv]``. Token position p of sequence b lives at::

    page = block_tables[b, p // bs]          (int32 -> int64 before multiplying by a stride)
    row  = page * stride_block + (p % bs) * stride_tok + kvh * stride_head   (+ c * stride_comp)

Tiles of BLOCK_N consecutive positions are gathered row by row, so a tile may straddle pages
and BLOCK_N is independent of the page size. ``kv_data[layer]`` is sliced on the host, so the
layer offset never goes through 32-bit index arithmetic.

FP8: a per-(token, head) scale factors out of the reduction over head_dim, so K and V stay in
their FP8 code values (exactly representable in bf16/fp16) inside the dots::

    s[h, n]  = sm_scale * k_scale[n] * sum_d q[h, d] k8[n, d]
    acc[h]  += sum_n (p[h, n] * v_scale[n]) * v8[n, :]

(with an fp16 model, p * v_scale could fall into fp16's subnormals, so there the V tile is
dequantised instead: acc[h] += sum_n p[h, n] * (v8[n, :] * v_scale[n])). INT8 takes the same
path (``IS_SCALED``: FP8 or INT8, stored with per-row scales): its codes, integers in
[-127, 127], are exact in bf16/fp16;
its scales are 1-byte codes e read as ``2^(e/8)`` (``LOG8_SCALES``, kvserve/quant/int8.py).

Softmax runs online in base 2 (``exp2``; scores pre-multiplied by log2(e)), with the usual
running max m, running sum l and rescaled accumulator.

Decode is flash-decoding: [0, max_seq_len) is cut into NUM_SPLITS equal, BLOCK_N-aligned
ranges, one program per (seq, kv head, split)::

    positions  0 ...................................................... max_ctx
    splits     |  split 0  |  split 1  |  split 2  |  ...  | split S-1 |
    seq b      [==================== seq_len ====)                      (later splits: empty)

    stage 1: (b, kvh, split) -> mid_o[b, h, split, :] = softmax-weighted V of its range,
                                mid_lse[b, h, split]  = log2-sum-exp2 of its scores (-inf: empty)
    stage 2: (b, h)          -> out[b, h] = sum_s 2^(lse_s - max) mid_o_s / sum_s 2^(lse_s - max)

The G = Hq / Hkv query heads of one kv head share a program (rows of the q tile, padded to
BLOCK_H >= 16 for ``tl.dot``), so every K/V byte is read once per split.

Under ``TRITON_INTERPRET=1`` dots run in fp32 (the interpreter mishandles bf16 ``tl.dot``) and
tiles are kept at the 16-row minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.config import KVStorage
from kvserve.kernels.triton import interpreting

__all__ = ["paged_decode_attention", "paged_attention", "mla_decode"]

_LOG2E = 1.4426950408889634

#: Launch configurations on a GPU (the interpreter uses 16-row tiles). Module-level so a
#: benchmark can sweep them.
DECODE_CONFIG: dict[str, int] = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
PREFILL_CONFIG: dict[str, int] = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
#: ... for batches whose longest query run is >= 128 tokens (compute-bound chunks)
PREFILL_CONFIG_LONG: dict[str, int] = {
    "BLOCK_M": 128,
    "BLOCK_N": 64,
    "num_warps": 8,
    "num_stages": 2,
}
_TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _dot_dtype(q_dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of the tensor-core dots (fp32 in the interpreter and for fp32 inputs)."""
    if interpreting() or q_dtype not in (torch.bfloat16, torch.float16):
        return tl.float32
    return _TORCH_TO_TL[q_dtype]


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _strides(t: torch.Tensor, *dims: int) -> tuple[int, ...]:
    return tuple(t.stride(d) for d in dims)


def _kv_flags(kv_data: torch.Tensor, dot_dtype: tl.dtype) -> dict[str, object]:
    """The constexprs every attention kernel takes about the cache's storage and its dots."""
    kind = KVStorage(kv_data.dtype)
    return {"IS_SCALED": kind.scaled, "LOG8_SCALES": kind.log8_scales,
            "DOT_DTYPE": dot_dtype, "PRECISION": "ieee" if dot_dtype == tl.float32 else "tf32"}


def _scales_arg(kv_data: torch.Tensor, kv_scales: torch.Tensor | None, layer: int) -> torch.Tensor:
    """``kv_scales[layer]`` for FP8 / INT8, else a dummy 4-d tensor (never dereferenced)."""
    if KVStorage(kv_data.dtype).scaled:
        if kv_scales is None:
            raise ValueError("an FP8 / INT8 cache needs kv_scales")
        return kv_scales[layer]
    return kv_data[layer, :, :, :, :, 0]


# ---------------------------------------------------------------------------------------------
# Shared device helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _softmax_state(ROWS: tl.constexpr, COLS: tl.constexpr):
    """Online-softmax state of ROWS query rows: (running max, running sum, fp32 acc)."""
    return (tl.full([ROWS], float("-inf"), dtype=tl.float32), tl.zeros([ROWS], dtype=tl.float32),
            tl.zeros([ROWS, COLS], dtype=tl.float32))


@triton.jit
def _kv_bases(BT, KV, SC, b, kvh, stride_btb, stride_kvh, stride_sch):
    """Sequence b's block-table row and kv head kvh's cache / scale bases (int64 offsets)."""
    return (BT + b.to(tl.int64) * stride_btb, KV + kvh.to(tl.int64) * stride_kvh,
            SC + kvh.to(tl.int64) * stride_sch)


@triton.jit
def _split_bounds(SEQ_LENS, tokens_per_split):
    """Split-K programs (grid axis 0: sequence, 2: split): (b, split, seq_len, start, end),
    this split's tokens being [start, end) of sequence b."""
    b = tl.program_id(0)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start = split * tokens_per_split
    return b, split, seq_len, start, tl.minimum(start + tokens_per_split, seq_len)


@triton.jit
def _scale(raw, LOG8: tl.constexpr):
    """fp32 scales of loaded scale entries: bf16 values (FP8) or INT8's codes e -> 2^(e/8)."""
    if LOG8:
        return tl.exp2(raw.to(tl.float32) * 0.125)
    return raw.to(tl.float32)


@triton.jit
def _row_offsets(
    BT_row, offs_n, mask_n, stride_kvb, stride_kvt, stride_scb, stride_sct, BLOCK_SIZE: tl.constexpr
):
    """int64 row offsets (kv and scales) of positions ``offs_n`` through one block-table row."""
    page = tl.load(BT_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    tok = (offs_n % BLOCK_SIZE).to(tl.int64)
    return page * stride_kvb + tok * stride_kvt, page * stride_scb + tok * stride_sct


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One tile of the online softmax (log2 units). s [M, N] scores with masked entries -inf,
    m_i / l_i [M] the running max and sum. Returns p [M, N] (unnormalised), alpha [M] (the
    factor rescaling what was accumulated so far), the new max and the new sum. A row with
    nothing visible yet (every score so far -inf: a sliding window's rows past the first tile)
    keeps max -inf and gets p = 0, alpha = 0 (not exp2(-inf + inf) = NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _split_result(acc, m_i, l_i):
    """(out [M, D], lse [M]) of one split: lse = -inf (and out 0) where it held no position."""
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _attend_kv_tile(
    q, m_i, l_i, acc, kv_head, sc_head, BT_row, offs_n, mask_n, keep, offs_d, mask_d, qk_scale,
    stride_kvb, stride_kvc, stride_kvt, stride_scb, stride_scc, stride_sct,
    BLOCK_SIZE: tl.constexpr, IS_SCALED: tl.constexpr, LOG8_SCALES: tl.constexpr,
    DEQUANT_V: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """The K/V loop body of decode and prefill: q [M, D] against the BLOCK_N positions
    ``offs_n`` of one sequence (``keep`` [M, N] or [1, N]: which scores count), folded into
    the running (m_i, l_i, acc [M, D]). FP8 / INT8 scales scale the scores (K) and p (V)."""
    row, srow = _row_offsets(
        BT_row, offs_n, mask_n, stride_kvb, stride_kvt, stride_scb, stride_sct, BLOCK_SIZE
    )
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(kv_head + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)
    if IS_SCALED:
        k_sc = _scale(tl.load(sc_head + srow, mask=mask_n, other=0), LOG8_SCALES)
        s = s * k_sc[None, :]
    s = tl.where(keep, s * qk_scale, float("-inf"))  # [M, BLOCK_N]
    p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
    v = tl.load(kv_head + stride_kvc + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if IS_SCALED:
        v_sc = _scale(tl.load(sc_head + stride_scc + srow, mask=mask_n, other=0), LOG8_SCALES)
        if DEQUANT_V:
            # fp16 would flush p * scale (scales reach 1e-8) into its subnormals:
            # dequantise the V tile instead, back at the model's magnitudes
            v = v.to(tl.float32) * v_sc[:, None]
        else:
            p = p * v_sc[None, :]
    pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return m_new, l_i, acc * alpha[:, None] + pv


# ---------------------------------------------------------------------------------------------
# Decode, stage 1: one program per (sequence, kv head, split)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    Q,  # [B, Hq, D]
    KV,  # kv_data[layer]: [NB, C, bs, Hkv, D]
    SC,  # kv_scales[layer]: [NB, C, bs, Hkv] (FP8) or dummy
    BT,  # int32 [B, max_blocks]
    SEQ_LENS,  # int32 [B]
    MID_O,  # fp32 [B, Hq, S, D]
    MID_LSE,  # fp32 [B, Hq, S]
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_kvb, stride_kvc, stride_kvt, stride_kvh, stride_scb,
    stride_scc, stride_sct, stride_sch, stride_btb, stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh, tokens_per_split,
    window,  # > 0: a sliding-window layer, keys [seq_len - window, seq_len) only
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_SCALED: tl.constexpr,
    LOG8_SCALES: tl.constexpr,  # INT8 cache: scales are 1-byte codes e, 2^(e/8)
    DEQUANT_V: tl.constexpr,  # FP8 cache, fp16 model: scale the V rows, not p
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    b, split, seq_len, start, end = _split_bounds(SEQ_LENS, tokens_per_split)
    kvh = tl.program_id(1)
    # a window's splits start at its first key (splits wholly before it stay empty: lse -inf)
    start = tl.maximum(start, tl.where(window > 0, tl.maximum(seq_len - window, 0), 0))

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    qh = kvh * GROUP + offs_h  # query heads of this kv head: [BLOCK_H]
    q_ptrs = Q + b.to(tl.int64) * stride_qb + qh[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)

    m_i, l_i, acc = _softmax_state(BLOCK_H, BLOCK_D)
    BT_row, kv_head, sc_head = _kv_bases(BT, KV, SC, b, kvh, stride_btb, stride_kvh, stride_sch)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end  # the tile has >= 1 valid position: the max stays finite
        m_i, l_i, acc = _attend_kv_tile(
            q, m_i, l_i, acc, kv_head, sc_head, BT_row, offs_n, mask_n, mask_n[None, :], offs_d,
            mask_d, qk_scale, stride_kvb, stride_kvc, stride_kvt, stride_scb, stride_scc,
            stride_sct, BLOCK_SIZE, IS_SCALED, LOG8_SCALES, DEQUANT_V, DOT_DTYPE, PRECISION,
        )

    out, lse = _split_result(acc, m_i, l_i)  # lse -inf for every row when the split is empty
    mo = MID_O + b.to(tl.int64) * stride_mob + qh[:, None] * stride_moh + split * stride_mos
    tl.store(mo + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MID_LSE + b.to(tl.int64) * stride_mlb + qh * stride_mlh + split, lse, mask=mask_h)


# ---------------------------------------------------------------------------------------------
# Decode, stage 2: merge the splits of one (sequence, query head)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _merge_splits_kernel(
    MID_O,  # fp32 [B, H, S, D]
    MID_LSE,  # fp32 [B, H, S]
    OUT,  # [B, H, D]
    num_splits, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob,
    stride_oh, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        MID_LSE + b * stride_mlb + h * stride_mlh + offs_s, mask=mask_s, other=float("-inf")
    )
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0): weights all 0
    w = tl.exp2(lse - m)  # [BLOCK_S]
    o_ptrs = MID_O + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos
    o = tl.load(o_ptrs + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    num = tl.sum(w[:, None] * o, axis=0)
    den = tl.sum(w, axis=0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(
        OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=mask_d
    )


def _merge(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    B, H, S, D = mid_o.shape
    _merge_splits_kernel[(B, H)](
        mid_o,
        mid_lse,
        out,
        S,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=D,
        BLOCK_S=_pow2(S, 2),
        BLOCK_D=_pow2(D),
        num_warps=4,
    )
    return out


def _split_plan(
    device: torch.device, batch: int, heads: int, max_ctx: int, block_n: int,
    num_splits: int | None,
) -> tuple[int, int]:
    """(num_splits, tokens_per_split): about 4 programs per SM, >= 1 tile per split."""
    max_tiles = max(1, triton.cdiv(max_ctx, block_n))
    if num_splits is None:
        num_splits = triton.cdiv(4 * _num_sms(device), max(1, batch * heads))
    num_splits = max(1, min(num_splits, max_tiles, 64))
    tokens_per_split = triton.cdiv(max_tiles, num_splits) * block_n
    return triton.cdiv(max_tiles * block_n, tokens_per_split), tokens_per_split


def _max_ctx(
    seq_lens: torch.Tensor, block_tables: torch.Tensor, bs: int, max_seq_len: int | None
) -> int:
    """Upper bound on seq_len that the splits cover (positions past it are never visited)."""
    cap = block_tables.shape[1] * bs
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    if max_seq_len > cap:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table capacity {cap}")
    return max_seq_len


@dataclass(frozen=True, slots=True)
class _Splits:
    """Split-K decode: S splits of ``tokens`` positions per sequence, each writing its partial
    output mid_o fp32 [B, Hq, S, W] and log-sum-exp mid_lse fp32 [B, Hq, S] for ``_merge``."""

    num: int
    tokens: int
    mid_o: torch.Tensor
    mid_lse: torch.Tensor

    def kernel_args(self, block_tables: torch.Tensor) -> tuple[int, ...]:
        """The split kernels' trailing arguments: the block-table row stride, the mid_o and
        mid_lse strides, tokens per split."""
        return (block_tables.stride(0), *self.mid_o.stride()[:3], *self.mid_lse.stride()[:2],
                self.tokens)


def _splits(q: torch.Tensor, width: int, programs: int, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, bs: int, max_seq_len: int | None, block_n: int,
            num_splits: int | None) -> _Splits:
    """Plan the splits of q [B, Hq, *] (``programs`` per sequence besides the splits) and
    allocate their outputs of ``width`` channels."""
    B, n_qh = q.shape[:2]
    max_ctx = _max_ctx(seq_lens, block_tables, bs, max_seq_len)
    S, tps = _split_plan(q.device, B, programs, max_ctx, block_n, num_splits)
    return _Splits(S, tps, torch.empty(B, n_qh, S, width, dtype=torch.float32, device=q.device),
                   torch.empty(B, n_qh, S, dtype=torch.float32, device=q.device))


def _int32(x: torch.Tensor) -> torch.Tensor:
    """Index metadata as the kernels read it: int32, unit stride in the last dim."""
    if x.dtype != torch.int32:
        x = x.to(torch.int32)
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_common(
    kv_data: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if kv_data.stride(-1) != 1:
        raise ValueError("kv_data must be contiguous in head_dim")
    return _int32(block_tables), _int32(seq_lens)


def paged_decode_attention(
    q: torch.Tensor, kv_data: torch.Tensor, kv_scales: torch.Tensor | None, layer: int,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
    num_splits: int | None = None, max_seq_len: int | None = None, window: int = 0,
) -> torch.Tensor:
    """Split-K paged decode: ``q[B, Hq, D] -> out[B, Hq, D]`` (twin: paged_decode_attention;
    ``window`` > 0: a sliding-window layer, the last ``window`` keys only).

    ``max_seq_len`` (>= every seq_len) sizes the splits; without it the wrapper reads
    ``seq_lens.max()`` (one host sync: pass it on the hot path and under CUDA-graph capture,
    where the block table's capacity is a valid, if slower, bound). ``num_splits`` overrides the
    heuristic (about 4 programs per SM).
    """
    block_tables, seq_lens = _check_common(kv_data, block_tables, seq_lens)
    B, n_qh, D = q.shape
    _, _, C, bs, n_kvh, _ = kv_data.shape
    if C != 2 or n_qh % n_kvh:
        raise ValueError("decode needs a C=2 cache and Hq a multiple of Hkv")
    group = n_qh // n_kvh
    interp = interpreting()
    block_n = 16 if interp else DECODE_CONFIG["BLOCK_N"]
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_l = kv_data[layer]
    sc = _scales_arg(kv_data, kv_scales, layer)
    sp = _splits(q, D, n_kvh, block_tables, seq_lens, bs, max_seq_len, block_n, num_splits)
    dot_dtype = _dot_dtype(q.dtype)
    _decode_split_kernel[(B, n_kvh, sp.num)](
        q, kv_l, sc, block_tables, seq_lens, sp.mid_o, sp.mid_lse, sm_scale * _LOG2E,
        *_strides(q, 0, 1), *_strides(kv_l, 0, 1, 2, 3), *_strides(sc, 0, 1, 2, 3),
        *sp.kernel_args(block_tables), int(window),
        GROUP=group, HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_H=_pow2(group), BLOCK_D=_pow2(D),
        BLOCK_N=block_n, DEQUANT_V=q.dtype == torch.float16, **_kv_flags(kv_data, dot_dtype),
        num_warps=DECODE_CONFIG["num_warps"], num_stages=DECODE_CONFIG["num_stages"],
    )
    return _merge(sp.mid_o, sp.mid_lse, torch.empty_like(q))


# ---------------------------------------------------------------------------------------------
# Prefill / extend: ragged causal attention, one program per (q tile, sequence, query head)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    Q,  # [T, Hq, D]
    KV, SC, BT,
    SEQ_LENS,  # int32 [B]
    QSL,  # int32 [B + 1]
    OUT,  # [T, Hq, D]
    qk_scale, stride_qt, stride_qh, stride_kvb, stride_kvc, stride_kvt, stride_kvh, stride_scb,
    stride_scc, stride_sct, stride_sch, stride_btb, stride_ot, stride_oh,
    window,  # > 0: a sliding-window layer, the query at p sees keys (p - window, p] only
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IS_SCALED: tl.constexpr,
    LOG8_SCALES: tl.constexpr,  # INT8 cache: scales are 1-byte codes e, 2^(e/8)
    DEQUANT_V: tl.constexpr,  # FP8 cache, fp16 model: scale the V rows, not p
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    # Query row m of sequence b sits at position ctx + m and sees keys 0 .. ctx + m:
    #
    #   keys     0 ........ ctx-1 | ctx ........... seq_len-1
    #   q row 0  x x x x x x x x x  x
    #   q row 1  x x x x x x x x x  x x
    #   ...                          (causal staircase over the last q_len positions)
    mt = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(QSL + b)
    q_len = tl.load(QSL + b + 1) - q_start
    seq_len = tl.load(SEQ_LENS + b)
    ctx = seq_len - q_len

    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    pos_m = ctx + offs_m  # [BLOCK_M]

    # keys this tile needs: [0, hi); an idle tile (mt past q_len) gets hi = 0
    hi = tl.minimum(seq_len, ctx + (mt + 1) * BLOCK_M)
    hi = tl.where(mt * BLOCK_M < q_len, hi, 0)
    # ... from the first key of the tile's first row's window (earlier blocks are never read)
    lo = tl.where(window > 0, tl.maximum(ctx + mt * BLOCK_M - window + 1, 0), 0)

    m_i, l_i, acc = _softmax_state(BLOCK_M, BLOCK_D)
    BT_row, kv_head, sc_head = _kv_bases(BT, KV, SC, b, kvh, stride_btb, stride_kvh, stride_sch)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        keep = mask_n[None, :] & (offs_n[None, :] <= pos_m[:, None])  # causal
        keep = keep & ((window == 0) | (offs_n[None, :] > pos_m[:, None] - window))
        # without a window key 0 is in the first tile and visible to every row, so the max is
        # finite from there; with one a row may see nothing yet (``_online_softmax``)
        m_i, l_i, acc = _attend_kv_tile(
            q, m_i, l_i, acc, kv_head, sc_head, BT_row, offs_n, mask_n, keep, offs_d, mask_d,
            qk_scale, stride_kvb, stride_kvc, stride_kvt, stride_scb, stride_scc, stride_sct,
            BLOCK_SIZE, IS_SCALED, LOG8_SCALES, DEQUANT_V, DOT_DTYPE, PRECISION,
        )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = OUT + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_attention(
    q: torch.Tensor, kv_data: torch.Tensor, kv_scales: torch.Tensor | None, layer: int,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    sm_scale: float, max_query_len: int | None = None, window: int = 0,
) -> torch.Tensor:
    """Ragged causal paged attention ``q[T, Hq, D] -> out[T, Hq, D]`` (twin: paged_attention;
    ``window`` > 0: a sliding-window layer).

    ``max_query_len`` (the largest q_len) sizes the grid; without it the wrapper reads it from
    ``query_start_loc`` (one host sync).
    """
    block_tables, seq_lens = _check_common(kv_data, block_tables, seq_lens)
    query_start_loc = _int32(query_start_loc)
    T, n_qh, D = q.shape
    _, _, C, bs, n_kvh, _ = kv_data.shape
    if C != 2 or n_qh % n_kvh:
        raise ValueError("paged_attention needs a C=2 cache and Hq a multiple of Hkv")
    B = seq_lens.shape[0]
    out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    interp = interpreting()
    cfg = PREFILL_CONFIG if max_query_len < 128 else PREFILL_CONFIG_LONG
    block_m, block_n = (16, 16) if interp else (cfg["BLOCK_M"], cfg["BLOCK_N"])
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_l = kv_data[layer]
    sc = _scales_arg(kv_data, kv_scales, layer)
    dot_dtype = _dot_dtype(q.dtype)
    grid = (triton.cdiv(max(max_query_len, 1), block_m), B, n_qh)
    _prefill_kernel[grid](
        q, kv_l, sc, block_tables, seq_lens, query_start_loc, out, sm_scale * _LOG2E,
        *_strides(q, 0, 1), *_strides(kv_l, 0, 1, 2, 3), *_strides(sc, 0, 1, 2, 3),
        block_tables.stride(0), *_strides(out, 0, 1), int(window),
        GROUP=n_qh // n_kvh, HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_D=_pow2(D),
        BLOCK_N=block_n, DEQUANT_V=q.dtype == torch.float16, **_kv_flags(kv_data, dot_dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


# ---------------------------------------------------------------------------------------------
# MLA decode over the latent cache (C = 1, one kv head, row = [c_kv | k_rope])
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mla_split_kernel(
    QN,  # [B, Hq, L] absorbed q_nope
    QR,  # [B, Hq, R] q_rope
    KV,  # kv_data[layer]: [NB, 1, bs, 1, L + R]
    SC,  # kv_scales[layer]: [NB, 1, bs, 1] (FP8) or dummy
    BT, SEQ_LENS,
    MID_O,  # fp32 [B, Hq, S, L]
    MID_LSE,  # fp32 [B, Hq, S]
    qk_scale, stride_qnb, stride_qnh, stride_qrb, stride_qrh, stride_kvb, stride_kvt,
    stride_scb, stride_sct, stride_btb, stride_mob, stride_moh, stride_mos, stride_mlb,
    stride_mlh, tokens_per_split, NUM_HEADS: tl.constexpr, LORA: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IS_SCALED: tl.constexpr,
    LOG8_SCALES: tl.constexpr,  # INT8 cache: scales are 1-byte codes e, 2^(e/8)
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    # cached row of one token (head_dim = LORA + ROPE):
    #   | c_kv: cols [0, LORA)  (scores AND values) | k_rope: cols [LORA, LORA+ROPE) (scores) |
    b, split, seq_len, start, end = _split_bounds(SEQ_LENS, tokens_per_split)
    hb = tl.program_id(1)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < NUM_HEADS
    mask_l = offs_l < LORA
    mask_r = offs_r < ROPE
    b64 = b.to(tl.int64)
    qn = tl.load(
        QN + b64 * stride_qnb + offs_h[:, None] * stride_qnh + offs_l[None, :],
        mask=mask_h[:, None] & mask_l[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    qr = tl.load(
        QR + b64 * stride_qrb + offs_h[:, None] * stride_qrh + offs_r[None, :],
        mask=mask_h[:, None] & mask_r[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    BT_row = BT + b64 * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        row, srow = _row_offsets(
            BT_row, offs_n, mask_n, stride_kvb, stride_kvt, stride_scb, stride_sct, BLOCK_SIZE
        )
        c = tl.load(
            KV + row[:, None] + offs_l[None, :], mask=mask_n[:, None] & mask_l[None, :], other=0.0
        )
        r = tl.load(
            KV + LORA + row[:, None] + offs_r[None, :],
            mask=mask_n[:, None] & mask_r[None, :],
            other=0.0,
        )
        c = c.to(DOT_DTYPE)  # [BLOCK_N, BLOCK_L]
        s = tl.dot(qn, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(qr, tl.trans(r.to(DOT_DTYPE)), input_precision=PRECISION)
        if IS_SCALED:
            sc = _scale(tl.load(SC + srow, mask=mask_n, other=0), LOG8_SCALES)
            s = s * sc[None, :]
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        if IS_SCALED:
            p = p * sc[None, :]  # one scale per row covers c_kv and k_rope alike
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision=PRECISION)

    out, lse = _split_result(acc, m_i, l_i)
    mo = MID_O + b64 * stride_mob + offs_h[:, None] * stride_moh + split * stride_mos
    tl.store(mo + offs_l[None, :], out, mask=mask_h[:, None] & mask_l[None, :])
    tl.store(MID_LSE + b64 * stride_mlb + offs_h * stride_mlh + split, lse, mask=mask_h)


def mla_decode(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, kv_data: torch.Tensor,
               kv_scales: torch.Tensor | None, layer: int, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, sm_scale: float, kv_lora_rank: int,
               num_splits: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Split-K MLA decode ``-> out_latent[B, Hq, kv_lora_rank]`` (twin: mla_decode).

    ``num_splits`` / ``max_seq_len`` as in :func:`paged_decode_attention`.
    """
    block_tables, seq_lens = _check_common(kv_data, block_tables, seq_lens)
    _, _, C, bs, n_kvh, row_dim = kv_data.shape
    if C != 1 or n_kvh != 1:
        raise ValueError("MLA cache must have C = 1 and num_kv_heads = 1")
    B, n_qh, lora = q_nope_absorbed.shape
    R = row_dim - kv_lora_rank
    if lora != kv_lora_rank or q_rope.shape != (B, n_qh, R):
        raise ValueError("q shapes do not match kv_lora_rank / the cached row width")
    interp = interpreting()
    block_n = 16 if interp else 32
    block_h = 16
    qn = q_nope_absorbed if q_nope_absorbed.stride(-1) == 1 else q_nope_absorbed.contiguous()
    qr = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    kv_l = kv_data[layer]
    sc = _scales_arg(kv_data, kv_scales, layer)
    n_hblocks = triton.cdiv(n_qh, block_h)
    sp = _splits(qn, lora, n_hblocks, block_tables, seq_lens, bs, max_seq_len, block_n,
                 num_splits)
    dot_dtype = _dot_dtype(qn.dtype)
    _mla_split_kernel[(B, n_hblocks, sp.num)](
        qn, qr, kv_l, sc, block_tables, seq_lens, sp.mid_o, sp.mid_lse, sm_scale * _LOG2E,
        *_strides(qn, 0, 1), *_strides(qr, 0, 1), *_strides(kv_l, 0, 2), *_strides(sc, 0, 2),
        *sp.kernel_args(block_tables),
        NUM_HEADS=n_qh, LORA=lora, ROPE=R, BLOCK_SIZE=bs, BLOCK_H=block_h,
        BLOCK_L=_pow2(lora), BLOCK_R=_pow2(R), BLOCK_N=block_n, **_kv_flags(kv_data, dot_dtype),
        num_warps=8 if lora >= 256 else 4, num_stages=2,
    )
    return _merge(sp.mid_o, sp.mid_lse, torch.empty_like(qn))
