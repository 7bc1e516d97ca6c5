"""ctypes binding of kvserve/csrc/wq_gemm.c: y = W . x^ for integer-dot weight tiles
(layout and twin: kvserve.quant.wq)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.cbuild import build_library
from kvserve.kernels.cpu.graph import Rows, launch
from kvserve.quant.wq import BLOCK


@functools.cache
def wq_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, or KVSERVE_CPU_KERNEL=0): callers use the
    twin."""
    dll = build_library("wq_gemm")
    return None if dll is None else bind(dll)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's signatures (also for the tests' other-ISA builds and a
    benchmark's baseline build)."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.kvs_wq_quant_act.argtypes = [p, i64, i64, c_int, c_int, p, p, p]
    dll.kvs_wq_quant_act.restype = None
    dll.kvs_wq_gemm.argtypes = [p, p, p, p, p, i64, i64, i64, i64, c_int, c_int, p]
    dll.kvs_wq_gemm.restype = None
    dll.kvs_wq_linear.argtypes = [p, i64, i64, p, p, i64, i64, c_int, c_int, c_int, p]
    dll.kvs_wq_linear.restype = c_int
    return dll


def wq_linear(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, sm: torch.Tensor,
              n_pad: int, group: int, bits: int, terms: int) -> torch.Tensor:
    """fp32 x [M, K] (contiguous) -> fp32 [M, n_pad]: activations quantized to ``terms`` int8
    passes (1: as llama.cpp; 2: ~15-bit, see kvserve.quant.wq), the integer-dot GEMM and the
    passes added, in one C call."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] % BLOCK == 0
    m, k = x.shape
    y = torch.empty(m, n_pad, dtype=torch.float32)
    if launch(lib, "kvs_wq_linear", x, Rows(m), k, codes, sm, n_pad, group, bits, terms,
              torch.get_num_threads(), y):
        raise MemoryError("kvs_wq_linear: no scratch memory")
    return y
