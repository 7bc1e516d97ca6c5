"""Int4Linear's GPU layouts (``to_device_layout``): the Triton W4A16 kernel (on CUDA when there
is one, else under the interpreter) against the layer's own ``dequantize()`` (the CPU layout's
weight) + a dense matmul, over a small shape sweep. Shapes stay tiny: the interpreter is
~2000x slower."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.layers.int4.linear import Int4Linear  # noqa: E402
from kvserve.layers.int4.methods import CanonicalMethod, TritonMethod  # noqa: E402
from kvserve.quant import int4  # noqa: E402

# slow: Triton INT4 GEMM in the interpreter
pytestmark = pytest.mark.slow

DEV = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [  # (N, K, group, symmetric): odd K, K not a multiple of the group, group 32/128
    (24, 72, 32, True),  # K = 2 groups + 8
    (40, 72, 32, False),
    (16, 256, 128, False),
    (33, 200, 128, True),  # partial last group, N not a multiple of 8
    (17, 45, 16, False),  # group 16: the CPU op cannot take it -> canonical CPU layout
    (24, 37, -1, True),  # channel-wise, odd K
]


def _act_order_weight(n: int, k: int, gs: int, sym: bool, g: torch.Generator) -> int4.Int4Weight:
    """A GPTQ act-order weight: regular groups over a random column permutation."""
    q = int4.quantize_rtn(torch.randn(n, k, generator=g) * 0.05, gs, sym)
    order = torch.randperm(k, generator=g)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // gs  # column order[j] belongs to group j // gs
    return int4.Int4Weight(q.values, q.scales, q.zeros, gs, g_idx)


def _check(lin: Int4Linear, ms=(1, 3)) -> None:
    g = torch.Generator().manual_seed(7)
    w = lin.dequantize()  # fp32 [N, K]: the CPU layout's weight
    lin.to_device_layout("triton", DEV)
    assert lin.device_kernel == "triton" and lin.method.dev_packed.dtype == torch.int32
    held = {name for name, _ in lin.named_buffers()}  # the CPU layouts are dropped
    assert held <= {"bias", "perm", "method.dev_packed", "method.dev_scales", "method.dev_zeros"}
    w, w_dev = w.to(DEV), lin.dequantize()
    # the same nibbles; the CPU op's zero (bf16 -zp*s) comes back as the integer zp
    tol = float(w.abs().max()) * 2e-2
    torch.testing.assert_close(w_dev, w, rtol=0, atol=tol)
    for m in ms:
        x = torch.randn(m, lin.in_features, generator=g).to(DEV)
        y = lin(x)
        assert y.shape == (m, lin.out_features) and y.dtype == x.dtype
        ref = x @ w_dev.t() + (lin.bias if lin.bias is not None else 0.0)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
        loose = x @ w.t() + (lin.bias if lin.bias is not None else 0.0)
        err = (y - loose).abs().max() / loose.abs().max()
        assert err < 2e-2, float(err)


@pytest.mark.parametrize(("n", "k", "gs", "sym"), SHAPES)
def test_triton_layout_matches_dequantize(n, k, gs, sym, monkeypatch):
    from kvserve.kernels.triton import int4 as triton_int4

    calls = []
    real = triton_int4.int4_matmul
    monkeypatch.setattr(triton_int4, "int4_matmul", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(n * k)
    q = int4.quantize_rtn(torch.randn(n, k, generator=g) * 0.05, gs, sym)
    bias = torch.randn(n, generator=g) if sym else None
    _check(Int4Linear(q, bias))
    assert len(calls) == 2  # M = 1 and 3 went through the Triton kernel (interpreter)


@pytest.mark.parametrize("sym", [True, False])
def test_triton_layout_act_order(sym):
    g = torch.Generator().manual_seed(3)
    q = _act_order_weight(24, 96, 32, sym, g)
    lin = Int4Linear(q)
    assert lin.perm is not None  # regular act-order: columns permuted once, x per call
    dense = int4.dequantize(q)
    _check(lin)
    torch.testing.assert_close(lin.dequantize().cpu(), dense, rtol=0,
                               atol=float(dense.abs().max()) * 2e-2)


def test_triton_layout_exact_from_canonical_pack():
    """Group 16 (no CPU op): the canonical pack converts exactly (fp32 scales, int zeros)."""
    g = torch.Generator().manual_seed(11)
    q = int4.quantize_rtn(torch.randn(16, 48, generator=g), 16, False)
    lin = Int4Linear(q)
    assert isinstance(lin.method, CanonicalMethod)
    lin.to_device_layout("triton")
    assert isinstance(lin.method, TritonMethod)
    assert torch.equal(lin.dequantize(), int4.dequantize(q))
    assert torch.equal(lin.method.dev_zeros.long(), q.zeros.long() + 8)


def test_irregular_act_order_goes_dense():
    g = torch.Generator().manual_seed(5)
    k, n = 32, 16
    g_idx = torch.randint(0, 4, (k,), generator=g)
    q = int4.Int4Weight(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g),
                        torch.rand(n, 4, generator=g), None, 8, g_idx)
    lin = Int4Linear(q).to_device_layout("triton")
    assert lin.device_kernel == "dense"
    x = torch.randn(2, k, generator=g)
    torch.testing.assert_close(lin(x), x @ int4.dequantize(q).t(), rtol=1e-5, atol=1e-5)


def test_device_layout_errors_and_probe():
    lin = Int4Linear.from_dense(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="kernel"):
        lin.to_device_layout("marlin")
    lin.to_device_layout("triton")
    assert lin.to_device_layout("triton") is lin  # idempotent
    with pytest.raises(ValueError, match="tinygemm"):
        lin.to_device_layout("tinygemm")
    # a CPU move or dtype cast keeps the CPU layout (no repack)
    cpu = Int4Linear.from_dense(torch.randn(16, 64), 32).to("cpu").float()
    assert cpu.device_kernel is None


def test_tinygemm_layout_prepared_on_cpu():
    """The tinygemm layout's CPU half (nibble bytes, (scale, zero) pairs); the int32 tiles are
    made on CUDA (scripts/gpu_check.sh checks the op's output)."""
    g = torch.Generator().manual_seed(2)
    q = int4.quantize_rtn(torch.randn(20, 96, generator=g), 32, False)
    lin = Int4Linear(q)
    w = lin.dequantize()
    lin.to_device_layout("tinygemm")
    assert lin.device_kernel == "tinygemm"
    # [n_pad, k_pad / 2], [k_pad / 32, n_pad, 2]
    u8, sz = lin.method.dev_u8, lin.method.dev_sz.float()
    assert u8.shape == (24, 48) and sz.shape == (3, 24, 2)
    u = torch.stack(((u8 >> 4), (u8 & 15)), -1).view(24, 96).float()  # even column: high
    gi = torch.arange(96) // 32
    rebuilt = (u - 8) * sz[gi, :, 0].t() + sz[gi, :, 1].t()  # W = (u - 8) * scale + zero
    assert not rebuilt[20:].any()  # padded rows: weight 0
    torch.testing.assert_close(rebuilt[:20], w, rtol=0, atol=float(w.abs().max()) * 2e-2)


def test_cuda_kernel_is_an_engine_knob():
    """The loader repacks for ``EngineArgs.int4_cuda_kernel`` (no environment switch): the
    tinygemm layout keeps its bytes until it sits on CUDA; a bad name is a ValueError naming
    the knob, before anything loads."""
    from kvserve.engine.arg_utils import EngineArgs

    g = torch.Generator().manual_seed(4)
    tg = Int4Linear.from_dense(torch.randn(16, 64, generator=g), 32)
    tg.to_device_layout("tinygemm", "cpu")
    assert tg.device_kernel == "tinygemm" and tg.method.dev_u8 is not None  # tiles: on CUDA
    with pytest.raises(ValueError, match="int4_cuda_kernel"):
        EngineArgs(model="demo", int4_cuda_kernel="marlin")
