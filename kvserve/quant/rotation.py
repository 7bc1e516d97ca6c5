"""Randomized Walsh-Hadamard rotation of each attention head's channels, for 8-bit KV.

K and V rows have a few outlier channels (K especially, after RoPE); a per-row 8-bit grid
sized to the outlier wastes its levels on the rest. Multiplying every head's q, k and v by the
same orthogonal matrix R [D, D] spreads each row's energy evenly over the channels without
changing attention:

    q' = q R,  k' = k R      =>  q' . k' = q R R^T k^T = q . k       (scores unchanged)
    v' = v R                 =>  sum_t p_t v'_t = (sum_t p_t v_t) R  (so out = out' R^T)

so the cache stores k' and v', the attention kernels are unchanged, and the output is rotated
back with R^T. R = diag(s) H_D / sqrt(D) with H_D the Sylvester Hadamard matrix and s random
signs from ``seed`` (the randomized Hadamard transform of QuaRot, Ashkboos et al. 2024,
arXiv:2404.00456; SpinQuant, Liu et al. 2024, arXiv:2405.16406, learns R instead; TurboQuant,
Zandieh et al. 2025, arXiv:2504.19874, applies a random rotation to KV for the same reason).
For a head_dim that is not a power of two R is a seeded random orthogonal matrix (QR of a
Gaussian), which has the same spreading property in expectation.

Rotation happens after RoPE (RoPE is position-dependent, so R cannot be folded into W_q / W_k).
This module's ``apply`` / ``invert`` are plain fp32 matmuls: they are their own twin, used by
every attention backend (no kernel).
"""

from __future__ import annotations

import math

import torch


def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix H_n (n a power of two), entries +-1, fp32 [n, n]."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def rotation_matrix(head_dim: int, seed: int) -> torch.Tensor:
    """The orthogonal R [D, D] fp32 for ``head_dim`` D and ``seed`` (deterministic)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    g = torch.Generator().manual_seed(seed)
    if head_dim & (head_dim - 1) == 0:
        signs = torch.randint(0, 2, (head_dim,), generator=g).float().mul_(2).sub_(1)
        return (signs[:, None] * hadamard(head_dim)) / math.sqrt(head_dim)
    a = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    qm = qm * torch.sign(torch.diagonal(r))[None, :]  # unique (Haar) orthogonal factor
    return qm.float()


class KVRotation:
    """R for one cache (all layers and heads share it). x is [..., D] for all methods."""

    def __init__(self, head_dim: int, seed: int, device: torch.device | str = "cpu") -> None:
        self.head_dim, self.seed = head_dim, seed
        self.matrix = rotation_matrix(head_dim, seed).to(device)  # R
        self.inverse = self.matrix.t().contiguous()  # R^T = R^-1

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x R in fp32 (q, k and v before the cache write / attention)."""
        return torch.matmul(x.float(), self.matrix)

    def invert(self, x: torch.Tensor) -> torch.Tensor:
        """x R^T in fp32 (the attention output back to the model's basis)."""
        return torch.matmul(x.float(), self.inverse)

    def describe(self) -> str:
        kind = "hadamard" if self.head_dim & (self.head_dim - 1) == 0 else "orthogonal"
        return f"{kind}:{self.head_dim}:seed={self.seed}"
