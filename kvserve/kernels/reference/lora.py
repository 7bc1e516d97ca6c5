"""Grouped multi-LoRA GEMM (punica / S-LoRA): the twin of ``kvserve/csrc/lora_gemm.c`` and
``kvserve/kernels/triton/lora.py``.

One step's T rows each use at most one adapter slot; every slot holds one adapter, its rank
padded with zeros to the layer's R::

    x     [T, K]       fp32 activations (the rows of the step)
    a     [S, R, K]    lora_A of each slot (rows past the adapter's rank are zero)
    b     [S, N, R]    lora_B of each slot (columns past the adapter's rank are zero)
    idx   int64 [T]    row t's slot, -1: no adapter (the row's delta is 0)
    scale fp32 [S]     each slot's alpha / r (or alpha / sqrt(r): rsLoRA)

    delta[t] = scale[idx[t]] * b[idx[t]] @ (a[idx[t]] @ x[t])        (0 where idx[t] = -1)

and the kernels add it in place: ``y += delta``.
"""

from __future__ import annotations

import torch


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor,
               scale: torch.Tensor) -> torch.Tensor:
    """fp32 [T, N]: every row's adapter delta, computed one slot group at a time."""
    t, n = x.shape[0], b.shape[1]
    out = torch.zeros(t, n, dtype=torch.float32, device=x.device)
    for s in torch.unique(idx).tolist():
        if s < 0:
            continue
        rows = (idx == s).nonzero().flatten()
        shrink = x[rows].float() @ a[s].float().t()  # [m, R]
        out[rows] = (shrink @ b[s].float().t()) * scale[s].float()
    return out
