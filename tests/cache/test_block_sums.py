"""The C checksum kernel (kvserve/csrc/block_sums.c) against its numpy twin: bit-equal sums.

Shapes cover the lane tail (words % 16 != 0), the int32 flush window (> 16 * 128 words per
region), FP8 scales, MLA's single component, and extreme words (+-32767, -32768) that would
overflow any narrower accumulator.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.cache.integrity import block_sums, block_sums_numpy
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.config import KVMode
from kvserve.kernels.cpu import block_sums as c_block_sums

pytestmark = pytest.mark.skipif(c_block_sums.load() is None, reason="no C compiler")

CASES = [  # (layers, blocks, block_size, heads, head_dim, components, dtype)
    (2, 5, 16, 2, 64, 2, torch.bfloat16),
    (3, 4, 16, 2, 64, 2, torch.float8_e4m3fn),  # + scales [.., C, bs, H]: 64 words
    (1, 3, 3, 1, 2, 2, torch.float8_e5m2),  # 6 payload words: tail only
    (2, 3, 5, 3, 6, 1, torch.float32),  # odd rows, 2 words per element
    (1, 2, 32, 8, 128, 2, torch.bfloat16),  # 65536 words: many flush windows
    (2, 4, 16, 1, 576, 1, torch.float8_e4m3fn),  # MLA latent row (512 + 64)
]


def _fill(kv: PagedKVCache, mode: str, g: torch.Generator) -> None:
    for t in (kv.data, kv.scales):
        if t is None:
            continue
        w = t.view(-1).view(torch.int16) if t.element_size() >= 2 else t.view(torch.int16)
        if mode == "random":
            w.copy_(torch.randint(-32768, 32768, w.shape, generator=g, dtype=torch.int32))
        else:  # adversarial: all words at the extremes
            w.fill_(-32768 if mode == "min" else 32767)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["random", "min", "max"])
def test_c_kernel_equals_numpy(case: tuple, mode: str) -> None:
    L, nb, bs, h, d, c, dtype = case
    kv = PagedKVCache(L, nb, bs, h, d, c, KVMode(dtype))
    _fill(kv, mode, torch.Generator().manual_seed(nb * bs + d))
    blocks = [nb - 1, 0, nb // 2, nb]  # any order, the null block too
    got = block_sums(kv, blocks)
    ref = block_sums_numpy(kv, blocks)
    assert got.dtype == np.int64 and got.shape == (len(blocks), L, 4)
    np.testing.assert_array_equal(got, ref)


def test_hand_worked_sums() -> None:
    """One bf16 block of 2 layers whose words are 1, 2, 3, ...: S1 = N(N+1)/2,
    S2 = sum (i+1)^2 = N(N+1)(2N+1)/6 (layer 0); layer 1 holds -1 everywhere."""
    kv = PagedKVCache(2, 1, 4, 1, 5, 2, KVMode(torch.bfloat16))  # 40 words per block and layer
    n = 40
    kv.data[0, 0].view(-1).view(torch.int16).copy_(torch.arange(1, n + 1, dtype=torch.int16))
    kv.data[1, 0].view(-1).view(torch.int16).fill_(-1)
    got = block_sums(kv, [0])
    assert got[0, 0].tolist() == [n * (n + 1) // 2, n * (n + 1) * (2 * n + 1) // 6, 0, 0]
    assert got[0, 1].tolist() == [-n, -n * (n + 1) // 2, 0, 0]
