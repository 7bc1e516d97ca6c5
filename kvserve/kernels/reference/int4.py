"""Twin of the INT4 weight-only GEMM (the Triton kernel of kvserve/kernels/triton/int4.py and
the C GEMV of kvserve/csrc/int4_gemv.c), over the compressed-tensors "pack-quantized" layout.
The format's own packer and unpacker are :mod:`kvserve.quant.int4`."""

from __future__ import annotations

import torch

from kvserve.quant import int4

# The layout (compressed-tensors "pack-quantized"):
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
