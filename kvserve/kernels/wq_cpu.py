"""ctypes binding of kvserve/csrc/wq_gemm.c: y = W . x^ for integer-dot weight tiles
(layout and twin: kvserve.quant.wq)."""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from kvserve.cbuild import build_library
from kvserve.quant.wq import BLOCK


@functools.cache
def wq_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, or KVSERVE_CPU_KERNEL=0): callers use the
    twin."""
    dll = build_library("wq_gemm")
    if dll is None:
        return None
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.kvs_wq_quant_act.argtypes = [p, i64, i64, c_int, c_int, p, p, p]
    dll.kvs_wq_quant_act.restype = None
    dll.kvs_wq_gemm.argtypes = [p, p, p, p, p, i64, i64, i64, i64, c_int, c_int, p]
    dll.kvs_wq_gemm.restype = None
    return dll


_SCRATCH = threading.local()


def _scratch(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-thread (q int8 [m, k], dx fp32, qs int32 [m, k/32]) buffers, grown on demand."""
    cap = getattr(_SCRATCH, "cap", 0)
    if cap < m * k:
        _SCRATCH.q = torch.empty(m * k, dtype=torch.int8)
        _SCRATCH.dx = torch.empty(m * k // BLOCK, dtype=torch.float32)
        _SCRATCH.qs = torch.empty(m * k // BLOCK, dtype=torch.int32)
        _SCRATCH.cap = m * k
    nb = m * k // BLOCK
    return _SCRATCH.q[: m * k], _SCRATCH.dx[:nb], _SCRATCH.qs[:nb]


def wq_matmul(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, sm: torch.Tensor,
              n_pad: int, group: int, bits: int, terms: int = 1) -> torch.Tensor:
    """fp32 x [M, K] (contiguous) -> fp32 [M, n_pad] with the C kernel; ``terms`` int8
    passes of the activations (1: as llama.cpp; 2: ~15-bit, see kvserve.quant.wq)."""
    m, k = x.shape
    assert x.dtype == torch.float32 and x.is_contiguous() and k % BLOCK == 0
    threads = torch.get_num_threads()
    q, dx, qs = _scratch(terms * m, k)
    lib.kvs_wq_quant_act(x.data_ptr(), m, k, terms, threads, q.data_ptr(), dx.data_ptr(),
                         qs.data_ptr())
    y = torch.empty(terms * m, n_pad, dtype=torch.float32)
    lib.kvs_wq_gemm(codes.data_ptr(), sm.data_ptr(), q.data_ptr(), dx.data_ptr(),
                    qs.data_ptr(), terms * m, n_pad, k, group, bits, threads, y.data_ptr())
    return y if terms == 1 else y[:m].add_(y[m:])
