"""Bindings of ``kvserve/csrc/lora_gemm.c``: the grouped multi-LoRA GEMM on CPU (fp32), recorded
by the CPU decode graphs (the row count is the graph's, ``idx`` a graph input).
Twin: ``kvserve.kernels.reference.lora_delta``."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.kernels.cpu import INT, INT64, PTR, declare, load_library
from kvserve.kernels.cpu.graph import Rows, launch

# a, bt, wbf16, x, idx, scale, noff, T, K, N, R, S, H, threads, tmp, order, y
SIGNATURES = {
    "kvs_lora_gemm": ([PTR, PTR, INT64, PTR, PTR, PTR, PTR, INT64, INT64, INT64, INT64, INT64,
                       INT64, INT, PTR, PTR, PTR], INT64),
    "kvs_lora_simd": ([], INT),
}


@functools.cache
def load() -> ctypes.CDLL | None:
    return load_library("lora_gemm", SIGNATURES)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the entry points on another build of the same source (tests)."""
    return declare(dll, SIGNATURES)


def applies(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> bool:
    """The C kernel takes fp32 CPU activations (contiguous ones; the caller makes x so) and
    fp32 or bf16 adapter weights."""
    return (y.device.type == "cpu" and x.dtype == y.dtype == torch.float32
            and a.dtype in (torch.float32, torch.bfloat16) and y.is_contiguous())


def lora_gemm_(lib: ctypes.CDLL, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor,
               bt: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor,
               noff: torch.Tensor) -> torch.Tensor:
    """``y += lora_delta(x, a, bt, idx, scale, noff)`` in place (shapes: the twin's)."""
    t, k = x.shape
    s, r, _ = a.shape
    n = bt.shape[2]
    h = noff.shape[0] - 1
    assert y.shape == (t, n) and bt.shape == (s, r, n) and idx.dtype == torch.int64
    assert noff.dtype == torch.int64 and h >= 1 and r % h == 0 and bt.dtype == a.dtype
    x = x.contiguous()
    tmp = torch.empty(t, r, dtype=torch.float32)  # rows-first: a replay uses the [:n] prefix
    order = torch.empty(t, dtype=torch.int64)
    rc = launch(lib, "kvs_lora_gemm", a, bt, int(a.dtype == torch.bfloat16), x, idx, scale,
                noff, Rows(t), k, n, r, s, h,
                torch.get_num_threads(), tmp, order, y)
    assert rc >= 0, "a row's LoRA slot is out of range (or the shards do not split R / N)"
    return y
