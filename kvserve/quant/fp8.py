"""FP8 (E4M3 / E5M2) quantize/dequantize pairs for the KV cache.

Scales are dynamic, one per (token, head, K-or-V) row, computed at write time and stored as
bfloat16 beside the payload (2 bytes per head_dim-wide row: 3.1% at head_dim 64, 1.6% at 128).
The stored (bf16-rounded) scale is the one used to quantize, so dequantization is exact up to
FP8 rounding; saturation is impossible because values are clamped to +-FP8_MAX after scaling.

The quantizer's pure-torch twin (``fp8_compute_scales`` / ``fp8_quantize`` /
``fp8_dequantize``) lives with every other kernel twin in :mod:`kvserve.kernels.reference`.
Non-finite input (the C writer and that twin agree bit for bit): NaN elements are stored as 0 and
do not enter the row's amax; amax is clamped to [1e-12, FLT_MAX], so the stored scale is always
finite (an inf element saturates to +-FP8_MAX and reads back as a huge finite value instead of
making the whole row 0 * inf = NaN); an all-zero row gets the smallest scale and exact zeros.

Reading FP8 on CPU: torch's float8 -> float cast runs at ~0.4 GB/s here. ``fp8_to_half_bits``
instead rebuilds an fp16 bit pattern with integer ops into preallocated buffers (~3.5x faster):

    e4m3 byte  s eeee mmm           fp16  s 0eeee mmm0000000  == value * 2**-8  (bias 7 vs 15)
    e5m2 byte  s eeeee mm           fp16  s eeeee mm00000000  == value          (same bias)

For e4m3, sign-extending the byte to int16 and shifting left by 7 puts the sign in bit 15 and
the exponent/mantissa in bits 13..7; bit 14 then holds a copy of the sign and is masked off.
Subnormals map to fp16 subnormals exactly; the 2**8 factor is folded into the scale.
"""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# value = half_bits_value * HALF_BITS_FACTOR[dtype] * scale
HALF_BITS_FACTOR = {torch.float8_e4m3fn: 256.0, torch.float8_e5m2: 1.0}


def fp8_to_half_bits(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Fast path: fp8 tensor -> fp16 tensor (same shape) equal to value / HALF_BITS_FACTOR.

    ``out`` is a preallocated int16 tensor with q's shape (contiguous); returned viewed as fp16.
    """
    raw = q.view(torch.int8)
    out.copy_(raw)  # sign-extending int8 -> int16
    if q.dtype == torch.float8_e4m3fn:
        out.bitwise_left_shift_(7)
        out.bitwise_and_(-16385)  # clear bit 14 (0xBFFF as int16)
    elif q.dtype == torch.float8_e5m2:
        out.bitwise_left_shift_(8)
    else:
        raise ValueError(f"not an fp8 dtype: {q.dtype}")
    return out.view(torch.float16)
