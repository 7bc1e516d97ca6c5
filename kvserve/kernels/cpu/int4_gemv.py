"""Bindings of ``kvserve/csrc/int4_gemv.c``: the INT4 GEMV and the W^T dequantize of row
blocks, both reading the bytes of torch's CPU int4 pack (``kvserve.layers.int4.layouts``:
"halves" layout, block_n 32 or 64) with bf16 (scale, zero) pairs, or fp16 (scale, min) pairs
of the GGUF min form. Twin: the torch code of ``kvserve.layers.int4.methods.CpuPackMethod``."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.kernels.cpu import INT, INT64, PTR, declare, load_library
from kvserve.kernels.cpu.graph import launch

SIGNATURES = {
    # packed, pairs, x, sum(x) per group, m, n_pad, k_pad, group, block_n, threads, min, y
    "kvs_int4_gemv": ([PTR, PTR, PTR, PTR, INT64, INT64, INT64, INT64, INT64, INT, INT, PTR],
                      None),
    # packed, pairs, n_pad, k_pad, group, block_n, min, r0, r1, threads, out
    "kvs_int4_dequant_t": ([PTR, PTR, INT64, INT64, INT64, INT64, INT, INT64, INT64, INT, PTR],
                           None),
}


@functools.cache
def load() -> ctypes.CDLL | None:
    return load_library("int4_gemv", SIGNATURES)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the entry points on another build of the same source (tests)."""
    return declare(dll, SIGNATURES)


def gemv(lib: ctypes.CDLL, packed: torch.Tensor, pairs: torch.Tensor, x: torch.Tensor,
         group: int, block_n: int, min_form: bool) -> torch.Tensor:
    """x fp32 [m, k_pad] (contiguous) -> fp32 [m, n_pad]; packed uint8 [n_pad, k_pad / 2],
    pairs [k_pad / group, n_pad, 2] (bf16 (s, z): w = (u - 8) s + z; fp16 (s, m): u s + m)."""
    m, k_pad = x.shape
    n_pad = pairs.shape[1]
    xs = x.view(m, k_pad // group, group).sum(-1)  # [m, groups]: the zero-point term
    y = torch.empty(m, n_pad, dtype=torch.float32)
    launch(lib, "kvs_int4_gemv", packed, pairs.contiguous(), x, xs, m, n_pad, k_pad, group,
           block_n, torch.get_num_threads(), int(min_form), y)
    return y


def dequant_t(lib: ctypes.CDLL, packed: torch.Tensor, pairs: torch.Tensor, k_pad: int,
              group: int, block_n: int, min_form: bool, r0: int, r1: int,
              out: torch.Tensor) -> torch.Tensor:
    """W^T of stored rows [r0, r1) into out fp32 [k_pad, r1 - r0] (returned)."""
    launch(lib, "kvs_int4_dequant_t", packed, pairs, pairs.shape[1], k_pad, group, block_n,
           int(min_form), r0, r1, torch.get_num_threads(), out)
    return out
