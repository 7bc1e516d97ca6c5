"""Multi-LoRA GEMM for ``--device cuda`` (punica's BGMV: each row gathers its own adapter).

Twin (the spec): :func:`kvserve.kernels.reference.lora_delta`; ``lora_gemm_`` adds the delta
to ``y`` in place. Shapes: x [T, K], a [S, R, K], bt [S, R, N] (lora_B transposed), idx int64
[T] (-1: none), scale fp32 [S], noff int64 [H + 1] (the shards of a fused linear), y [T, N].

One program per (row, BLOCK_N outputs): it reads its row's slot, computes the shrink
``v = scale[s] * A[s] @ x[t]`` ([R], fp32, R padded to a power of two with masks) in BLOCK_K
steps, then ``y[t, c] += sum_r bt[s, r, c] * v[r]`` over the ranks of column c's shard for its N
block. A row without an adapter computes slot 0's delta and stores y back unchanged. The
shrink is recomputed by every N block of a row: R * K multiply-adds, small next to the B block
it reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton import interpreting

__all__ = ["lora_gemm_"]


@triton.jit
def _lora_kernel(X, A, BT, IDX, SCALE, NOFF, Y, K, N, R, RH, stride_xt, stride_yt,
                 H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.load(IDX + t)
    live = s >= 0
    s = tl.maximum(s, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    v = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X + t.to(tl.int64) * stride_xt + offs_k, mask=mask_k, other=0.0)
        a = tl.load(A + (s * R + offs_r[:, None]) * K + offs_k[None, :],
                    mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        v += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    v = v * tl.load(SCALE + s)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    shard = tl.zeros([BLOCK_N], dtype=tl.int32)
    for h in tl.static_range(1, H):
        shard += (offs_n >= tl.load(NOFF + h)).to(tl.int32)
    r0 = shard * RH  # the ranks of each column's shard: [r0, r0 + RH)
    in_shard = (offs_r[None, :] >= r0[:, None]) & (offs_r[None, :] < r0[:, None] + RH)
    bt = tl.load(BT + (s * R + offs_r[None, :]) * N + offs_n[:, None],
                 mask=mask_n[:, None] & mask_r[None, :] & in_shard, other=0.0)
    out = tl.sum(bt.to(tl.float32) * v[None, :], axis=1)
    yp = Y + t.to(tl.int64) * stride_yt + offs_n
    y = tl.load(yp, mask=mask_n, other=0.0)
    out = tl.where(live, y.to(tl.float32) + out, y.to(tl.float32))
    tl.store(yp, out.to(y.dtype), mask=mask_n)


def lora_gemm_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               idx: torch.Tensor, scale: torch.Tensor, noff: torch.Tensor) -> torch.Tensor:
    """``y += lora_delta(x, a, bt, idx, scale, noff)`` in place; returns y."""
    t, k = x.shape
    s, r, _ = a.shape
    n = bt.shape[2]
    h = noff.shape[0] - 1
    if y.shape != (t, n) or bt.shape != (s, r, n) or idx.shape != (t,) or h < 1 or r % h:
        raise ValueError(f"lora_gemm_: shapes y {tuple(y.shape)}, x {tuple(x.shape)}, a "
                         f"{tuple(a.shape)}, bt {tuple(bt.shape)}, idx {tuple(idx.shape)}, "
                         f"noff {tuple(noff.shape)} differ")
    if t == 0 or r == 0:
        return y
    x, a, bt = x.contiguous(), a.contiguous(), bt.contiguous()
    assert y.stride(1) == 1
    block_n = 32 if interpreting() else 64
    grid = (t, triton.cdiv(n, block_n))
    _lora_kernel[grid](x, a, bt, idx, scale.float(), noff, y, k, n, r, r // h, x.stride(0),
                       y.stride(0), H=h, BLOCK_R=max(16, triton.next_power_of_2(r)),
                       BLOCK_K=64, BLOCK_N=block_n)
    return y
