"""The integer-dot kernel (kvserve/csrc/wq_gemm.c) against its twin (kvserve.quant.wq), on
the build this machine makes and every ISA variant this CPU runs (AVX2, portable, AVX-512,
AVX512-BF16)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvserve.kernels import reference
from kvserve.kernels.cpu import wq_gemm as wq_cpu
from kvserve.quant import wq
from tests.conftest import isa_variants, variant_library


def _built_lib(tmp_path_factory, isa: str) -> ctypes.CDLL:
    return wq_cpu.bind(variant_library("wq_gemm", isa, str(tmp_path_factory.mktemp("wq"))))


# (its AVX-512 code is the VNNI pass only: avx512_emu would repeat the AVX2 build)
@pytest.fixture(scope="module", params=isa_variants("avx512_emu"))
def lib(request, tmp_path_factory):
    if request.param == "native":
        dll = wq_cpu.wq_library()
        if dll is None:
            pytest.skip("C kernel unavailable")
        return dll
    return _built_lib(tmp_path_factory, request.param)


def _weights(n, k, group, bits, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-4).half()
    m = (-(torch.rand(n, k // group, generator=g)) * 0.1).half()
    return u, s, m


def test_codes_and_scales_round_trip():
    for bits in (4, 8):
        u, s, m = _weights(32, 64, 32, bits, 0)
        codes = wq.pack_codes(u, bits)
        assert codes.numel() == 32 * 64 * bits // 8
        assert torch.equal(wq.unpack_codes(codes, 32, 64, bits), u)
        s2, m2 = wq.unpack_scales(wq.pack_scales(s, m))
        assert torch.equal(s2, s) and torch.equal(m2, m)


@pytest.mark.parametrize("terms", [1, 2])
def test_quantize_act_matches_twin_bit_for_bit(lib, terms):
    g = torch.Generator().manual_seed(terms)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 96)
    x[1, :32] = 0.0  # a zero block: dx = 0, q = 0
    t = terms
    q, dx, qs = (torch.empty(t * 64, 96, dtype=torch.int8), torch.empty(t * 64, 3),
                 torch.empty(t * 64, 3, dtype=torch.int32))
    lib.kvs_wq_quant_act(x.data_ptr(), 64, 96, terms, 1, q.data_ptr(), dx.data_ptr(),
                         qs.data_ptr())
    q2, dx2, qs2 = reference.wq_quantize_act(x, terms)
    assert torch.equal(q, q2) and torch.equal(dx, dx2) and torch.equal(qs, qs2)
    assert int(q.abs().max()) == 127 and float(dx[1, 0]) == 0.0


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group", [(1, 16, 32, 32), (3, 48, 64, 32), (4, 32, 128, 64),
                                         (5, 64, 256, 128), (9, 80, 96, 32),
                                         (17, 16, 576, 32)])
def test_gemm_matches_twin(lib, bits, m, n, k, group):
    u, s, mn = _weights(n, k, group, bits, m * 1000 + n + k)
    x = torch.randn(m, k)
    codes, sm = wq.pack_codes(u, bits), wq.pack_scales(s, mn)
    q, dx, qs = reference.wq_quantize_act(x)
    y = torch.empty(m, n)
    lib.kvs_wq_gemm(codes.data_ptr(), sm.data_ptr(), q.data_ptr(), dx.data_ptr(), qs.data_ptr(),
                    m, n, k, group, bits, 2, y.data_ptr())
    ref = reference.wq_matmul(x, u, s, mn, group)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("terms", [1, 2])
def test_quantize_act_nan_is_ignored_by_amax_and_clamps_low(lib, terms):
    """Every variant (vector and scalar C alike): a NaN activation does not enter its block's
    amax (fmaxf semantics) and quantizes to -127; the block's other entries are as without it."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, generator=g)
    x[0, 3] = float("nan")
    q = torch.empty(terms * 2, 64, dtype=torch.int8)
    dx, qs = torch.empty(terms * 2, 2), torch.empty(terms * 2, 2, dtype=torch.int32)
    lib.kvs_wq_quant_act(x.data_ptr(), 2, 64, terms, 1, q.data_ptr(), dx.data_ptr(),
                         qs.data_ptr())
    clean = x.clone()
    clean[0, 3] = 0.0
    q2, dx2, qs2 = reference.wq_quantize_act(clean, terms)
    assert torch.equal(dx, dx2)
    for t in range(terms):  # row 0 of each term: the NaN's code is -127 instead of 0
        assert int(q[2 * t, 3]) == -127 and int(q2[2 * t, 3]) == 0
        q2[2 * t, 3] = -127
        qs2[2 * t, 0] -= 127
    assert torch.equal(q, q2) and torch.equal(qs, qs2)


def _gemm(lib, codes, sm, x, n, k, group, bits):
    q, dx, qs = reference.wq_quantize_act(x)
    y = torch.empty(x.shape[0], n)
    lib.kvs_wq_gemm(codes.data_ptr(), sm.data_ptr(), q.data_ptr(), dx.data_ptr(), qs.data_ptr(),
                    x.shape[0], n, k, group, bits, 2, y.data_ptr())
    return y


@pytest.mark.parametrize("bits", [4, 8])
def test_extreme_codes_and_activations(lib, bits):
    """Codes 0 and 2^bits - 1 against activations at +-127: the 8-bit AVX2 path computes
    (u ^ 0x80) q with |u ^ 0x80| <= 128, the 4-bit one sums 8 nibble pairs in 16 bits; neither
    may overflow."""
    n, k = 32, 64
    u = torch.zeros(n, k, dtype=torch.uint8)
    u[1::2] = (1 << bits) - 1
    u[2::4, ::3] = 0x80 if bits == 8 else 8
    s = torch.full((n, k // 32), 0.01).half()
    m = torch.full((n, k // 32), -0.5).half()
    x = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0).repeat(4, 1)
    x[1] = 1.0
    x[2] = -1.0
    x[3, ::5] = 0.0
    codes, sm = wq.pack_codes(u, bits), wq.pack_scales(s, m)
    y = _gemm(lib, codes, sm, x, n, k, 32, bits)
    ref = reference.wq_matmul(x, u, s, m, 32)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32)])
def test_kernel_rows_are_batch_invariant(lib, bits, group):
    """Every ISA variant: a row's result is bit for bit the same alone, in a pass of 2, 3, 5
    or 8 rows (AVX-512 VNNI: the wide pass, from 1 row) or in a batch of 11 (AVX2: passes of 4
    and a remainder; VNNI: two wide chunks of 6 and 5, or AMX tiles). VNNI's passes of 4 (over
    16 rows, AMX off) against the wide pass: test_wq_amx.py."""
    u, s, mn = _weights(48, 256, group, bits, 11)
    codes, sm = wq.pack_codes(u, bits), wq.pack_scales(s, mn)
    x = torch.randn(11, 256)
    full = _gemm(lib, codes, sm, x, 48, 256, group, bits)
    for i in range(11):
        for rows in (1, 2, 3, 5, 8):
            if i + rows <= 11:
                part = _gemm(lib, codes, sm, x[i:i + rows].contiguous(), 48, 256, group, bits)
                assert torch.equal(part[0], full[i])


@pytest.mark.parametrize("bits", [4, 8])
def test_threads_share_tiles_bit_for_bit(lib, bits):
    """The OpenMP loops hand out chunks of tiles dynamically (kvs_sched.h): whichever thread
    takes a tile, and however many threads share them (more than this host's cores, so some
    are preempted while others take their chunks), every output is bit for bit the 1-thread
    one, on every path (1-2 row passes, the wide VNNI pass, AMX tiles) and in the activation
    quantizer's parallel loop."""
    n, k = 16 * 37, 128  # 37 tiles: chunks of uneven count per thread
    u, s, mn = _weights(n, k, 32, bits, 21)
    codes, sm = wq.pack_codes(u, bits), wq.pack_scales(s, mn)
    g = torch.Generator().manual_seed(22)
    for m in (1, 2, 5, 12, 20, 33):
        q, dx, qs = reference.wq_quantize_act(torch.randn(m, k, generator=g))
        ys = []
        for threads in (1, 2, 3, 5):
            y = torch.empty(m, n)
            lib.kvs_wq_gemm(codes.data_ptr(), sm.data_ptr(), q.data_ptr(), dx.data_ptr(),
                            qs.data_ptr(), m, n, k, 32, bits, threads, y.data_ptr())
            ys.append(y)
        assert all(torch.equal(ys[0], y) for y in ys[1:]), m
    x = torch.randn(640, 128, generator=g)  # M * K > 65536: the quantizer's loop is parallel
    outs = []
    for threads in (1, 3):
        q, dx = torch.empty(2 * 640, 128, dtype=torch.int8), torch.empty(2 * 640, 4)
        qs = torch.empty(2 * 640, 4, dtype=torch.int32)
        lib.kvs_wq_quant_act(x.data_ptr(), 640, 128, 2, threads, q.data_ptr(), dx.data_ptr(),
                             qs.data_ptr())
        outs.append((q, dx, qs))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("terms", [1, 2])
def test_rows_are_batch_invariant(terms):
    lib = wq_cpu.wq_library()
    if lib is None:
        pytest.skip("C kernel unavailable")
    u, s, mn = _weights(64, 256, 32, 4, 7)
    codes, sm = wq.pack_codes(u, 4), wq.pack_scales(s, mn)
    x = torch.randn(11, 256)
    full = wq_cpu.wq_linear(lib, x, codes, sm, 64, 32, 4, terms)
    ref = reference.wq_matmul(x, u, s, mn, 32, terms)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for i in range(11):
        one = wq_cpu.wq_linear(lib, x[i:i + 1].contiguous(), codes, sm, 64, 32, 4, terms)
        assert torch.equal(one[0], full[i])


def test_fake_quant_error_is_small():
    """The twin's result against the unquantized-activation product (what the fp32 path
    computes): one int8 term (llama.cpp's Q8 blocks) a few 1e-3 relative, two terms ~1e-5."""
    u, s, mn = _weights(64, 576, 32, 4, 3)
    x = torch.randn(8, 576)
    w = reference.wq_dequantize(u, s, mn, 32)
    exact = x.double() @ w.double().t()
    err1 = (reference.wq_matmul(x, u, s, mn, 32, 1).double() - exact).norm() / exact.norm()
    err2 = (reference.wq_matmul(x, u, s, mn, 32, 2).double() - exact).norm() / exact.norm()
    assert 1e-4 < float(err1) < 1e-2 and 0 < float(err2) < 1e-4, (err1, err2)
    torch.testing.assert_close(reference.wq_fake_quant_act(x, 2), x, rtol=0, atol=2e-5 * 4.5)


def test_check_shape_errors():
    with pytest.raises(ValueError, match="bits"):
        wq.check_shape(64, 32, 2)
    with pytest.raises(ValueError, match="group_size"):
        wq.check_shape(64, 48, 4)
