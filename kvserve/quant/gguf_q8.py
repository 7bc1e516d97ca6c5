"""GGUF Q8_0 blocks -> int8 values + fp16 scales, without requantizing.

ggml's Q8_0 block (``ggml-common.h``), 32 weights of one row: ``d fp16 | qs[32] int8``,
w = d * q. The pure-torch twin here, ``dequantize_q8``, computes fl(d * q) in fp32: exact
(an fp16 times an int8 needs at most 19 significant bits), so it equals
``gguf.quants.dequantize`` bit for bit (tests/quant/test_q8.py).
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32
BLOCK_BYTES = 34


def unpack_q8_0(data: np.ndarray | torch.Tensor, shape: tuple[int, int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q8_0 bytes of an [N, K] tensor -> (q int8 [N, K], d fp16 [N, K / 32])."""
    n, k = shape
    if k % GROUP:
        raise ValueError(f"Q8_0 rows hold whole blocks of {GROUP}; in_features {k} is not")
    raw = _as_bytes(data)
    nb = k // GROUP
    if raw.numel() != n * nb * BLOCK_BYTES:
        raise ValueError(f"Q8_0 [{n}, {k}] needs {n * nb * BLOCK_BYTES} bytes, "
                         f"got {raw.numel()}")
    blocks = raw.view(n, nb, BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).view(n, nb)
    q = blocks[..., 2:].contiguous().view(torch.int8).view(n, k)
    return q, d


def dequantize_q8(q: torch.Tensor, d: torch.Tensor, rows: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """fp32 [N, K] (or the given rows) = d * q, the twin of kvserve/csrc/q8_gemv.c."""
    if rows is not None:
        q, d = q[rows], d[rows]
    return q.float() * d.float().repeat_interleave(GROUP, dim=-1)


def _as_bytes(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 view of a tensor, or of a (possibly read-only, memory-mapped) array's copy."""
    if isinstance(data, torch.Tensor):
        return data.contiguous().view(torch.uint8).reshape(-1)
    return torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1))
