"""Bindings of ``kvserve/csrc/q8_gemv.c``: logits from a GGUF Q8_0 table (int8 q [N, K], fp16
d [N, K/32]) with fp32 activations. Twin: ``kvserve.quant.gguf_q8.dequantize_q8`` + a GEMM."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.kernels.cpu import INT, INT64, PTR, declare, load_library
from kvserve.kernels.cpu.graph import launch

# q, d, x, m, n, k, threads, y
SIGNATURES = {"kvs_q8_gemv": ([PTR, PTR, PTR, INT64, INT64, INT64, INT, PTR], None)}


@functools.cache
def load() -> ctypes.CDLL | None:
    return load_library("q8_gemv", SIGNATURES)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the entry point on another build of the same source (tests)."""
    return declare(dll, SIGNATURES)


def gemv(lib: ctypes.CDLL, q: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x fp32 [m, K] (contiguous) -> fp32 [m, N] = x dequantize(q, d)^T."""
    m, (n, k) = x.shape[0], q.shape
    y = torch.empty(m, n, dtype=torch.float32)
    launch(lib, "kvs_q8_gemv", q, d, x, m, n, k, torch.get_num_threads(), y)
    return y
