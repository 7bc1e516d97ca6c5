"""Bindings of ``kvserve/csrc/block_sums.c``: the integrity checksums (S1, S2 over int16
words) of many KV blocks in one pass over the cache in place. Twin:
``kvserve.cache.integrity.block_sums_numpy``."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from kvserve.kernels.cpu import INT, INT64, PTR, load_library
from kvserve.kernels.cpu.graph import launch


@functools.cache
def load() -> ctypes.CDLL | None:
    # data, layer stride, block stride, words per block, ids, n, layers, threads, out
    sig = [PTR, INT64, INT64, INT64, PTR, INT64, INT64, INT, PTR]
    return load_library("block_sums", {"kvs_block_sums": (sig, None)})


def region_sums(t: torch.Tensor, ids: np.ndarray, out: np.ndarray) -> None:
    """t [L, NB+1, ...] (any dtype, contiguous) -> out [n, L, 2] (S1, S2) of the int16 words
    of t[l, b] for b in ids (int64 [n])."""
    lib = load()
    assert lib is not None and t.is_contiguous()
    L, nb1 = t.shape[0], t.shape[1]
    words = t.numel() // (L * nb1) * t.element_size() // 2
    # a thread team costs ~20 us to wake: worth it only for many blocks (~1 us each)
    threads = torch.get_num_threads() if len(ids) >= 32 else 1
    launch(lib, "kvs_block_sums", t, nb1 * words, words, words, ids.ctypes.data, len(ids), L,
           threads, out.ctypes.data)
