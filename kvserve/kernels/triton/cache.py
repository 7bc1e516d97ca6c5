"""Fused paged-KV cache write: copy or FP8 / INT8-quantise, store, accumulate the checksum state.

Twin (the spec): :func:`kvserve.kernels.reference.write_kv`. The result is bit-exact with the
twin on every backend: all float -> narrower-float roundings the write needs (fp32 -> bf16 for
the scale, fp32 -> fp8 for the payload) are done here with integer arithmetic, round to nearest
even, exactly as torch does them. That also sidesteps the Triton interpreter, whose own
downcasts truncate, and keeps the checksum state of a block identical across backends.

One program per token (grid = (T,)); it handles every head and both components of its token::

    k/v[t]  [H, D]  --quantise-->  kv_data[layer, blk, c, off, :, :]     payload words
                                   kv_scales[layer, blk, c, off, :]      scale words (FP8)
                                                                         / scale bytes (INT8)
            per-token partial (S1, S2, S1s, S2s) --atomic add--> csum_state[layer, blk, :]

Word indices inside the block (see reference.token_checksum_contrib), element index
e = ((c*bs + off)*H + h)*D + d of the [C, bs, H, D] payload:

    2-byte storage:  element e is word e
    4-byte storage:  element e is words 2e (low half) and 2e+1 (high half)
    1-byte (FP8, INT8): byte e is half of word e // 2: w = byte[2k] + 256 * int8(byte[2k+1])
                     so an even byte adds its unsigned value, an odd byte 256 * its signed value

INT8's scale is a 1-byte code e (scale = 2^(e/8), kvserve/quant/int8.py): the smallest e with
127 * scale(e) >= amax, found from a log2 guess and exact compares against the same fp32 table
the twin uses (``TABLE``); its byte (c*bs + off)*H + h of the block's scale bytes adds to the
scale sums by the same byte rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.config import KVStorage
from kvserve.kernels import reference as ref

__all__ = ["write_kv", "fp32_to_fp8_bits", "fp32_to_bf16_bits"]

_MODE_COPY16 = 0
_MODE_COPY32 = 1
_MODE_FP8 = 2

# (mantissa bits, exponent bias) of the two FP8 storage formats.
_FP8_FORMAT: dict[torch.dtype, tuple[int, int]] = {
    torch.float8_e4m3fn: (3, 7),
    torch.float8_e5m2: (2, 15),
}


@triton.jit
def _fp32_to_bf16_bits(x):
    """RNE bf16 bit pattern (int32 in [0, 65535]) of finite, non-negative fp32 ``x``."""
    b = x.to(tl.int32, bitcast=True)
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


@triton.jit
def _bf16_bits_to_fp32(bits):
    """fp32 value of bf16 bit patterns given as int32 in [0, 65535]."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _fp32_to_fp8_bits(
    y, MANT: tl.constexpr, BIAS: tl.constexpr, SUB_SCALE: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
):
    """RNE FP8 bit pattern (int32 in [0, 255]) of fp32 ``y`` with |y| <= FP8_MAX.

    Normal results round the 23-bit fp32 mantissa to MANT bits (a carry correctly bumps the
    exponent) and rebias the exponent; subnormal results (|y| < MIN_NORMAL) are the integer
    multiple of 2^(1 - BIAS - MANT) nearest to |y|, ties to even. Matches torch's ``.to()``.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    # normal range
    r = (a_bits + ((1 << (22 - MANT)) - 1) + ((a_bits >> (23 - MANT)) & 1)) >> (23 - MANT)
    normal = r - ((127 - BIAS) << MANT)
    # subnormal range: t = |y| / 2^(1 - BIAS - MANT) is exact (power-of-two scaling), t < 2^MANT
    t = tl.minimum(a, MIN_NORMAL) * SUB_SCALE  # (min: no int overflow on the unused lanes)
    n = t.to(tl.int32)
    frac = t - n.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))
    sub = n + up.to(tl.int32)
    return tl.where(a < MIN_NORMAL, sub, normal) | sign


@triton.jit
def _sum_all(x):
    return tl.sum(tl.sum(x, axis=1), axis=0)


@triton.jit
def _write_kv_kernel(
    K,  # [T, H, D] (int16/int32 view for copies, float for FP8)
    V,  # like K, or K again when NUM_COMP == 1
    SLOTS,  # int64 [T]
    KV,  # kv_data[layer] as uint8 / int16 / int32: [num_blocks, C, bs, H, D]
    SC,  # kv_scales[layer] as int16 [num_blocks, C, bs, H] (FP8) or a dummy
    CSUM,  # csum_state[layer] int64 [num_blocks, 4] or a dummy
    STATIC,  # int16 bf16 bits [C, H] of static scales, or a dummy
    TABLE,  # fp32 [256] INT8 scales 2^(e/8) (index e + 128), or a dummy
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kvb, stride_kvc, stride_kvt, stride_kvh,
    stride_scb, stride_scc, stride_sct, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_COMP: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, MODE: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
    BIAS: tl.constexpr, SUB_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr,
    STATIC_SCALE: tl.constexpr, WITH_CSUM: tl.constexpr,
    INT8: tl.constexpr = False,  # MODE 2 with a symmetric INT8 grid (FP8_MAX = 127)
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # (the validity is folded into the bound: the interpreter mis-types `tensor & scalar_bool`)
    mask_h = offs_h < tl.where(valid, NUM_HEADS, 0)
    mask = mask_h[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

    s1 = tl.zeros([1], dtype=tl.int64)
    s2 = tl.zeros([1], dtype=tl.int64)
    ss1 = tl.zeros([1], dtype=tl.int64)
    ss2 = tl.zeros([1], dtype=tl.int64)
    for c in tl.static_range(NUM_COMP):
        if c == 0:
            src = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
        else:
            src = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        row = blk * stride_kvb + c * stride_kvc + off * stride_kvt
        dst = KV + row + offs_h[:, None] * stride_kvh + offs_d[None, :]
        # element index inside the block payload [C, bs, H, D] (int64)
        e = ((c * BLOCK_SIZE + off) * NUM_HEADS + offs_h[:, None]) * HEAD_DIM + offs_d[None, :]
        if MODE == 2:
            x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            if INT8:
                amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_H]
                g = tl.math.ceil(8.0 * tl.math.log2(tl.maximum(amax, 1e-30) / 127.0))
                code = tl.minimum(tl.maximum(g, -128.0), 127.0).to(tl.int32)
                for _ in tl.static_range(2):  # exact search around the guess (monotone table)
                    lo = tl.load(TABLE + tl.maximum(code - 1, -128) + 128)
                    code = tl.where((code > -128) & (127.0 * lo >= amax), code - 1, code)
                for _ in tl.static_range(2):
                    cur = tl.load(TABLE + code + 128)
                    code = tl.where((code < 127) & (127.0 * cur < amax), code + 1, code)
                sbits = code  # int32 in [-128, 127]
            elif STATIC_SCALE:
                sbits = tl.load(STATIC + c * NUM_HEADS + offs_h, mask=mask_h, other=0)
                sbits = sbits.to(tl.int32) & 0xFFFF
            else:
                amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)  # [BLOCK_H]
                # div_rn: IEEE division like torch ('/' is approximate on NVIDIA); it does
                # not broadcast, hence the explicit full/broadcast_to
                fmax = tl.full([BLOCK_H], FP8_MAX, dtype=tl.float32)
                sbits = _fp32_to_bf16_bits(tl.math.div_rn(amax, fmax))
            if INT8:  # noqa: SIM108 (a constexpr branch)
                scale = tl.load(TABLE + sbits + 128)  # [BLOCK_H], exactly the twin's scale
            else:
                scale = _bf16_bits_to_fp32(sbits)  # [BLOCK_H], exactly the stored bf16 value
            y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], [BLOCK_H, BLOCK_D]))
            y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
            if INT8:
                # round half to even (|y| <= 127 < 2^22: adding 1.5 * 2^23 leaves an fp32 whose
                # ulp is 1, so the add rounds y to an integer RNE), then two's-complement byte
                r = (y + 12582912.0) - 12582912.0
                byte = r.to(tl.int32) & 0xFF  # int32 [0, 255]
            else:
                byte = _fp32_to_fp8_bits(y, MANT, BIAS, SUB_SCALE, MIN_NORMAL)  # int32 [0, 255]
            tl.store(dst, byte.to(tl.uint8), mask=mask)
            hi = tl.where(byte >= 128, byte - 256, byte) * 256
            contrib = tl.where((offs_d % 2 == 1)[None, :], hi, byte).to(tl.int64)
            contrib = tl.where(mask, contrib, 0)
            s1 += _sum_all(contrib)
            s2 += _sum_all((e // 2 + 1) * contrib)
            sdst = SC + blk * stride_scb + c * stride_scc + off * stride_sct + offs_h
            sidx = (c * BLOCK_SIZE + off) * NUM_HEADS + offs_h
            if INT8:
                # scale bytes: byte sidx of the block's codes, half of word sidx // 2
                tl.store(sdst, sbits.to(tl.int8), mask=mask_h)
                sb = tl.where(sidx % 2 == 1, sbits * 256, sbits & 0xFF)
                sb = tl.where(mask_h, sb, 0).to(tl.int64)
                ss1 += tl.sum(sb, axis=0)
                ss2 += tl.sum((sidx // 2 + 1) * sb, axis=0)
            else:
                # scale words: one per (c, off, h), index (c*bs + off)*H + h
                sw = tl.where(sbits >= 32768, sbits - 65536, sbits)
                sw = tl.where(mask_h, sw, 0).to(tl.int64)
                tl.store(sdst, sw.to(tl.int16), mask=mask_h)
                ss1 += tl.sum(sw, axis=0)
                ss2 += tl.sum((sidx + 1) * sw, axis=0)
        elif MODE == 0:
            w = tl.load(src, mask=mask, other=0)  # int16 bits
            tl.store(dst, w, mask=mask)
            contrib = w.to(tl.int64)
            s1 += _sum_all(contrib)
            s2 += _sum_all((e + 1) * contrib)
        else:
            w = tl.load(src, mask=mask, other=0)  # int32 bits
            tl.store(dst, w, mask=mask)
            lo = ((w << 16) >> 16).to(tl.int64)  # signed low half: word 2e
            hi = (w >> 16).to(tl.int64)  # signed high half: word 2e + 1
            s1 += _sum_all(lo + hi)
            s2 += _sum_all((2 * e + 1) * lo + (2 * e + 2) * hi)
    if WITH_CSUM:
        one = tl.arange(0, 1)
        base = CSUM + blk * 4 + one
        valid = one < tl.where(valid, 1, 0)  # [1] mask (see mask_h)
        tl.atomic_add(base + 0, s1, mask=valid)
        tl.atomic_add(base + 1, s2, mask=valid)
        if MODE == 2:
            tl.atomic_add(base + 2, ss1, mask=valid)
            tl.atomic_add(base + 3, ss2, mask=valid)


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(n))


def _int_view(x: torch.Tensor) -> torch.Tensor:
    """Same bytes as int16 (2-byte dtypes) or int32 (4-byte dtypes)."""
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def write_kv(
    kv_data: torch.Tensor, kv_scales: torch.Tensor | None, layer: int,
    slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
    csum_state: torch.Tensor | None = None, k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Triton twin of :func:`kvserve.kernels.reference.write_kv` (same arguments, in place)."""
    n_comp = kv_data.shape[2]
    if (v is None) != (n_comp == 1):
        raise ValueError("pass v for a C=2 (K/V) cache and v=None for a C=1 (MLA) cache")
    T = slot_mapping.shape[0]
    if T == 0:
        return
    _, _, _, bs, n_heads, head_dim = kv_data.shape
    kind = KVStorage(kv_data.dtype)
    i8 = kind.is_int8
    fp8 = kind.scaled  # FP8 or INT8: both quantised with per-row scales (MODE 2)
    if fp8 and kv_scales is None:
        raise ValueError("an FP8 / INT8 cache needs kv_scales")
    if fp8 and head_dim % 2:
        raise ValueError("FP8 / INT8 checksum words need an even head_dim")
    if i8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale / v_scale: an INT8 cache takes dynamic scales only")
    kv_l = kv_data[layer]  # [NB, C, bs, H, D]; layer offset applied on the host (int64-safe)
    if kv_l.stride(-1) != 1:
        raise ValueError("kv_data must be contiguous in head_dim")

    def prep(x: torch.Tensor) -> torch.Tensor:
        if not fp8 and x.dtype != kv_data.dtype:
            x = x.to(kv_data.dtype)
        if x.stride(-1) != 1:
            x = x.contiguous()
        return x if fp8 else _int_view(x)

    kk = prep(k)
    vv = prep(v) if v is not None else kk
    if fp8:
        mode, kv_view = _MODE_FP8, kv_l.view(torch.uint8)
        mant, bias = _FP8_FORMAT.get(kv_data.dtype, (3, 7))  # (unused for INT8)
        fmax = 127.0 if i8 else ref.fp8_max(kv_data.dtype)
        sc = kv_scales[layer]  # type: ignore[index]
        if i8 and sc.dtype != kind.scale_dtype:
            raise ValueError(f"kv_scales: an INT8 cache stores int8 scale codes, got {sc.dtype}")
        sc = sc if i8 else sc.view(torch.int16)
    else:
        mode = _MODE_COPY16 if kv_data.element_size() == 2 else _MODE_COPY32
        kv_view = _int_view(kv_l)
        mant, bias, fmax = 3, 7, 448.0  # unused
        sc = kv_view
    statics = [k_scale] + ([v_scale] if v is not None else [])
    use_static = fp8 and any(s is not None for s in statics)
    if use_static:
        if any(s is None for s in statics):
            raise ValueError("give static scales for both K and V, or for neither")
        rows = [ref.static_scale_rows(s, torch.Size([n_heads])) for s in statics]
        static = torch.stack(rows).contiguous().view(torch.int16).to(kv_data.device)
    else:
        static = sc
    with_csum = csum_state is not None
    csum = csum_state[layer] if csum_state is not None else sc
    slots = slot_mapping.to(device=kv_data.device, dtype=torch.int64)
    if i8:
        from kvserve.quant import int8

        table = int8.SCALE_TABLE.to(kv_data.device)
    else:
        table = sc
    _write_kv_kernel[(T,)](
        kk,
        vv,
        slots,
        kv_view,
        sc,
        csum,
        static,
        table,
        kk.stride(0),
        kk.stride(1),
        vv.stride(0),
        vv.stride(1),
        kv_view.stride(0),
        kv_view.stride(1),
        kv_view.stride(2),
        kv_view.stride(3),
        sc.stride(0),
        sc.stride(1),
        sc.stride(2),
        NUM_HEADS=n_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=bs,
        NUM_COMP=n_comp,
        BLOCK_H=_pow2(n_heads),
        BLOCK_D=_pow2(head_dim, 2),
        MODE=mode,
        FP8_MAX=fmax,
        **_fp8_format(mant, bias),
        STATIC_SCALE=use_static,
        WITH_CSUM=with_csum,
        INT8=i8,
        num_warps=4,
    )


# ---------------------------------------------------------------------------------------------
# Test hooks for the integer rounding helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _round_kernel(
    X, OUT, n, TO_FP8: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    SUB_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(X + offs, mask=m, other=0.0)
    if TO_FP8:  # noqa: SIM108 (a constexpr branch)
        r = _fp32_to_fp8_bits(x, MANT, BIAS, SUB_SCALE, MIN_NORMAL)
    else:
        r = _fp32_to_bf16_bits(x)
    tl.store(OUT + offs, r, mask=m)


def _fp8_format(mant: int, bias: int) -> dict[str, object]:
    """The constexprs of ``_fp32_to_fp8_bits`` for an FP8 format (mantissa bits, bias)."""
    return {"MANT": mant, "BIAS": bias, "SUB_SCALE": float(2.0 ** (bias - 1 + mant)),
            "MIN_NORMAL": float(2.0 ** (1 - bias))}


def _round(x: torch.Tensor, to_fp8: bool, fmt: dict[str, object]) -> torch.Tensor:
    x = x.float().contiguous()
    out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    block = 1024
    _round_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), TO_FP8=to_fp8, **fmt,
                                                    BLOCK=block)
    return out


def fp32_to_fp8_bits(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """In-kernel RNE fp32 -> FP8 bits of ``x`` (|x| <= FP8_MAX), as int32; for tests."""
    return _round(x, True, _fp8_format(*_FP8_FORMAT[dtype]))


def fp32_to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """In-kernel RNE fp32 -> bf16 bits of finite non-negative ``x``, as int32; for tests."""
    return _round(x, False, {"MANT": 0, "BIAS": 0, "SUB_SCALE": 1.0, "MIN_NORMAL": 1.0})
