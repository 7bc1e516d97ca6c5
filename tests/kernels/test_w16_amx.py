"""The 16-bit GEMM's AMX path (kvserve/csrc/w16_gemm.c, TDPBF16PS tile products: the bf16 dot
products on CPUs with AMX-BF16, Sapphire Rapids and later) against its twin
(kvserve.kernels.reference.w16_linear_bf16_dot), on the packed tiles and row-major tables.

The compile check runs on any x86-64 host with a compiler that targets AMX; the sweeps need a
CPU with AMX (the native build, where Linux grants the tile state) and skip elsewhere, saying
so. Run on such a machine:

    python -m pytest -q tests/kernels/test_w16_amx.py
"""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess

import pytest
import torch

from kvserve.cbuild import CSRC, _compiler, variant_flags
from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import w16_gemm as w16
from kvserve.quant.w16 import pack


@pytest.fixture(scope="module")
def amx_lib():
    lib = w16.w16_library()
    if lib is None:
        pytest.skip("no C compiler")
    if not w16.has_amx(lib):
        pytest.skip("this CPU (or its native build, or Linux) has no AMX-BF16 tiles")
    yield lib
    w16.set_amx(lib, True)


def _case(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), (torch.randn(n, k, generator=g) * 0.05).bfloat16()


def _packed(lib, w):
    p, tiles = pack(w, *lib.packing)
    p.w16_tiles = tiles
    return p


def test_amx_path_compiles_with_tdpbf16ps(tmp_path):
    """Everywhere: the source built for AVX512-BF16 + AMX has the tile product (the bf16
    variant without AMX has none)."""
    cc = _compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no C compiler, or not x86-64")
    base = [f for f in variant_flags("bf16") if f not in ("-shared", "-lm")] + ["-S"]
    src = os.path.join(CSRC, "w16_gemm.c")
    asm = {}
    for name, extra in (("amx", ["-mamx-tile", "-mamx-bf16"]), ("bf16", [])):
        out = tmp_path / f"{name}.s"
        try:
            subprocess.run([cc, src, "-o", str(out), *base, *extra], check=True,
                           capture_output=True)
        except subprocess.CalledProcessError as e:
            pytest.skip(f"the compiler cannot target AMX: {e.stderr.decode()[-300:]}")
        asm[name] = pathlib.Path(out).read_text()
    assert "tdpbf16ps" in asm["amx"] and "ldtilecfg" in asm["amx"]
    assert "tdpbf16ps" not in asm["bf16"]


@pytest.mark.parametrize("m", [1, 3, 16, 17, 33, 64, 130])
@pytest.mark.parametrize("n,k", [(4, 32), (7, 48), (33, 576), (130, 1008), (9, 4112), (5, 16)])
def test_amx_matches_twin_and_is_batch_invariant(amx_lib, m, n, k):
    """bf16_rows=1: every GEMM takes the tile products. Packed tiles == row-major tables bit for
    bit; the twin (x rounded to bf16, exact products, fp32 sums) within fp32 summation error;
    a row alone == the row in its batch, bit for bit (blocks of 16 / 32 rows, M = 1
    included); and the AMX path really ran (its sums differ in order from vdpbf16ps's)."""
    x, w = _case(m, n, k, m * 31 + n + k)
    pw = _packed(amx_lib, w)
    y = w16.w16_gemm(amx_lib, x, pw, bf16_rows=1)
    assert torch.equal(y, w16.w16_gemm(amx_lib, x, w, bf16_rows=1))
    xr = ref.bf16_round(x)
    exact = (xr.double() @ w.double().t()).float()
    bound = 4 * k * 2**-24 * (xr.abs() @ w.float().abs().t()) + 1e-30
    assert ((y - exact).abs() <= bound).all()
    torch.testing.assert_close(y, ref.w16_linear_bf16_dot(x, w), rtol=1e-5, atol=1e-5)
    for i in {0, m // 2, m - 1}:
        assert torch.equal(w16.w16_gemm(amx_lib, x[i:i + 1], pw, bf16_rows=1), y[i:i + 1])
    fp32 = (x.double() @ w.double().t()).float()
    assert (y - exact).abs().max() * 4 < (fp32 - exact).abs().max()


def test_amx_threshold_threads_and_switch(amx_lib):
    """Below bf16_rows the fp32 path runs; the thread count changes no bit; set_amx(False)
    gives the vdpbf16ps path (same twin, other sums), set_amx(True) the tiles again."""
    x, w = _case(70, 50, 1024, 3)
    pw = _packed(amx_lib, w)
    assert torch.equal(w16.w16_gemm(amx_lib, x, pw, bf16_rows=71), w16.w16_gemm(amx_lib, x, pw))
    tiles = w16.w16_gemm(amx_lib, x, pw, bf16_rows=1)
    prev = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(w16.w16_gemm(amx_lib, x, pw, bf16_rows=1), tiles)
    finally:
        torch.set_num_threads(prev)
    assert not w16.set_amx(amx_lib, False)
    dots = w16.w16_gemm(amx_lib, x, pw, bf16_rows=1)
    assert w16.set_amx(amx_lib, True)
    assert not torch.equal(dots, tiles)
    torch.testing.assert_close(dots, tiles, rtol=1e-5, atol=1e-5)
    assert torch.equal(w16.w16_gemm(amx_lib, x, pw, bf16_rows=1), tiles)


@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (33, 1536), (7, 48), (50, 1008),
                                 (5, 4112)])
def test_amx_blocked_equals_per_row_tiles(amx_lib, n, k):
    """The cache-blocked path (16 x 16 tiles, x rows as A, weights repacked as VNNI B tiles)
    gives the in-place 4 x 16 tile path's results bit for bit, for M = 1 .. 200 across the
    16- and 32-row blocks, packed and row-major tables, 1 and 2 threads (K = 1,536 and 4,112:
    several x chunks, each rounded during the previous one's products; N = 5 / 7: one weight
    block, a thread without any); a row alone at the default threshold (the blocked path for
    every M) == the row in the in-place path's batch."""
    default = w16.set_amx_block_rows(amx_lib, -1)
    assert default >= 1
    x, w = _case(200, n, k, n + k)
    pw = _packed(amx_lib, w)
    prev = torch.get_num_threads()
    try:
        for m in (1, 15, 16, 17, 64, 200):
            assert w16.set_amx_block_rows(amx_lib, 10**9) == 10**9  # in-place tiles, every M
            per_row = w16.w16_gemm(amx_lib, x[:m], pw, bf16_rows=1)
            assert torch.equal(w16.w16_gemm(amx_lib, x[:m], w, bf16_rows=1), per_row)
            assert w16.set_amx_block_rows(amx_lib, 1) == 1  # the blocked path for every M
            for t in (1, 2):
                torch.set_num_threads(t)
                assert torch.equal(w16.w16_gemm(amx_lib, x[:m], pw, bf16_rows=1), per_row)
                assert torch.equal(w16.w16_gemm(amx_lib, x[:m], w, bf16_rows=1), per_row)
            w16.set_amx_block_rows(amx_lib, 0)
            for i in {0, m // 2, m - 1}:
                assert torch.equal(w16.w16_gemm(amx_lib, x[i:i + 1], pw, bf16_rows=1),
                                   per_row[i:i + 1])
        torch.testing.assert_close(per_row, ref.w16_linear_bf16_dot(x, w), rtol=1e-5,
                                   atol=1e-5)
    finally:
        torch.set_num_threads(prev)
        w16.set_amx_block_rows(amx_lib, 0)
    assert w16.set_amx_block_rows(amx_lib, -1) == default
