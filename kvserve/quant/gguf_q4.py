"""GGUF Q4_0 / Q4_1 blocks -> :class:`~kvserve.quant.int4.Int4Weight` without requantizing.

ggml's block layouts (``ggml-common.h``; ``gguf.quants`` is the reference these are tested
against, bit for bit), 32 weights of one row per block, rows stored one after another::

    Q4_0  18 B:  d fp16 | qs[16]           w = d * (q - 8)
    Q4_1  20 B:  d fp16 | m fp16 | qs[16]  w = d * q + m
    qs[j] low nibble = q of weight j, high nibble = q of weight j + 16   (j = 0 .. 15)

Both become the int4 "min" form, group 32 (``int4.Int4Weight.mins``)::

    values = q - 8 (int8),  scales = d (fp16),  mins = m (Q4_1)  or  -8 d (Q4_0, exact in fp16)
    w = fl(fl((values + 8) * d) + mins)  ==  gguf.quants.dequantize  bit for bit:
      Q4_1: gguf computes fl(fl(d * q) + m) in fp32: the same two roundings;
      Q4_0: gguf computes fl(d * (q - 8)); d * q and 8 d are exact in fp32 (<= 15 significant
            bits) and d * (q - 8) is representable, so the one rounding of the sum is exact.

``Int4Linear`` keeps exactly these nibbles and (d, min) pairs in fp16 (no bf16 rounding).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.quant.int4 import OFFSET, Int4Weight

GROUP = 32  # weights per block (QK4_0 == QK4_1 == 32)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def unpack_q4(data: np.ndarray | torch.Tensor, kind: str, shape: tuple[int, int]
              ) -> Int4Weight:
    """Raw block bytes (uint8, ``rows * blocks * BLOCK_BYTES`` in any shape) of an [out, in]
    tensor -> Int4Weight (values int8 [out, in], scales / mins fp16 [out, in / 32])."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"kind must be one of {sorted(BLOCK_BYTES)}, got {kind!r}")
    out, k = shape
    if k % GROUP:
        raise ValueError(f"{kind} rows hold whole blocks of {GROUP}; in_features {k} is not")
    raw = _as_bytes(data)
    nb, bb = k // GROUP, BLOCK_BYTES[kind]
    if raw.numel() != out * nb * bb:
        raise ValueError(f"{kind} [{out}, {k}] needs {out * nb * bb} bytes, got {raw.numel()}")
    blocks = raw.view(out, nb, bb)
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(out, nb)
    qs = blocks[..., bb - 16:]  # [out, nb, 16]
    q = torch.cat((qs & 15, qs >> 4), -1).reshape(out, k)  # weight j | j + 16 of each block
    values = (q.to(torch.int16) - OFFSET).to(torch.int8)
    if kind == "Q4_1":
        mins = blocks[..., 2:4].contiguous().view(torch.float16).view(out, nb)
    else:
        mins = d * -8.0  # fp16: exact unless |d| > 8188 (then inf, refused below)
        if not torch.isfinite(mins).all():
            raise ValueError("Q4_0 scale too large for fp16 min form (|d| > 8188)")
    return Int4Weight(values, d.clone(), None, GROUP, None, mins.clone())


def permute_rows(data: np.ndarray | torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the rows of a [rows, bytes-or-values] tensor (blocks never span rows, so a
    row permutation of quantized data is exact)."""
    t = torch.as_tensor(np.ascontiguousarray(data))
    return t.index_select(0, perm)


def _as_bytes(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 view of a tensor, or of a (possibly read-only, memory-mapped) array's copy."""
    if isinstance(data, torch.Tensor):
        return data.contiguous().view(torch.uint8).reshape(-1)
    return torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1))
