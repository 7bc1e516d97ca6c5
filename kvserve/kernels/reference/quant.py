"""Twins of the KV row quantizers: FP8 (E4M3 / E5M2, bf16 scale per row) and INT8 (1-byte
log-domain scale code per row), bit-identical with the C writer (kvserve/csrc/paged_attention.c)
and the Triton writer (kvserve/kernels/triton/cache.py).

The number formats themselves (FP8_MAX, the INT8 code table ``code_to_scale``, the fast FP8
read ``fp8_to_half_bits``) live in :mod:`kvserve.quant.fp8` / :mod:`kvserve.quant.int8`, whose
docstrings give the formulas and the non-finite rules these functions implement.
"""

from __future__ import annotations

import torch

from kvserve.config import KVStorage
from kvserve.quant import fp8, int8

_MIN_AMAX = 1e-12
_FLT_MAX = torch.finfo(torch.float32).max


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value: 448 for e4m3fn, 57344 for e5m2."""
    if not KVStorage(dtype).is_fp8:
        raise ValueError(f"{dtype} is not an FP8 storage dtype")
    return fp8.FP8_MAX[dtype]


# ---- FP8 ------------------------------------------------------------------------------------


def fp8_compute_scales(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] -> bf16 scales [...]: amax/FP8_MAX per row, rounded to bf16 (NaN elements
    ignored, amax clamped to [1e-12, FLT_MAX]: the scale is always finite and positive)."""
    a = x.detach().abs().float()
    amax = a.masked_fill_(a.isnan(), 0.0).amax(dim=-1).clamp_(_MIN_AMAX, _FLT_MAX)
    return (amax / fp8.FP8_MAX[fp8_dtype]).to(torch.bfloat16)


def fp8_quantize(
    x: torch.Tensor, scales: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """x [..., D] float, scales [...] -> fp8 [..., D]. Clamped, so outliers never give NaN/inf
    (+-inf -> +-FP8_MAX; a NaN element is stored as 0, as the C writer does)."""
    fmax = fp8.FP8_MAX[fp8_dtype]
    y = x.float() / scales.float().unsqueeze(-1)
    return y.nan_to_num_(nan=0.0).clamp_(-fmax, fmax).to(fp8_dtype)


def fp8_quantize_dynamic(x: torch.Tensor, fp8_dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 payload [..., D], bf16 scales [...]): what the cache stores."""
    scales = fp8_compute_scales(x, fp8_dtype)
    return fp8_quantize(x, scales, fp8_dtype), scales


def fp8_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 [..., D], bf16 scales [...] -> fp32 [..., D] (torch's slow cast; the CPU backend
    reads through ``kvserve.quant.fp8.fp8_to_half_bits`` instead)."""
    return q.float() * scales.float().unsqueeze(-1)


# ---- INT8 -----------------------------------------------------------------------------------


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| per row, NaN elements ignored (as the C writer's ``a > amax`` compare does)."""
    a = x.detach().abs().float()
    return a.masked_fill_(a.isnan(), 0.0).amax(dim=-1)


def int8_compute_codes(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> int8 codes [...]: the smallest e with 127 * 2^(e/8) >= amax (fp32).

    Non-finite input (kvserve/quant/int8.py): NaN elements do not enter amax; an inf amax gets
    code 127; an all-zero (or all-NaN) row gets code -128."""
    amax = _amax(x)
    thresh = int8.THRESHOLDS.to(amax.device)
    idx = torch.searchsorted(thresh, amax.contiguous(), right=False).clamp_(max=255)
    return (idx - 128).to(torch.int8)


def int8_compute_scales(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> the fp32 scales the cache uses (``code_to_scale(int8_compute_codes(x))``)."""
    return int8.code_to_scale(int8_compute_codes(x))


def int8_quantize(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., D] float, scales [...] (fp32 or bf16 values) -> int8 [..., D] (RNE, +-127;
    NaN -> 0, +-inf -> +-127)."""
    y = x.float() / scales.float().unsqueeze(-1)
    return torch.round(y).nan_to_num_(nan=0.0).clamp_(-int8.QMAX, int8.QMAX).to(torch.int8)


def int8_quantize_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 payload [..., D], int8 scale codes [...]): what the cache stores."""
    codes = int8_compute_codes(x)
    return int8_quantize(x, int8.code_to_scale(codes)), codes


def int8_dequantize(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """int8 [..., D], int8 scale codes [...] -> fp32 [..., D]."""
    return q.float() * int8.code_to_scale(codes).unsqueeze(-1)


# ---- rows of either kind --------------------------------------------------------------------


def static_scale_rows(scale: float | torch.Tensor, shape: torch.Size) -> torch.Tensor:
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
        scale = fp8_compute_scales(xf, dtype)
    else:
        scale = static_scale_rows(static_scale, xf.shape[:-1]).clone()
    return fp8_quantize(xf, scale, dtype), scale


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of stored rows ``data[..., D]`` (``scales[...]`` for FP8 / INT8, else
    None)."""
    kind = KVStorage(data.dtype)
    if kind.scaled:
        assert scales is not None, "FP8 / INT8 cache needs kv_scales"
        if kind.is_int8:
            return int8_dequantize(data, scales)
        return fp8_dequantize(data, scales)
    return data.float()
