"""ctypes binding of kvserve/csrc/kq_gemm.c: y = x^ . [W_0; W_1; ...]^T for GGUF Q5_0 / Q5_1 /
Q4_K / Q5_K / Q6_K weights kept packed (layout: kvserve.quant.kq; twin:
kvserve.kernels.reference.kq_matmul). On CPUs with AMX-INT8, GEMMs of at least
``wq_gemm.amx_rows(lib)`` rows run on AMX tiles, bit for bit the VNNI results (wq_gemm's
``set_amx`` / ``KVSERVE_CPU_AMX_INT8`` switch it)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.cbuild import build_library
from kvserve.kernels.cpu.graph import Rows, launch
from kvserve.kernels.cpu.wq_gemm import bind_amx


@functools.cache
def kq_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, or KVSERVE_CPU_KERNEL=0): callers use the
    twin."""
    dll = build_library("kq_gemm")
    return None if dll is None else bind(dll)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's signatures (also for the tests' other-ISA builds)."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.kvs_kq_linear.argtypes = [p, i64, i64, p, i64, c_int, c_int, p]
    dll.kvs_kq_linear.restype = c_int
    dll.kvs_kq_bytes.argtypes = [c_int, i64, i64]
    dll.kvs_kq_bytes.restype = i64
    dll.kvs_kq_dequant.argtypes = [c_int, p, i64, i64, i64, i64, c_int, p]
    dll.kvs_kq_dequant.restype = c_int
    return bind_amx(dll, "kvs_kq_amx")


def kq_dequant(lib: ctypes.CDLL, qtype: int, packed: torch.Tensor, n: int, k: int, r0: int,
               r1: int) -> torch.Tensor:
    """fp32 [r1 - r0, k]: rows [r0, r1) of the packed weight (r0 % 16 == 0), exactly
    gguf.quants.dequantize's values."""
    out = torch.empty(r1 - r0, k, dtype=torch.float32)
    if launch(lib, "kvs_kq_dequant", qtype, packed, n, k, r0, r1, torch.get_num_threads(),
              out):
        raise ValueError(f"kvs_kq_dequant: type {qtype}, in_features={k} or rows [{r0}, {r1}) "
                         "do not fit")
    return out


def shard_table(shards: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """(ggml type, rows, packed uint8) per shard -> the kernel's int64 [nshard, 3] table (the
    packed tensors must outlive it: it holds their data pointers)."""
    return torch.tensor([[t, n, w.data_ptr()] for t, n, w in shards], dtype=torch.int64)


def kq_linear(lib: ctypes.CDLL, x: torch.Tensor, table: torch.Tensor, n_total: int,
              terms: int) -> torch.Tensor:
    """fp32 x [M, K] (contiguous) -> fp32 [M, n_total]: activations quantized once to ``terms``
    int8 passes, each shard's GEMM into its columns, in one C call."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] % 32 == 0
    m, k = x.shape
    y = torch.empty(m, n_total, dtype=torch.float32)
    rc = launch(lib, "kvs_kq_linear", x, Rows(m), k, table, table.shape[0], terms,
                torch.get_num_threads(), y)
    if rc == -1:
        raise MemoryError("kvs_kq_linear: no scratch memory")
    if rc:
        raise ValueError(f"kvs_kq_linear: a shard's type or in_features={k} does not fit")
    return y
