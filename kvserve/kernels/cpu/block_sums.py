"""Bindings of ``kvserve/csrc/block_sums.c``: the integrity checksums (S1, S2 over int16
words) of many KV blocks in one pass over the cache in place. Twin:
``kvserve.cache.integrity.block_sums_numpy``."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from kvserve.cbuild import build_library


@functools.cache
def load() -> ctypes.CDLL | None:
    dll = build_library("block_sums")
    if dll is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dll.kvs_block_sums.argtypes = [p, i64, i64, i64, p, i64, i64, ctypes.c_int, p]
    dll.kvs_block_sums.restype = None
    return dll


def region_sums(t: torch.Tensor, ids: np.ndarray, out: np.ndarray) -> None:
    """t [L, NB+1, ...] (any dtype, contiguous) -> out [n, L, 2] (S1, S2) of the int16 words
    of t[l, b] for b in ids (int64 [n])."""
    lib = load()
    assert lib is not None and t.is_contiguous()
    L, nb1 = t.shape[0], t.shape[1]
    words = t.numel() // (L * nb1) * t.element_size() // 2
    # a thread team costs ~20 us to wake: worth it only for many blocks (~1 us each)
    threads = torch.get_num_threads() if len(ids) >= 32 else 1
    lib.kvs_block_sums(t.data_ptr(), nb1 * words, words, words, ids.ctypes.data, len(ids), L,
                       threads, out.ctypes.data)
