"""A GGUF Q8_0 token embedding kept 8-bit, and the LM head that reads it (tied or its own).

SmolLM2's tied embedding is 49,152 x 576: 113 MB in fp32, read whole by the LM head every
decode step (~35% of a batch-1 step). Held as Q8_0 (int8 + one fp16 scale per 32) it is 30 MB
and the same weights exactly (``kvserve.quant.gguf_q8``):

* ``Q8Embedding(ids)``: rows dequantized on the fly, in ``dtype``;
* ``Q8LMHead(hidden)`` -> fp32 logits [M, V]: the C GEMV (kvserve/csrc/q8_gemv.c) for up to
  ``GEMV_MAX_M`` rows (memory-bound), else row chunks dequantized to fp32 and one GEMM each.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from kvserve.cbuild import build_library
from kvserve.quant.gguf_q8 import dequantize_q8

GEMV_MAX_M = 16
_CHUNK_ROWS = 2048  # vocab rows dequantized per GEMM in the large-M path (4.5 MiB at K=576)


class Q8Embedding(nn.Module):
    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        if q.dtype != torch.int8 or d.dtype != torch.float16 or d.shape != (
                q.shape[0], q.shape[1] // 32):
            raise ValueError(f"q must be int8 [N, K] and d fp16 [N, K/32], got {q.dtype} "
                             f"{tuple(q.shape)}, {d.dtype} {tuple(d.shape)}")
        self.num_embeddings, self.embedding_dim = q.shape
        self.dtype = dtype
        self.q = nn.Parameter(q.contiguous(), requires_grad=False)
        self.d = nn.Parameter(d.contiguous(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_q8(self.q, self.d, ids).to(self.dtype)

    def weight_bytes(self) -> int:
        return self.q.numel() + 2 * self.d.numel()

    def dense_numel(self) -> int:
        return self.q.numel()


class Q8LMHead(nn.Module):
    """Logits from a Q8Embedding's weights (the same tensors when tied)."""

    def __init__(self, table: Q8Embedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.table
        x2 = x.reshape(-1, t.embedding_dim).float().contiguous()
        m, n = x2.shape[0], t.num_embeddings
        lib = _q8_lib()
        if lib is not None and m <= GEMV_MAX_M:
            y = torch.empty(m, n, dtype=torch.float32)
            lib.kvs_q8_gemv(t.q.data_ptr(), t.d.data_ptr(), x2.data_ptr(), m, n,
                            t.embedding_dim, torch.get_num_threads(), y.data_ptr())
        else:
            y = torch.empty(m, n, dtype=torch.float32)
            for r0 in range(0, n, _CHUNK_ROWS):
                r1 = min(n, r0 + _CHUNK_ROWS)
                y[:, r0:r1] = x2 @ dequantize_q8(t.q[r0:r1], t.d[r0:r1]).t()
        return y.reshape(*x.shape[:-1], n)


@functools.cache
def _q8_lib() -> ctypes.CDLL | None:
    dll = build_library("q8_gemv")
    if dll is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dll.kvs_q8_gemv.argtypes = [p, p, p, i64, i64, i64, ctypes.c_int, p]
    dll.kvs_q8_gemv.restype = None
    return dll
