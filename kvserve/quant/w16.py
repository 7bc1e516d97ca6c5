"""16-bit weights with fp32 activations: the pure-torch twin of kvserve/csrc/w16_gemm.c.

On every CPU kind kvserve computes a bf16 / fp16 checkpoint in fp32 (``dtype=auto``). The
weights stay 16-bit in memory (half the bytes a decode step reads); the kernel widens them in
registers (bf16 -> fp32 and fp16 -> fp32 are exact), so the product is the fp32 product of the
same values and differs from this twin only in the order of fp32 additions.
"""

from __future__ import annotations

import torch

KINDS = {torch.bfloat16: 0, torch.float16: 1}  # the C kernel's ``kind`` per weight dtype


def w16_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x [..., K], 16-bit weight [N, K] (bias [N] or None) -> fp32 [..., N]."""
    assert weight.dtype in KINDS and x.dtype == torch.float32
    y = x @ weight.float().t()
    return y if bias is None else y + bias.float()
