"""The C decode kernel vs its pure-torch twin (TorchAttentionBackend with use_kernel=False)."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import cpu_kernel
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.cache.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(("hq", "hk", "d", "bs"),
                         [(4, 4, 16, 4), (8, 2, 64, 16), (6, 1, 128, 8), (16, 2, 72, 16)])
def test_kernel_matches_twin(dtype, hq, hk, d, bs):
    torch.manual_seed(1)
    nb = 40
    kv = PagedKVCache(1, nb, bs, hk, d, 2, dtype)
    lens = [1, bs, bs + 3, 5 * bs - 1, 97]
    perm = torch.randperm(nb).tolist()
    tables, used = [], 0
    for n in lens:
        k = -(-n // bs)
        tables.append(perm[used:used + k])
        used += k
    # Fill every block with data (scaled to test FP8 dynamic scales over a wide range).
    rows = torch.arange(nb * 2 * bs).view(nb, 2, bs)[:, 0].reshape(-1)
    x = torch.randn(rows.numel(), hk, d) * torch.logspace(-2, 2, rows.numel()).view(-1, 1, 1)
    kv.write(0, rows, x, torch.randn_like(x))
    meta = AttentionMetadata(num_tokens=len(lens), query_start_loc=list(range(len(lens) + 1)),
                             query_lens=[1] * len(lens), seq_lens=lens, block_tables=tables,
                             write_rows=torch.empty(0, dtype=torch.int64),
                             slot_mapping=torch.empty(0, dtype=torch.int64))
    q = torch.randn(len(lens), hq, d)
    fast = TorchAttentionBackend(kv, hq, hk, d, d**-0.5, 1024)
    twin = TorchAttentionBackend(kv, hq, hk, d, d**-0.5, 1024)
    twin.use_kernel = False
    assert fast.use_kernel
    empty = torch.empty(0, hk, d)
    a = fast.forward(0, q, empty, empty, meta)
    meta.cache.clear()
    b = twin.forward(0, q, empty, empty, meta)
    # fp32 reassociation (vectorized dots) on scores up to ~1e3: relative 1e-3 is the bound
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_write_kernel_bit_exact_with_twin(dtype, static):
    torch.manual_seed(2)
    t, h, d = 37, 3, 64
    x = torch.randn(t, h, d) * torch.logspace(-8, 6, t).view(-1, 1, 1)
    x[0, 0, :5] = torch.tensor([0.0, -0.0, 1e30, -1e30, 1e-30])
    x[1] = 0.0
    st = torch.tensor([[[0.5, 2.0, 1e-3]]]).expand(1, 2, 3) if static else None
    fast = PagedKVCache(1, 8, 8, h, d, 2, dtype, static_scales=st)
    twin = PagedKVCache(1, 8, 8, h, d, 2, dtype, static_scales=st)
    twin.use_kernel = False
    assert fast.use_kernel
    rows = torch.randperm(8 * 2 * 8)[:t]
    rows = (rows // 16) * 16 + rows % 8  # component-0 rows
    fast.write(0, rows, x, -x)
    twin.write(0, rows, x, -x)
    assert torch.equal(fast.data.view(torch.uint8), twin.data.view(torch.uint8))
    assert torch.equal(fast.scales.view(torch.int16), twin.scales.view(torch.int16))
