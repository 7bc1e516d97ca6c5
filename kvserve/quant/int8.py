"""INT8 quantize/dequantize for the KV cache: one bf16 scale per (token, head, K-or-V) row.

Symmetric (what the cache stores)::

    scale = bf16_rne(max(amax, 1e-12) / 127)          amax = max_d |x|   (fp32)
    q     = clamp(rne(x / scale), -127, 127)  int8     (round half to even, like rintf)
    x'    = q * scale                                  |x' - x| <= scale / 2 per element

A uniform 8-bit grid keeps ~7 bits of every element where E4M3 keeps 3 mantissa bits; after
the per-head rotation (``kvserve.quant.rotation``) a row's values are spread evenly, which is
the case a uniform grid fits best. -128 is never produced (the grid is symmetric).

Byte cost: 2 scale bytes per head_dim-wide row, the same as FP8 (3.1% at head_dim 64, 1.6%
at 128), so INT8 KV holds as many tokens as FP8 KV.

``quantize_asymmetric`` (min/max grid, a bf16 scale AND a bf16 zero point per row: twice the
scale bytes) is kept for the measurement that chose symmetric (``benchmarks/kv8_sim.py``); the
cache never stores it.

The C writer ``kvs_write_int8`` (kvserve/csrc/paged_attention.c) is bit-exact with
``compute_scales`` + ``quantize`` here (tests/attention/test_cpu_kernel.py).
"""

from __future__ import annotations

import torch

QMAX = 127.0
_MIN_AMAX = 1e-12


def compute_scales(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> bf16 scales [...]: amax / 127 per row, rounded to bf16."""
    amax = x.detach().abs().amax(dim=-1).float().clamp_min_(_MIN_AMAX)
    return (amax / QMAX).to(torch.bfloat16)


def quantize(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., D] float, bf16 scales [...] -> int8 [..., D] (RNE, clamped to +-127)."""
    y = x.float() / scales.float().unsqueeze(-1)
    return torch.round(y).clamp_(-QMAX, QMAX).to(torch.int8)


def quantize_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = compute_scales(x)
    return quantize(x, scales), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 [..., D], bf16 scales [...] -> fp32 [..., D]."""
    return q.float() * scales.float().unsqueeze(-1)


def quantize_asymmetric(x: torch.Tensor) -> torch.Tensor:
    """Measurement only: x [..., D] -> its fake-quantized fp32 values on a 255-level min/max
    grid per row (bf16 scale and bf16 zero point ``lo``), ``x' = lo + q * scale``."""
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True).to(torch.bfloat16).float()
    hi = xf.amax(dim=-1, keepdim=True)
    scale = ((hi - lo).clamp_min(_MIN_AMAX) / 255.0).to(torch.bfloat16).float()
    q = torch.round((xf - lo) / scale).clamp_(0, 255)
    return lo + q * scale
