"""ctypes binding of kvserve/csrc/w16_gemm.c: fp32 x times 16-bit (bf16 / fp16) weights read
as 16-bit (twin: kvserve.quant.w16)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.cbuild import build_library
from kvserve.kernels.cpu.graph import Rows, launch
from kvserve.quant.w16 import KINDS, w16_linear_ref


@functools.cache
def w16_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, or KVSERVE_CPU_KERNEL=0): callers use the
    twin."""
    dll = build_library("w16_gemm")
    return None if dll is None else bind(dll)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's signatures (also for the tests' other-ISA builds)."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.kvs_w16_gemm.argtypes = [p, i64, i64, i64, p, i64, i64, c_int, c_int, p, i64]
    dll.kvs_w16_gemm.restype = c_int
    return dll


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 activations against a 16-bit CPU weight: the case this kernel is for."""
    return (x.dtype == torch.float32 and weight.dtype in KINDS and x.device.type == "cpu"
            and weight.device.type == "cpu")


def w16_gemm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x [..., K] @ 16-bit weight [N, K]^T -> fp32 [..., N] in one C call."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m and launch(lib, "kvs_w16_gemm", x2, Rows(m), k, x2.stride(0), weight, n,
                    weight.stride(0), KINDS[weight.dtype], torch.get_num_threads(), y, n):
        raise MemoryError("kvs_w16_gemm: no scratch memory")
    return y.reshape(*x.shape[:-1], n)


def linear_w16(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for fp32 x and a 16-bit weight: the C kernel, else the twin."""
    lib = w16_library()
    if lib is None or weight.stride(1) != 1:
        return w16_linear_ref(x, weight, bias)
    y = w16_gemm(lib, x, weight)
    return y if bias is None else y + bias.float()
