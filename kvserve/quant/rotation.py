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

MLA latent rows ``[c_kv (R) | k_pe (dr)]`` (DeepSeek-V3) take a block-diagonal rotation,
``split=(R, dr)``: R_c on c_kv and R_pe on k_pe. Keys and values are both ``W_UK c`` /
``W_UV c`` of the same latent, so R_c is folded into ``kv_b_proj.weight`` once at load
(``W' = W R_c``: ``W' (c R_c)^T = W c^T``); R_pe rotates q_pe and k_pe after RoPE at run time,
and nothing rotates the output back (the values leave through the folded W_UV).
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
    """R for one cache (all layers and heads share it). x is [..., D] for all methods.

    ``split`` (MLA): sizes of the diagonal blocks of a block-diagonal R, each block its own
    ``rotation_matrix(size, seed + i)``; ``parts[i]`` is block i."""

    def __init__(self, head_dim: int, seed: int, device: torch.device | str = "cpu",
                 split: tuple[int, ...] | None = None) -> None:
        self.head_dim, self.seed = head_dim, seed
        self.split = None if split is None else tuple(int(n) for n in split)
        if self.split is None:
            self.parts = [rotation_matrix(head_dim, seed).to(device)]
        else:
            if sum(self.split) != head_dim or min(self.split) < 1:
                raise ValueError(f"rotation split {split} must be positive sizes summing to "
                                 f"head_dim {head_dim}")
            self.parts = [rotation_matrix(n, seed + i).to(device)
                          for i, n in enumerate(self.split)]
        self.matrix = torch.block_diag(*self.parts)  # R
        self.inverse = self.matrix.t().contiguous()  # R^T = R^-1

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x R in fp32 (q, k and v before the cache write / attention)."""
        if self.split is not None:  # block by block: no multiplies by the zero blocks
            return torch.cat([torch.matmul(p.float(), m) for p, m in
                              zip(x.split(self.split, dim=-1), self.parts, strict=True)], -1)
        return torch.matmul(x.float(), self.matrix)

    def invert(self, x: torch.Tensor) -> torch.Tensor:
        """x R^T in fp32 (the attention output back to the model's basis)."""
        return torch.matmul(x.float(), self.inverse)

    def describe(self) -> str:
        def kind(n: int) -> str:
            return "hadamard" if n & (n - 1) == 0 else "orthogonal"

        if self.split is not None:
            return "+".join(f"{kind(n)}:{n}" for n in self.split) + f":seed={self.seed}"
        return f"{kind(self.head_dim)}:{self.head_dim}:seed={self.seed}"
