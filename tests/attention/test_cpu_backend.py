"""The CPU paged-attention backend vs dense SDPA over the (dequantized) cached K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.cpu_backend import CpuAttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.config import KVMode
from kvserve.kernels import reference as ref


def _dense_kv(kv: PagedKVCache, layer: int, blocks: list[int], n: int):
    d = kv.data[layer, blocks]  # [nb, 2, bs, H, D]
    d = ref.fp8_dequantize(d, kv.scales[layer, blocks]) if kv.is_fp8 else d.float()
    d = d.permute(1, 0, 2, 3, 4).reshape(2, -1, kv.num_kv_heads, kv.head_dim)[:, :n]
    return d[0], d[1]  # [n, H, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
@pytest.mark.parametrize(("hq", "hk", "d", "bs"), [(4, 4, 16, 4), (8, 2, 32, 16), (6, 1, 64, 8)])
def test_mixed_batch_matches_dense(dtype, hq, hk, d, bs):
    torch.manual_seed(0)
    kv = PagedKVCache(2, 64, bs, hk, d, 2, KVMode(dtype))
    # seq0: decode at length 37, seq1: fresh prefill of 9, seq2: extend 5 tokens onto 20 cached
    seq_lens, q_lens = [37, 9, 25], [1, 9, 5]
    perm = torch.randperm(64).tolist()
    tables, used = [], 0
    for n in seq_lens:
        nb = -(-n // bs)
        tables.append(perm[used:used + nb])
        used += nb
    layer = 1
    # Pre-fill each sequence's context (all but this step's tokens) straight into the cache.
    be = CpuAttentionBackend(kv, hq, hk, d, d**-0.5, 256)
    ks, vs, rows_all = [], [], []
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        k = torch.randn(n, hk, d)
        v = torch.randn(n, hk, d)
        pos = torch.arange(n)
        blk = torch.tensor(tables[b])[pos // bs]
        rows = blk * 2 * bs + pos % bs
        kv.write(layer, rows[: n - ql], k[: n - ql], v[: n - ql])
        ks.append(k)
        vs.append(v)
        rows_all.append(rows[n - ql:])
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(num_tokens=qsl[-1], query_start_loc=qsl, query_lens=q_lens,
                             seq_lens=seq_lens, block_tables=tables,
                             write_rows=torch.cat(rows_all), slot_mapping=torch.cat(rows_all))
    q = torch.randn(qsl[-1], hq, d)
    knew = torch.cat([k[n - ql:] for k, n, ql in zip(ks, seq_lens, q_lens, strict=True)])
    vnew = torch.cat([v[n - ql:] for v, n, ql in zip(vs, seq_lens, q_lens, strict=True)])
    out = be.forward(layer, q, knew, vnew, meta)
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        k, v = _dense_kv(kv, layer, tables[b], n)
        qb = q[qsl[b]:qsl[b + 1]].transpose(0, 1).unsqueeze(0)
        allowed = torch.arange(n)[None, :] <= (torch.arange(ql) + n - ql)[:, None]
        ref = F.scaled_dot_product_attention(
            qb, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed,
            scale=d**-0.5, enable_gqa=hq != hk)[0].transpose(0, 1)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], ref, atol=2e-5, rtol=1e-4)
