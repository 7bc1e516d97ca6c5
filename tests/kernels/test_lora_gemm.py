"""The grouped multi-LoRA GEMM: the C kernel (native build and every ISA variant this CPU runs)
and the Triton kernel (interpreter without CUDA) against the twin
``kvserve.kernels.reference.lora_delta``, over a shape sweep: slots used by several rows, rows
without an adapter, ranks padded with zeros, K / N / R not multiples of the vector width."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import lora_gemm as cl
from tests.conftest import ISA_VARIANTS, variant_library

SHAPES = [  # (T, K, N, R, S)
    (1, 64, 48, 8, 1),
    (7, 72, 130, 16, 3),  # K and N past a vector width, N past one 64-column block
    (16, 576, 192, 8, 4),
    (5, 33, 17, 5, 2),  # odd everything (masked AVX-512 tails)
    (12, 128, 64, 64, 5),
]


def _case(t, k, n, r, s, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    a = torch.randn(s, r, k, generator=g) * 0.1
    b = torch.randn(s, n, r, generator=g) * 0.1
    if r > 2:  # slot 0 has a smaller rank: its padding is zero
        a[0, r - 2:] = 0
        b[0, :, r - 2:] = 0
    idx = torch.randint(-1, s, (t,), generator=g)
    idx[0] = s - 1  # at least one row with an adapter
    scale = torch.rand(s, generator=g) + 0.5
    y = torch.randn(t, n, generator=g)
    return [v.to(device) for v in (y, x, a, b, idx, scale)]


def _lib(isa, tmp_path):
    if isa == "native":
        lib = cl.load()
        if lib is None:
            pytest.skip("no C compiler")
        return lib
    return cl.bind(variant_library("lora_gemm", isa, str(tmp_path)))


@pytest.mark.parametrize("isa", ISA_VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_c_kernel_matches_twin(isa, shape, tmp_path):
    lib = _lib(isa, tmp_path)
    y, x, a, b, idx, scale = _case(*shape, seed=sum(shape))
    want = y.double() + ref.lora_delta(x, a, b, idx, scale).double()
    got = cl.lora_gemm_(lib, y.clone(), x, a, b, idx, scale)
    assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
    none = idx < 0  # rows without an adapter are left exactly as they were
    assert torch.equal(got[none], y[none])


def test_c_kernel_paths(tmp_path):
    """The native build on this CPU takes its widest path; a row's slot out of range is
    refused, not read."""
    from kvserve.cbuild import cpu_kind

    lib = _lib("native", tmp_path)
    kind = cpu_kind()
    assert lib.kvs_lora_simd() == {"portable": 0, "avx2": 1}.get(kind, 2)
    y, x, a, b, idx, scale = _case(3, 64, 16, 4, 2, seed=1)
    idx[1] = 2
    with pytest.raises(AssertionError, match="out of range"):
        cl.lora_gemm_(lib, y, x, a, b, idx, scale)


def test_no_adapter_rows_cost_nothing():
    lib = _lib("native", None)
    y, x, a, b, _, scale = _case(4, 64, 16, 4, 2, seed=2)
    idx = torch.full((4,), -1, dtype=torch.int64)
    assert torch.equal(cl.lora_gemm_(lib, y.clone(), x, a, b, idx, scale), y)


@pytest.mark.slow  # Triton interpreter
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_triton_kernel_matches_twin(shape):
    pytest.importorskip("triton")
    from kvserve.kernels.triton.lora import lora_gemm_

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    y, x, a, b, idx, scale = _case(*shape, seed=sum(shape), device=dev)
    want = y.double() + ref.lora_delta(x, a, b, idx, scale).double()
    got = lora_gemm_(y.clone(), x, a, b, idx, scale)
    assert (got.double() - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))
    none = idx < 0
    assert torch.equal(got[none], y[none])
