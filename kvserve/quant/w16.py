"""16-bit (bf16 / fp16) dense weights on CPU: the kinds the C kernel takes.

On every CPU kind kvserve computes a bf16 / fp16 checkpoint in fp32 (``dtype=auto``). The
weights stay 16-bit in memory (half the bytes a decode step reads); kvserve/csrc/w16_gemm.c
widens them in registers (bf16 -> fp32 and fp16 -> fp32 are exact), so the product is the fp32
product of the same values. Its pure-torch twin is ``kvserve.kernels.reference.w16_linear``.
"""

from __future__ import annotations

import torch

KINDS = {torch.bfloat16: 0, torch.float16: 1}  # the C kernel's ``kind`` per weight dtype
