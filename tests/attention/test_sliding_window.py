"""Sliding-window layers (Gemma 3's local layers) in the CPU attention paths: the C kernel (its
AVX-512 / AVX2 job and the portable one) and its pure-torch twin agree with the reference
``paged_attention(window=W)`` (which is plain masked softmax), a row reads nothing before its
window (those blocks are poisoned with NaN), and a row's result still does not depend on how its
sequence was chunked."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import get_backend
from kvserve.attention.cpu_backend import CpuAttentionBackend
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.config import KVMode
from kvserve.kernels import reference
from kvserve.kernels.cpu import paged_attention as cpu_kernel
from tests.attention.test_cpu_kernel import _filled_cache, _meta

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler")

DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8]
# (hq, hk, d, bs): the AVX-512 direct decode path (d 64, G <= 4), staging tiles, odd d
SHAPES = [(8, 2, 64, 16), (4, 4, 16, 4), (6, 1, 128, 8), (4, 2, 20, 16)]
# a window inside one block, one that straddles blocks, one longer than some sequences
WINDOWS = [3, 21, 200]


def _backends(kv, hq, hk, d, window):
    fast = CpuAttentionBackend(kv, hq, hk, d, d**-0.5, 1024, layer_windows=(window,))
    twin = CpuAttentionBackend(kv, hq, hk, d, d**-0.5, 1024, layer_windows=(window,))
    twin.use_kernel = False
    return fast, twin


def _reference(kv, q, meta, d, window):
    bt = torch.full((meta.num_seqs, max(len(t) for t in meta.block_tables)), kv.null_block)
    for b, t in enumerate(meta.block_tables):
        bt[b, : len(t)] = torch.tensor(t)
    data = kv.data.view(1, *kv.data.shape[1:])
    scales = kv.scales if kv.has_scales else None
    return reference.paged_attention(q, data, scales, 0, bt, torch.tensor(meta.seq_lens),
                                     torch.tensor(meta.query_start_loc), d**-0.5, window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hk", "d", "bs"), SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_window_kernel_twin_reference_agree(dtype, hq, hk, d, bs, window):
    torch.manual_seed(2)
    kv, perm = _filled_cache(dtype, hk, d, bs, nb=100)
    # decodes of several lengths, a prefill from scratch (3 tiles), an extend, one token
    meta = _meta([1, bs + 3, 97, 37, 61, 5 * bs - 1], [1, 1, 1, 37, 20, 1], perm, bs)
    q = torch.randn(meta.num_tokens, hq, d)
    fast, twin = _backends(kv, hq, hk, d, window)
    assert fast.use_kernel
    empty = torch.empty(0, hk, d)
    a = fast.forward(0, q, empty, empty, meta)
    meta.cache.clear()
    b = twin.forward(0, q, empty, empty, meta)
    ref = _reference(kv, q, meta, d, window)
    torch.testing.assert_close(a, ref, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(b, ref, atol=1e-4, rtol=1e-3)
    meta.cache.clear()
    row_seq, tables, lens = fast._plan(meta).kernel
    c = cpu_kernel.paged_attention(kv.data[0], kv.scales[0] if kv.has_scales else None,
                                   q.contiguous(), tables, row_seq, lens, d**-0.5,
                                   torch.empty_like(a), window=window, force_scalar=True)
    torch.testing.assert_close(c, ref, atol=1e-4, rtol=1e-3)
    # and it is not full attention (windows shorter than the sequences change the result)
    if window < 37:
        full = _reference(kv, q, meta, d, 0)
        assert not torch.allclose(full, ref, atol=1e-3)


@pytest.mark.parametrize("force_scalar", [False, True])
def test_window_reads_nothing_before_it(force_scalar):
    """Blocks wholly before every row's window hold NaN: the output stays finite and equal to
    the reference over the clean cache."""
    hq, hk, d, bs, window = 8, 2, 64, 16, 20
    kv, perm = _filled_cache(torch.float32, hk, d, bs)
    meta = _meta([90, 70], [1, 30], perm, bs)  # a decode and an extend (rows 40..69)
    q = torch.randn(meta.num_tokens, hq, d)
    ref = _reference(kv, q, meta, d, window)
    for b, n in enumerate(meta.seq_lens):
        first = n - meta.query_lens[b] + 1 - window  # the earliest key any row of b sees
        for blk in meta.block_tables[b][: max(first, 0) // bs]:
            kv.data[0, blk] = float("nan")
    fast, _ = _backends(kv, hq, hk, d, window)
    row_seq, tables, lens = fast._plan(meta).kernel
    out = cpu_kernel.paged_attention(kv.data[0], None, q.contiguous(), tables, row_seq, lens,
                                     d**-0.5, torch.empty_like(q), window=window,
                                     force_scalar=force_scalar)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_window_rows_do_not_depend_on_chunking(dtype):
    """A 45-token prefill in one step == the same rows as decodes, bit for bit (window 12)."""
    hq, hk, d, bs, window = 8, 2, 64, 16, 12
    torch.manual_seed(3)
    kv, perm = _filled_cache(dtype, hk, d, bs)
    n = 45
    q = torch.randn(n, hq, d)
    fast, _ = _backends(kv, hq, hk, d, window)
    empty = torch.empty(0, hk, d)
    whole = fast.forward(0, q, empty, empty, _meta([n], [n], perm, bs))
    for i in (0, 11, 12, 13, 30, 44):
        one = fast.forward(0, q[i : i + 1], empty, empty, _meta([i + 1], [1], perm, bs))
        assert torch.equal(one[0], whole[i]), i


def test_backends_without_windows_refuse_windowed_layers():
    kv = PagedKVCache(1, 4, 16, 1, 32, 1, KVMode(torch.bfloat16))
    with pytest.raises(ValueError, match="sliding-window"):
        get_backend("mla_torch", kv, 4, 1, 32, 0.1, 64, layer_windows=(8,))
