"""Twin of the integer-dot GEMM for GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K weights kept packed
(``kvserve/csrc/kq_gemm.c``; parts and layout: :mod:`kvserve.quant.kq`).

``kq_dequantize`` is the exact weight: the same fp32 operations as ``gguf.quants``'
``dequantize_blocks`` (bit-identical). ``kq_matmul`` is what the kernel computes: the int8
fake-quantized activations (``wq_quantize_act``, shared with the Q4 / Q8 kernel) times that
weight, in float64 -- the C kernel matches it within fp32 rounding."""

from __future__ import annotations

import torch

from kvserve.kernels.reference.gemm import wq_quantize_act
from kvserve.quant.kq import KqParts


def kq_dequantize(p: KqParts) -> torch.Tensor:
    """fp32 [n, k]: the weight the parts hold (gguf.quants' order of operations)."""
    n, k = p.shape
    u = p.u.float()
    d = p.d.float()
    if p.qtype == 6:  # d * (u - 16)
        return d.repeat_interleave(32, -1) * (u - 16.0)
    if p.qtype == 7:  # d * u + m
        assert p.dm is not None
        return d.repeat_interleave(32, -1) * u + p.dm.float().repeat_interleave(32, -1)
    if p.qtype in (12, 13):  # (d * sc) * u - dmin * mn, per 32 of 256
        assert p.sc is not None and p.mn is not None and p.dm is not None
        ds = (d.repeat_interleave(8, -1) * p.sc.float()).repeat_interleave(32, -1)
        dm = (p.dm.float().repeat_interleave(8, -1) * p.mn.float()).repeat_interleave(32, -1)
        return ds * u - dm
    assert p.qtype == 14 and p.sc is not None  # (d * sc) * (u - 32), per 16 of 256
    ds = (d.repeat_interleave(16, -1) * p.sc.float()).repeat_interleave(16, -1)
    return ds * (u - 32.0)


def kq_matmul(x: torch.Tensor, parts: list[KqParts], terms: int = 1) -> torch.Tensor:
    """The twin of ``kvs_kq_linear``: fp32 [M, sum n] = x^ @ [W_0; W_1; ...]^T in float64, x^
    the int8 fake-quantized x (``terms`` passes), each W_s = ``kq_dequantize(parts[s])``."""
    q, dx, _ = wq_quantize_act(x.float(), terms)
    xh = (q.double().view(q.shape[0], -1, 32) * dx.double().unsqueeze(-1)).view(q.shape)
    xh = xh.view(terms, x.shape[0], -1).sum(0)
    w = torch.cat([kq_dequantize(p).double() for p in parts])
    return (xh @ w.t()).float()
