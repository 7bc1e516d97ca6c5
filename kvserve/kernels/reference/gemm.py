"""Twins of the CPU GEMMs: the 16-bit-weight GEMM (kvserve/csrc/w16_gemm.c, format notes in
:mod:`kvserve.quant.w16`) and the integer-dot GEMM for GGUF Q4 / Q8 weights
(kvserve/csrc/wq_gemm.c, layout and formulas in :mod:`kvserve.quant.wq`)."""

from __future__ import annotations

import torch

from kvserve.quant import wq

# ---- 16-bit weights with fp32 activations on CPU (kvserve/csrc/w16_gemm.c) -------------------


def w16_linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of kvserve/csrc/w16_gemm.c: fp32 x [..., K], bf16 / fp16 weight [N, K] (bias [N] or
    None) -> fp32 [..., N]. The kernel widens the weights in registers (exact), so it differs
    from this only in the order of the fp32 additions."""
    assert weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == torch.float32
    y = x @ weight.float().t()
    return y if bias is None else y + bias.float()


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest bf16 value (ties to even), subnormals flushed to zero, back in fp32:
    what vcvtne2ps2bf16 (AVX512-BF16) makes of each activation."""
    x = x.float()
    tiny = x.abs() < torch.finfo(torch.float32).tiny
    return torch.where(tiny, torch.zeros_like(x), x).to(torch.bfloat16).float().copysign(x)


def w16_linear_bf16_dot(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Twin of kvserve/csrc/w16_gemm.c's bf16 dot-product path (AVX512-BF16 vdpbf16ps, taken
    for GEMMs of >= ``bf16_dot_rows`` rows): x [..., K] fp32 rounded to bf16 (``bf16_round``),
    times the bf16 weight [N, K], every product exact and summed in fp32 -> fp32 [..., N]. The
    kernel differs only in the order of the fp32 additions (and flushes subnormal sums)."""
    assert weight.dtype == torch.bfloat16
    return bf16_round(x) @ weight.float().t()


# ---- integer-dot GEMM for GGUF Q4 / Q8 weights on CPU (kvserve/csrc/wq_gemm.c) ---------------
#
# Weights: unsigned codes u with a (scale s, min m) per group of G input columns, w = u * s + m;
# activations quantized per row in blocks of wq.BLOCK columns to int8 (layout and formulas:
# kvserve.quant.wq). The C quantizer is bit-identical with ``wq_quantize_act``; the GEMM
# matches ``wq_matmul`` (float64) within fp32 rounding.


def wq_quantize_act(x: torch.Tensor, terms: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> (q int8 [T M, K], dx fp32 [T M, K/32], qs int32 [T M, K/32]), T = terms;
    the twin of ``kvs_wq_quant_act`` (same fp32 operations: bit-identical). Rows M + m of a
    second term hold the remainder: x ~ dx q + dx' q' (:mod:`kvserve.quant.wq`)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // wq.BLOCK, wq.BLOCK)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    v = xb * inv.unsqueeze(-1)
    q = torch.round(v).clamp_(-127, 127)
    dx = amax / 127.0
    qs_, dxs, sums = [q], [dx], [q.sum(-1)]
    if terms == 2:
        q2 = torch.round((v - q) * 254.0).clamp_(-127, 127)
        qs_.append(q2)
        dxs.append(dx / 254.0)
        sums.append(q2.sum(-1))
    return (torch.cat(qs_).to(torch.int8).view(terms * m, k), torch.cat(dxs),
            torch.cat(sums).to(torch.int32))


def wq_fake_quant_act(x: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """fp32 x^ = sum over terms of dx q: what the kernel multiplies the weights with."""
    q, dx, _ = wq_quantize_act(x, terms)
    tm, k = q.shape
    xh = q.float().view(tm, k // wq.BLOCK, wq.BLOCK) * dx.unsqueeze(-1)
    xh = xh.view(terms, tm // terms, k)
    return xh[0] if terms == 1 else xh[0] + xh[1]


def wq_dequantize(u: torch.Tensor, s: torch.Tensor, m: torch.Tensor, group: int
                  ) -> torch.Tensor:
    """fp32 [N, K] = fl(fl(u * s) + m) per group (GGUF's own dequantization order)."""
    w = u.float() * s.float().repeat_interleave(group, -1)
    return w + m.float().repeat_interleave(group, -1)


def wq_matmul(x: torch.Tensor, u: torch.Tensor, s: torch.Tensor, m: torch.Tensor,
              group: int, terms: int = 1) -> torch.Tensor:
    """The twin of ``kvs_wq_gemm``: fp32 [M, N] = x^ @ W^T in float64, x^ the int8
    fake-quantized x (:mod:`kvserve.quant.wq`), W = u * s + m."""
    q, dx, _ = wq_quantize_act(x, terms)
    xh = (q.double().view(q.shape[0], -1, wq.BLOCK) * dx.double().unsqueeze(-1)).view(q.shape)
    xh = xh.view(terms, x.shape[0], -1).sum(0)
    w = u.double() * s.double().repeat_interleave(group, -1) + \
        m.double().repeat_interleave(group, -1)
    return (xh @ w.t()).float()
