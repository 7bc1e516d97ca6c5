"""Grouped multi-LoRA GEMM (punica / S-LoRA): the twin of ``kvserve/csrc/lora_gemm.c`` and
``kvserve/kernels/triton/lora.py``.

One step's T rows each use at most one adapter slot; every slot holds one adapter, its rank
padded with zeros to the layer's R. A fused linear (q/k/v, gate/up) has H shards: output
columns ``[noff[h], noff[h+1])`` take ranks ``[h*R/H, (h+1)*R/H)`` only::

    x     [T, K]       fp32 activations (the rows of the step)
    a     [S, R, K]    lora_A of each slot (rows past the adapter's rank are zero)
    bt    [S, R, N]    lora_B of each slot, transposed (rows past the adapter's rank are zero)
    idx   int64 [T]    row t's slot, -1: no adapter (the row's delta is 0)
    scale fp32 [S]     each slot's alpha / r (or alpha / sqrt(r): rsLoRA)
    noff  int64 [H+1]  the shards' output offsets (noff[0] = 0, noff[H] = N; H divides R)

    delta[t, c] = sum_{r in shard(c)} bt[s, r, c] * (scale[s] * a[s, r] . x[t]),  s = idx[t]
                                                                    (0 where idx[t] = -1)

and the kernels add it in place: ``y += delta``. Entries of ``bt`` outside a shard's block
are never read.
"""

from __future__ import annotations

import torch


def lora_delta(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, idx: torch.Tensor,
               scale: torch.Tensor, noff: torch.Tensor) -> torch.Tensor:
    """fp32 [T, N]: every row's adapter delta, computed one slot group at a time."""
    t, n = x.shape[0], bt.shape[2]
    offs = noff.tolist()
    rh = a.shape[1] // (len(offs) - 1)
    out = torch.zeros(t, n, dtype=torch.float32, device=x.device)
    for s in torch.unique(idx).tolist():
        if s < 0:
            continue
        rows = (idx == s).nonzero().flatten()
        shrink = (x[rows].float() @ a[s].float().t()) * scale[s].float()  # [m, R]
        for h in range(len(offs) - 1):
            c0, c1 = offs[h], offs[h + 1]
            out[rows, c0:c1] = (shrink[:, h * rh:(h + 1) * rh]
                                @ bt[s, h * rh:(h + 1) * rh, c0:c1].float())
    return out
