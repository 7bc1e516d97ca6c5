"""The C INT4 skinny GEMM (kvserve/csrc/int4_gemv.c) against its twin, ``x @ dequantize().T``.

The kernel reads the int4 op's packed bytes with fp32 activations, so unlike the bf16 op it
must match the fp32 twin to fp32 rounding (relative 1e-5), over a shape sweep: M = 1..5 (row
tiles of 2 and the odd tail), K not a multiple of the group (zero-padded), odd N (row padding),
group sizes 32..256 and channel-wise, symmetric and asymmetric, act-order permutation.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import int4_gemv
from kvserve.layers.int4 import methods as int4_methods
from kvserve.layers.int4.linear import Int4Linear
from kvserve.quant import int4

pytestmark = pytest.mark.skipif(int4_methods.gemv_lib() is None,
                                reason="no C compiler or no int4pack layout the kernel reads")

SHAPES = [  # (N, K, group, symmetric)
    (32, 64, 32, True), (64, 128, 32, False), (33, 96, 64, True), (40, 45, 32, False),
    (24, 37, -1, True), (96, 320, 64, True), (100, 300, 128, False), (48, 512, 256, False),
]


@pytest.mark.parametrize("n,k,gs,sym", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_matches_twin(n: int, k: int, gs: int, sym: bool, m: int, threads: int) -> None:
    g = torch.Generator().manual_seed(n * k + m)
    q = int4.quantize_rtn(torch.randn(n, k, generator=g) * 0.05, gs, sym)
    lin = Int4Linear(q, gemv_max_m=8)
    assert isinstance(lin.method, int4_methods.CpuPackMethod)
    x = torch.randn(m, k, generator=g)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = lin.method.gemv(x)
        assert torch.equal(lin(x), y)  # M <= gemv_max_m dispatches to the kernel
    finally:
        torch.set_num_threads(prev)
    ref = x.double() @ lin.dequantize().double().t()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    scale = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= 1e-5 * scale, (y - ref.float()).abs().max()


def test_gemv_dtypes_bias_and_act_order() -> None:
    """bf16 in -> bf16 out; bias added; act-order permutation applied before the kernel."""
    g = torch.Generator().manual_seed(3)
    k, n, gs = 128, 64, 32
    w = torch.randn(n, k, generator=g)
    perm = torch.randperm(k, generator=g)
    q = int4.quantize_rtn(w[:, perm], gs, True, scale_dtype=torch.bfloat16)  # held exactly
    # act-order: column perm[j] of W belongs to group j // gs
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // gs
    values = torch.empty_like(q.values)
    values[:, perm] = q.values
    qa = int4.Int4Weight(values, q.scales, None, gs, g_idx)
    bias = torch.randn(n, generator=g)
    lin = Int4Linear(qa, bias)
    assert lin.perm is not None and isinstance(lin.method, int4_methods.CpuPackMethod)
    x = torch.randn(1, k, generator=g)
    twin = lin.dequantize()  # original column order; bf16 (scale, zero) as the kernel reads
    assert torch.equal(twin, int4.dequantize(qa))
    ref = x @ twin.t() + bias
    assert torch.allclose(lin(x), ref, rtol=1e-5, atol=1e-5)
    yb = lin(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    refb = x.bfloat16().float() @ twin.t() + bias  # the kernel widens bf16 x exactly
    assert (yb.float() - refb).abs().max() <= refb.abs().max() / 256  # bf16 output rounding


def test_gemv_max_m_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows above ``gemv_max_m`` go to the int4 op (bf16), not the kernel."""
    q = int4.quantize_rtn(torch.randn(32, 64), 32, True)
    lin = Int4Linear(q, gemv_max_m=1)
    calls = []
    real = lin.method.gemv
    monkeypatch.setattr(lin.method, "gemv", lambda x: calls.append(x.shape[0]) or real(x))
    lin(torch.randn(1, 64))
    lin(torch.randn(2, 64))
    assert calls == [1]
    with pytest.raises(ValueError, match="gemv_max_m"):
        Int4Linear(q, gemv_max_m=-1)


def _portable_gemv(tmp_path):
    """int4_gemv.c built without AVX2 / F16C (the scalar loops a non-AVX2 CPU runs)."""
    import ctypes
    import shutil
    import subprocess

    from kvserve import cbuild

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    flags = [f for f in cbuild.FLAGS if f != "-march=native"]
    lib = str(tmp_path / "int4_gemv_portable.so")
    subprocess.run([cc, f"{cbuild.CSRC}/int4_gemv.c", "-o", lib, "-march=x86-64", "-mno-avx2",
                    "-mno-f16c", *flags], check=True, capture_output=True)
    return int4_gemv.bind(ctypes.CDLL(lib))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["bf16-zero-point", "gguf-min-form"])
def test_portable_build_matches_twin(form, tmp_path, monkeypatch):
    """The scalar fallbacks (bf16 (s, z) pairs; fp16 (d, m) pairs of the GGUF min form, incl.
    subnormal fp16 scales) against the twin, as on a CPU without AVX2."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 flags")
    g = torch.Generator().manual_seed(7)
    n, k = 64, 128
    if form == "gguf-min-form":
        q = int4.quantize_rtn(torch.randn(n, k, generator=g) * 0.05, 32, True)
        d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        d[0, 0] = 2.0 ** -20  # an fp16 subnormal
        m = (torch.randn(n, k // 32, generator=g) * 0.05).half()
        q = int4.Int4Weight(q.values, d, None, 32, None, m)
    else:
        q = int4.quantize_rtn(torch.randn(n, k, generator=g) * 0.05, 32, False)
    lin = Int4Linear(q, gemv_max_m=8)
    dll = _portable_gemv(tmp_path)
    monkeypatch.setattr(int4_methods, "gemv_lib", lambda: dll)
    for mm in (1, 3, 100):  # 100: the C dequantize + GEMM path
        x = torch.randn(mm, k, generator=g)
        y = lin.method.gemv(x)
        ref = x.double() @ lin.dequantize().double().t()
        assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("n,k,gs,sym", SHAPES)
def test_c_dequantize_bit_exact_with_torch_twin(n, k, gs, sym, monkeypatch):
    """kvs_int4_dequant_t (the GEMM path's weight tiles) == the torch code it replaces, bit for
    bit, for bf16 zero-point pairs and the GGUF fp16 min form."""
    g = torch.Generator().manual_seed(n + k)
    q = int4.quantize_rtn(torch.randn(n, k, generator=g) * 0.05, gs, sym)
    layers = [Int4Linear(q)]
    if gs == 32:
        d = (torch.rand(q.scales.shape, generator=g) * 0.01).half()
        m = (torch.randn(q.scales.shape, generator=g) * 0.05).half()
        layers.append(Int4Linear(int4.Int4Weight(q.values, d, None, 32, None, m)))
    for lin in layers:
        fast = lin.dequantize()
        with monkeypatch.context() as mp:
            mp.setattr(int4_methods, "gemv_lib", lambda: None)
            twin = lin.dequantize()
        assert torch.equal(fast.view(torch.int32), twin.view(torch.int32))
        x = torch.randn(100, k, generator=g)  # M >= dequant_min_m: the C-dequant GEMM
        torch.testing.assert_close(lin(x), x @ twin.t(), rtol=1e-5, atol=1e-5)
