"""Tiny GGUF tensors of every ggml type, for tests: ``gguf.quants.quantize`` where the library
can, hand-packed random blocks where it cannot (K-quants, IQ types).

Hand-packed blocks are random bytes with the block's fp16 scale fields (``FP16_FIELDS``: byte
offsets in ggml-common.h's block structs) set, then scaled together so the weights' standard
deviation is ``std`` (every such type is linear in its fp16 scales: w = d f(q) - dmin g(q)).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

# ggml type -> byte offsets of the fp16 fields (d, and dmin where there is one) in a block
FP16_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q2_K: (80, 82),  # scales[16] qs[64] | d dmin
    QT.Q3_K: (108,),  # hmask[32] qs[64] scales[12] | d
    QT.Q4_K: (0, 2),  # d dmin | scales[12] qs[128]
    QT.Q5_K: (0, 2),  # d dmin | scales[12] qh[32] qs[128]
    QT.Q6_K: (208,),  # ql[128] qh[64] scales[16] | d
    QT.IQ4_NL: (0,),
    QT.IQ4_XS: (0,),
    QT.IQ2_XXS: (0,),
    QT.IQ2_XS: (0,),
    QT.IQ2_S: (0,),
    QT.IQ3_XXS: (0,),
    QT.IQ3_S: (0,),
    QT.IQ1_S: (0,),
}


def random_blocks(qtype: QT, rows: int, cols: int, seed: int, std: float = 0.05) -> np.ndarray:
    """uint8 [rows, row bytes] of random hand-packed blocks of ``qtype``."""
    be, bb = GGML_QUANT_SIZES[qtype]
    assert cols % be == 0, (qtype.name, cols)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // be, bb), dtype=np.uint8)
    fields = FP16_FIELDS[qtype]
    for off in fields:
        raw[..., off:off + 2] = rng.uniform(0.5, 1.0, (rows, cols // be, 1)).astype(
            np.float16).view(np.uint8)
    w = dequantize(raw.reshape(rows, -1), qtype)
    scale = std / max(float(w.std()), 1e-12)
    for off in fields:
        d = raw[..., off:off + 2].copy().view(np.float16).astype(np.float32) * scale
        raw[..., off:off + 2] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def blocks_of(arr: np.ndarray, kind: str, seed: int) -> np.ndarray:
    """``arr`` (fp32 [rows, cols]) as ``kind``: quantized by gguf where it can, else random
    hand-packed blocks of arr's standard deviation (F32 / F16: the array itself)."""
    if kind == "F32":
        return arr.astype(np.float32)
    if kind == "F16":
        return arr.astype(np.float16)
    qtype = QT[kind]
    try:
        return quantize(arr, qtype)
    except NotImplementedError:
        return random_blocks(qtype, arr.shape[0], arr.shape[1], seed, float(arr.std()))
