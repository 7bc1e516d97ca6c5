"""INT8 quantize/dequantize for the KV cache: one 1-byte scale per (token, head, K-or-V) row.

Symmetric, with a log-domain 8-bit scale (what the cache stores)::

    scale(e) = 2^(e / 8)                     e an int8 code in [-128, 127]  (stored: 1 byte)
    e        = the smallest code with 127 * scale(e) >= amax     (fp32 compare; amax = max|x|)
    q        = clamp(rne(x / scale(e)), -127, 127)  int8  (round half to even, like rintf)
    x'       = q * scale(e)                         |x' - x| <= scale(e) / 2 per element

The scale is rounded UP to the next step of 2^(1/8) (9.05%), so |x / scale| <= 127 always
holds (nothing clips); the price is that a row's amax lands on 116.5..127 levels instead of
exactly 127, i.e. at most 0.125 bit (0.06 bit on average) of the 7 a row has. The range,
2^-16 .. 2^15.875, covers amax from ~1.9e-3 (a row below that is quantized on the 2^-16 grid:
an absolute error <= 7.6e-6) to ~7.6e6 (above: clamped to +-127). ``scale(e)`` is exact in
fp32 and identical everywhere: ``2^floor(e/8) * M[e mod 8]`` with the 8 fp32 constants
``M[k] = fp32(2^(k/8))`` (``SCALE_MANTISSAS``; the C kernel has the same literals).

A uniform 8-bit grid keeps ~7 bits of every element where E4M3 keeps 3 mantissa bits; after
the per-head rotation (``kvserve.quant.rotation``) a row's values are spread evenly, which is
the case a uniform grid fits best. -128 is never produced (the grid is symmetric).

Non-finite input never reaches the cache as an undefined code (the C writer and its twin
agree bit for bit; the Triton writer is not yet aligned for NaN): a NaN element is stored as
0 and does not enter the row's amax; +-inf saturates (amax = inf -> code 127, the element ->
+-127); an all-zero (or all-NaN) row gets code -128 and exact zeros. Scales are per row, so
such a row never changes another row's codes (tests/quant/test_kv_nonfinite.py).

Byte cost: 1 scale byte per head_dim-wide row (1.6% at head_dim 64, 0.8% at 128; FP8 keeps
a bf16 scale: 3.1% / 1.6%), so INT8 KV holds 1.97x the tokens of BF16 at head_dim 64.
Rounding the scale up to a 2^(1/8) grid instead of storing bf16(amax / 127) costs nothing
measurable on SmolLM2 (docs/benchmarks.md, "8-bit KV on a real model").

The alternatives measured before choosing this one (an asymmetric min/max grid, bf16 scales)
live in ``benchmarks/kv8_sim.py``; the cache never stores them.

This module holds the format (the code table); the quantizer's pure-torch twin
(``int8_compute_codes`` / ``int8_quantize`` / ``int8_quantize_dynamic`` / ``int8_dequantize``)
lives with every other kernel twin in :mod:`kvserve.kernels.reference`. The C writer
``kvs_write_int8`` (kvserve/csrc/paged_attention.c) and the Triton writer are bit-exact with
it (tests/attention/test_cpu_kernel.py, tests/kernels).
"""

from __future__ import annotations

import torch

QMAX = 127.0
SCALE_DTYPE = torch.int8  # what the cache stores per row: the code e
CODE_MIN, CODE_MAX = -128, 127
#: fp32(2^(k/8)), k = 0..7 (correctly rounded; the C kernel carries the same literals).
SCALE_MANTISSAS = (1.0, 1.0905077457427979, 1.1892070770263672, 1.2968395948410034,
                   1.4142135381698608, 1.5422108173370361, 1.6817928552627563,
                   1.8340080976486206)


def _table() -> torch.Tensor:
    e = torch.arange(CODE_MIN, CODE_MAX + 1, dtype=torch.int64)
    m = torch.tensor(SCALE_MANTISSAS, dtype=torch.float32)[e % 8]
    return torch.ldexp(m, torch.div(e, 8, rounding_mode="floor").float()).float()


#: scale(e) for e = -128..127 (index e + 128), fp32 [256]; and 127 * scale(e) (fp32 products).
SCALE_TABLE = _table()
#: 127 * scale(e) (fp32 products): a row takes the first code whose threshold covers its amax.
THRESHOLDS = SCALE_TABLE * QMAX


def code_to_scale(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [...] -> fp32 scales [...] (exact)."""
    table = SCALE_TABLE.to(codes.device)
    return table[codes.long() + 128]
