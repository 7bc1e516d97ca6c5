"""Sliding-window layers in the Triton decode and prefill kernels (interpreter on CPU) against
the reference ``paged_attention(window=W)``: windows inside one tile, across tiles and longer
than the sequence, GQA, FP8; rows whose first tiles hold nothing they may see (the online
softmax keeps them at 0, not NaN)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference as ref  # noqa: E402
from kvserve.kernels.triton import attention as ta  # noqa: E402

pytestmark = pytest.mark.slow  # Triton kernels in the interpreter

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

CASES = [(torch.bfloat16, 1, 5), (torch.bfloat16, 2, 20), (torch.float8_e4m3fn, 2, 7),
         (torch.bfloat16, 4, 100)]


@pytest.mark.parametrize("dtype,group,window", CASES)
def test_decode_window(paged_cache, dtype, group, window):
    seq_lens = [37, 1, 0, 20, 64]
    c = paged_cache(seq_lens, dtype=dtype, n_comp=2, block_size=8, n_kv_heads=2,
                    head_dim=64, device=DEVICE, seed=group)
    q = torch.randn(len(seq_lens), 2 * group, 64, device=DEVICE).to(torch.bfloat16)
    args = (c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, 64**-0.5)
    out = ta.paged_decode_attention(q, *args, window=window, num_splits=3)
    exp = ref.paged_decode_attention(q.float(), *args, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), exp, atol=2e-2, rtol=2e-2)
    if window < 20:
        full = ref.paged_decode_attention(q.float(), *args)
        assert not torch.allclose(full[0], exp[0], atol=5e-2)


@pytest.mark.parametrize("dtype,group,window", CASES)
def test_prefill_window(paged_cache, make_qsl, dtype, group, window):
    seq_lens, q_lens = [37, 1, 3, 45], [37, 1, 0, 20]  # a prefill, a decode, empty, an extend
    c = paged_cache(seq_lens, dtype=dtype, n_comp=2, block_size=8, n_kv_heads=1,
                    head_dim=64, device=DEVICE, seed=10 + group)
    q = torch.randn(sum(q_lens), group, 64, device=DEVICE).to(torch.bfloat16)
    qsl = make_qsl(q_lens, DEVICE)
    args = (c.kv_data, c.kv_scales, c.layer, c.block_tables, c.seq_lens, qsl, 64**-0.5)
    out = ta.paged_attention(q, *args, window=window)
    exp = ref.paged_attention(q.float(), *args, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), exp, atol=2e-2, rtol=2e-2)
