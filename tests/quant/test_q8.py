"""GGUF Q8_0 kept 8-bit: unpacking exact against gguf, the C GEMV (AVX2 and scalar builds)
and the chunked GEMM path against the twin (fp32, relative 1e-5), embedding rows exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.kernels import reference
from kvserve.kernels.cpu import q8_gemv
from kvserve.layers import q8_embedding
from kvserve.layers.q8_embedding import Q8Embedding, Q8LMHead
from kvserve.quant.gguf_q8 import dequantize_q8, unpack_q8_0
from tests.conftest import isa_variants

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402


def _table(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(w, QT.Q8_0)
    q, d = unpack_q8_0(raw, (n, k))
    return q, d, torch.from_numpy(dequantize(raw, QT.Q8_0))


@pytest.mark.parametrize("shape", [(8, 32), (100, 576), (333, 96)])
def test_unpack_exact_against_gguf(shape):
    q, d, ref = _table(*shape, seed=shape[0])
    got = dequantize_q8(q, d)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # bit for bit
    rows = torch.tensor([0, shape[0] - 1, 3 % shape[0]])
    for a8 in (True, False):  # integer-dot tiles or row-major int8: the same rows exactly
        emb = Q8Embedding(q, d, torch.float32, act_terms=2 if a8 else 0)
        assert torch.equal(emb(rows), ref[rows])
        assert torch.equal(emb(rows.view(3, 1)), ref[rows].view(3, 1, -1))


def _check_head(head: Q8LMHead, ref: torch.Tensor, ms=(1, 2, 5, 16, 17, 40)) -> None:
    g = torch.Generator().manual_seed(0)
    for m in ms:  # <= GEMV_MAX_M: the C GEMV; above: chunked dequantize + GEMM
        x = torch.randn(m, ref.shape[1], generator=g)
        if head.table.act_terms:  # W8A8: the weights times x quantized per 32 to int8 terms
            x = reference.wq_fake_quant_act(x, head.table.act_terms)
        want = x.double() @ ref.double().t()
        got = head(x)
        assert got.dtype == torch.float32 and got.shape == (m, ref.shape[0])
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("a8", [2, 1, 0])
def test_lm_head_matches_twin(a8, monkeypatch):
    q, d, ref = _table(5000, 576, 1)
    _check_head(Q8LMHead(Q8Embedding(q, d, torch.float32, a8)), ref)
    if a8:  # without the C library: the same arithmetic in torch
        monkeypatch.setattr(q8_embedding.wq_cpu, "wq_library", lambda: None)
        _check_head(Q8LMHead(Q8Embedding(q, d, torch.float32, a8)), ref, ms=(1, 7))


@pytest.mark.slow
def test_lm_head_scalar_build(tmp_path, monkeypatch):
    import ctypes
    import platform
    import shutil
    import subprocess

    from kvserve import cbuild

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs cc on x86-64")
    lib = str(tmp_path / "q8_portable.so")
    flags = [f for f in cbuild.FLAGS if f != "-march=native"]
    subprocess.run([cc, f"{cbuild.CSRC}/q8_gemv.c", "-o", lib, "-march=x86-64", "-mno-avx2",
                    *flags], check=True, capture_output=True)
    dll = q8_gemv.bind(ctypes.CDLL(lib))
    monkeypatch.setattr(q8_gemv, "load", lambda: dll)
    q, d, ref = _table(700, 96, 2)
    d[0, 0] = 2.0 ** -20  # an fp16 subnormal scale
    ref = dequantize_q8(q, d)
    _check_head(Q8LMHead(Q8Embedding(q, d, torch.float32, act_terms=0)), ref,
                ms=(1, 3))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="int8"):
        Q8Embedding(torch.zeros(4, 32), torch.zeros(4, 1, dtype=torch.float16), torch.float32)
    with pytest.raises(ValueError, match="whole blocks"):
        unpack_q8_0(np.zeros(34, np.uint8), (1, 31))


# ---- Q8_0 linears kept packed (kvserve/layers/int4/q8_linear.py), every wq_gemm.c build


@pytest.fixture(scope="module", params=isa_variants("avx512_emu"))
def wq_build(request, tmp_path_factory):
    from kvserve.kernels.cpu import wq_gemm as wq_cpu
    from tests.conftest import variant_library

    if request.param == "native":
        dll = wq_cpu.wq_library()
        if dll is None:
            pytest.skip("C kernel unavailable")
        return dll
    return wq_cpu.bind(variant_library("wq_gemm", request.param,
                                       str(tmp_path_factory.mktemp("wq8"))))


@pytest.mark.parametrize("n,k", [(1, 32), (17, 64), (48, 96), (100, 576)])
@pytest.mark.parametrize("terms", [0, 1, 2])
def test_q8_linear_matches_gguf_dequantize(wq_build, n, k, terms, monkeypatch):
    """Q8Linear from gguf-quantized blocks: dequantize() is gguf.quants.dequantize bit for
    bit; forward is the twin's product (int8-quantized x, or fp32 x for terms 0) within fp32
    rounding, for 1 .. 33 rows, on every build of the kernel."""
    from kvserve.kernels import reference
    from kvserve.kernels.cpu import wq_gemm as wq_cpu
    from kvserve.layers.int4.q8_linear import Q8Linear

    monkeypatch.setattr(wq_cpu, "wq_library", lambda: wq_build)
    g = torch.Generator().manual_seed(n * k + terms)
    w = (torch.randn(n, k, generator=g) * 0.05).numpy()
    raw = torch.from_numpy(quantize(w, QT.Q8_0))
    lin = Q8Linear.from_blocks(raw, (n, k), terms)
    want_w = torch.from_numpy(dequantize(raw.numpy(), QT.Q8_0))
    assert torch.equal(lin.dequantize(), want_w)
    # 36 bytes per 32 weights (codes, s and m in fp16) vs the file's 34; rows padded to 16
    assert lin.weight_bytes() <= 16 * -(-n // 16) * k // 32 * 36
    for m in (1, 4, 33):
        x = torch.randn(m, k, generator=g)
        xr = reference.wq_fake_quant_act(x, terms) if terms else x
        want = (xr.double() @ want_w.double().t()).float()
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
