"""W4A16 GEMM for the compressed-tensors ``pack-quantized`` layout.

Twin (the spec): :func:`kvserve.kernels.reference.int4_matmul`; same arguments.

    out[M, N] = x[M, K] @ W[N, K]^T
    W[n, k]   = (u[n, k] - zp[n, k // group]) * scale[n, k // group]

    weight_packed int32 [N, ceil(K/8)], nibble j of word (n, k // 8) is u[n, 8*(k//8) + j]:

        bit 31                                                             bit 0
        | u[n,8w+7] | u[n,8w+6] | u[n,8w+5] | u[n,8w+4] | ... | u[n,8w+1] | u[n,8w] |

    zp = 8 (symmetric) or weight_zero_point; weight_scale [N, ceil(K/group)].

One program per [BLOCK_M, BLOCK_N] output tile walks K in BLOCK_K steps. For its [BLOCK_K,
BLOCK_N] weight tile it gathers the packed word of each (k, n) (each word is fetched by 8
lanes; they hit the same cache line), shifts out the nibble, applies the per-group zero point
and scale in fp32 and feeds x's dtype to ``tl.dot`` (fp32 under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import reference as ref
from kvserve.kernels.triton import interpreting

__all__ = ["int4_matmul"]


@triton.jit
def _w4a16_kernel(
    X,  # [M, K]
    W,  # int32 [N, ceil(K/8)]
    S,  # [N, G]
    Z,  # [N, G] zero points (any int/float dtype) or dummy
    OUT,  # [M, N]
    M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn,
    stride_zg, stride_om, stride_on, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            X + rows_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        wmask = mask_k[:, None] & mask_n[None, :]  # [BLOCK_K, BLOCK_N]
        word = tl.load(
            W + rows_n[None, :] * stride_wn + (offs_k // 8)[:, None] * stride_wk,
            mask=wmask,
            other=0,
        )
        u = (word >> ((offs_k % 8) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N] in [0, 15]
        g = (offs_k // GROUP)[:, None]
        scale = tl.load(S + rows_n[None, :] * stride_sn + g * stride_sg, mask=wmask, other=0.0)
        if HAS_ZP:
            zp = tl.load(Z + rows_n[None, :] * stride_zn + g * stride_zg, mask=wmask, other=0)
            w = (u.to(tl.float32) - zp.to(tl.float32)) * scale.to(tl.float32)
        else:
            w = (u.to(tl.float32) - 8.0) * scale.to(tl.float32)
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
    o_ptrs = OUT + rows_m[:, None] * stride_om + rows_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """``x[M, K] @ W.T -> [M, N]`` in x's dtype (twin: reference.int4_matmul)."""
    M, K = x.shape
    N = packed.shape[0]
    if packed.dtype != torch.int32 or packed.shape[1] != triton.cdiv(K, 8):
        raise ValueError("weight_packed must be int32 [N, ceil(K/8)]")
    if zeros is not None:
        zeros = ref.unpack_zero_points(zeros, N) if zeros.shape[0] != N else zeros
    interp = interpreting()
    if interp or x.dtype not in (torch.bfloat16, torch.float16):
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
        precision = "tf32"
    if interp:
        bm, bn, bk = 16, 16, 32
    else:
        bm = 16 if M <= 16 else (32 if M <= 32 else 64)
        bn, bk = 64, 64
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    z = zeros if zeros is not None else scales
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _w4a16_kernel[grid](
        x,
        packed,
        scales,
        z,
        out,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        packed.stride(0),
        packed.stride(1),
        scales.stride(0),
        scales.stride(1),
        z.stride(0),
        z.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group_size,
        HAS_ZP=zeros is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        num_warps=8 if bm >= 64 else 4,
        num_stages=3,
    )
    return out
