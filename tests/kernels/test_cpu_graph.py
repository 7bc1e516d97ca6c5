"""Recorded CPU graphs (kvserve/kernels/cpu/graph.py): a tape replays its kernel calls over
the [:n] prefixes of the recorded buffers, and a recording refuses anything it would not
replay."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import cpu_ops, graph, q8_gemv
from kvserve.kernels.cpu import w16_gemm as w16_cpu

pytestmark = pytest.mark.skipif(not graph.available() or w16_cpu.w16_library() is None
                                or cpu_ops.ops_library() is None, reason="no C compiler")


def _chain(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, nw: torch.Tensor):
    """A small layer: norm(res + x) -> 16-bit GEMM -> silu * up."""
    h = cpu_ops.add_rms_norm(x, res, nw, 1e-5)
    return cpu_ops.silu_mul(w16_cpu.linear_w16(h, w))


def test_replay_runs_the_recorded_calls_over_fewer_rows():
    torch.manual_seed(0)
    B, K, N = 8, 64, 48
    w = torch.randn(2 * N, K).bfloat16()
    nw = torch.rand(K) + 0.5
    x, res = torch.randn(B, K), torch.randn(B, K)
    with torch.inference_mode(), graph.recording() as tape:
        y = _chain(x, w, res, nw)
    assert tape.names == ["kvs_add_rms_norm", "kvs_w16_gemm", "kvs_silu_mul"]
    assert tape.max_rows == B
    for n in (3, 1, B):
        x_new, res_new = torch.randn(n, K), torch.randn(n, K)
        want = _chain(x_new.clone(), w, res_new.clone(), nw)
        before = y[n:].clone()
        x[:n], res[:n] = x_new, res_new  # inputs written into the recorded buffers
        tape.replay(n)
        assert torch.equal(y[:n], want)  # the same kernels, bit for bit
        assert torch.equal(y[n:], before)  # rows past n untouched
        assert torch.equal(res[:n], res_new + x_new)  # the in-place residual add replayed


def test_only_replays_the_named_kernels_in_order():
    """``Tape.only`` (the step profile's per-kernel split): a sub-tape of some kernels' calls
    with their recorded arguments; the others do not run."""
    torch.manual_seed(0)
    B, K, N = 4, 64, 48
    w = torch.randn(2 * N, K).bfloat16()
    nw = torch.rand(K) + 0.5
    x, res = torch.randn(B, K), torch.randn(B, K)
    with torch.inference_mode(), graph.recording() as tape:
        h = cpu_ops.add_rms_norm(x, res, nw, 1e-5)
        g = w16_cpu.linear_w16(h, w)
        y = cpu_ops.silu_mul(g)
    gemm = tape.only({"kvs_w16_gemm"})
    both = tape.only({"kvs_silu_mul", "kvs_add_rms_norm"})
    assert gemm.names == ["kvs_w16_gemm"] and len(gemm) == 1 and gemm.max_rows == B
    assert both.names == ["kvs_add_rms_norm", "kvs_silu_mul"]  # the tape's order
    assert len(tape) == 3 and tape.only(set()).names == []
    res0, y0 = res.clone(), y.clone()
    with torch.inference_mode():
        h.zero_()
    gemm.replay(2)  # the GEMM alone, over 2 rows: g[:2] from the zeroed h, nothing else runs
    assert torch.equal(g[:2], torch.zeros(2, 2 * N)) and torch.count_nonzero(g[2:]) > 0
    assert torch.equal(res, res0) and torch.equal(y, y0)
    both.replay(B)  # the norm's in-place residual add ran again; silu_mul re-read g
    assert torch.equal(res, res0 + x)
    assert torch.equal(y[:2], torch.zeros(2, N)) and torch.equal(y[2:], y0[2:])


def test_replay_rows_must_be_within_the_recording():
    w, x = torch.randn(8, 16).bfloat16(), torch.randn(4, 16)
    with torch.inference_mode(), graph.recording() as tape:
        w16_cpu.linear_w16(x, w)
    for bad in (0, 5, -1):
        with pytest.raises(ValueError, match="rows"):
            tape.replay(bad)


def test_recording_refuses_torch_compute():
    x = torch.randn(4, 8)
    with pytest.raises(graph.GraphCaptureError, match="computes"), graph.recording():
        x + 1  # noqa: B018 - a torch op the tape would not replay
    with pytest.raises(graph.GraphCaptureError, match="computes"), graph.recording():
        x.to(torch.bfloat16)
    with pytest.raises(graph.GraphCaptureError, match="computes"), graph.recording():
        x.t().contiguous()


def test_recording_allows_views_and_allocation():
    x = torch.randn(4, 8)
    with torch.inference_mode(), graph.recording() as tape:
        a, b = x.split((3, 5), dim=-1)
        x.view(2, 16).reshape(4, 8)[1:].t()
        x.to(torch.float32).contiguous().float()  # no-ops: they return x itself
        torch.empty(3, 3)
        a.unsqueeze(0).squeeze(0)
    assert len(tape) == 0


def test_recording_refuses_a_kernel_without_an_adapter():
    lib = q8_gemv.load()
    if lib is None:
        pytest.skip("no q8 kernel")
    q = torch.randint(-127, 128, (8, 32), dtype=torch.int8)
    d, x = torch.ones(8, 1, dtype=torch.float16), torch.randn(2, 32)
    with pytest.raises(graph.GraphCaptureError, match="kvs_q8_gemv"), graph.recording():
        q8_gemv.gemv(lib, q, d, x)


def test_recording_refuses_two_row_counts():
    w, x = torch.randn(8, 16).bfloat16(), torch.randn(4, 16)
    with pytest.raises(graph.GraphCaptureError, match="rows"), graph.recording():
        w16_cpu.linear_w16(x, w)
        w16_cpu.linear_w16(x[:3], w)


def test_launch_outside_a_recording_only_runs():
    w = torch.randn(8, 16).bfloat16()
    x = torch.randn(2, 16)
    assert torch.equal(w16_cpu.linear_w16(x, w), w16_cpu.linear_w16(x.clone(), w))


def test_gather_rows_matches_embedding_and_checks_ids():
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        table = torch.randn(50, 24).to(dtype)
        ids = torch.tensor([0, 49, 7, 7, 13])
        out = cpu_ops.gather_rows(table, ids)
        assert out is not None and out.dtype == torch.float32
        assert torch.equal(out, torch.nn.functional.embedding(ids, table).float())
        for bad in ([50], [-1], [3, 60]):
            with pytest.raises(IndexError, match="token id"):
                cpu_ops.gather_rows(table, torch.tensor(bad))


@pytest.mark.parametrize("act_terms", [0, 2])
def test_gather_q8_matches_the_embedding_twin(act_terms):
    """Both Q8_0 table layouts (row-major, integer-dot tiles): the C rows == the torch rows."""
    from kvserve.layers.q8_embedding import Q8Embedding

    torch.manual_seed(2)
    V, K = 37, 64  # V not a multiple of the tile: padded rows exist
    q = torch.randint(-128, 128, (V, K), dtype=torch.int8)
    d = (torch.rand(V, K // 32) * 0.1).to(torch.float16)
    emb = Q8Embedding(q, d, torch.float32, act_terms=act_terms)
    ids = torch.tensor([0, 36, 5, 16, 17, 5])
    tiled = emb.q is None
    got = cpu_ops.gather_q8(emb.codes if tiled else emb.q, emb.sm if tiled else emb.d, tiled, V,
                            K, ids)
    qr, dr = emb.rows(ids)
    from kvserve.quant.gguf_q8 import dequantize_q8

    assert got is not None and torch.equal(got, dequantize_q8(qr, dr))
    assert torch.equal(emb(ids), got)
    with pytest.raises(IndexError, match="token id"):
        cpu_ops.gather_q8(emb.codes if tiled else emb.q, emb.sm if tiled else emb.d, tiled, V, K,
                          torch.tensor([V]))


def test_binding_the_gguf_gemm_libraries_records_nothing():
    """The GGUF GEMM libraries settle their AMX-INT8 switch when bound, which can happen while
    a decode graph records (first load inside the forward): that call is not recorded, else
    the recording is refused and every GGUF model decodes eagerly."""
    from kvserve.kernels.cpu import kq_gemm, wq_gemm

    for mod, lib in ((wq_gemm, wq_gemm.wq_library()), (kq_gemm, kq_gemm.kq_library())):
        if lib is None:
            pytest.skip("no C compiler")
        with graph.recording() as tape:
            mod.bind(lib)
        assert len(tape) == 0
