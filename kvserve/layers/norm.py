from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.cpu import cpu_ops
from kvserve.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in fp32 (as HF does), returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None: (norm(x), x). The sum is written
        into ``residual`` in place where the fused C op runs (fp32 on CPU, one call)."""
        if residual is None:  # the first norm: nothing to add
            out = cpu_ops.add_rms_norm(None, x, self.weight, self.eps)
            return (self(x) if out is None else out), x
        out = cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if out is not None:
            return out, residual
        residual = x + residual
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused op; same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
