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
            w16.set_amx_few_rows(amx_lib, 0)
            assert w16.set_amx_block_rows(amx_lib, 10**9) == 10**9  # in-place tiles, every M
            per_row = w16.w16_gemm(amx_lib, x[:m], pw, bf16_rows=1)
            assert torch.equal(w16.w16_gemm(amx_lib, x[:m], w, bf16_rows=1), per_row)
            assert w16.set_amx_block_rows(amx_lib, 1) == 1  # the blocked path for every M
            for few in (0, 16):  # and the few-row loop up to 16 rows
                w16.set_amx_few_rows(amx_lib, few)
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
        w16.set_amx_few_rows(amx_lib, 16)
    assert w16.set_amx_block_rows(amx_lib, -1) == default


def _vnni(w):
    p, tiles = pack(w, *w16.AMX_PACKING)
    p.w16_tiles = tiles
    return p


@pytest.mark.parametrize("n,k", [(4, 32), (7, 48), (5, 16), (33, 576), (50, 1008),
                                 (130, 1536)])
def test_amx_vnni_layout_equals_tiles(amx_lib, n, k):
    """Tables in the AMX tiles' own layout (16 x 2 tiles, the B tiles read in place) give the
    4 x 16 tiles' in-place results bit for bit: the few-row loop (M <= 16; on 4 x 16 tables
    too, its B tiles transposed ahead) and the blocked one (M > 16), 1 and 2 threads, N across
    the 16- and 32-row blocks; a row alone == the row in its batch. Other paths on the layout
    (fp32 dots, AMX off) keep their twins' results, batch-invariant."""
    x, w = _case(40, n, k, 3 * n + k)
    pw, pv = _packed(amx_lib, w), _vnni(w)
    prev = torch.get_num_threads()
    try:
        for m in (1, 2, 5, 15, 16, 17, 33, 40):
            w16.set_amx_few_rows(amx_lib, 0)
            w16.set_amx_block_rows(amx_lib, 10**9)  # the in-place 4 x 16 tiles: reference
            want = w16.w16_gemm(amx_lib, x[:m], pw, bf16_rows=1)
            w16.set_amx_block_rows(amx_lib, 0)
            for few in (0, 16):
                w16.set_amx_few_rows(amx_lib, few)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    assert torch.equal(w16.w16_gemm(amx_lib, x[:m], pv, bf16_rows=1), want)
                    assert torch.equal(w16.w16_gemm(amx_lib, x[:m], pw, bf16_rows=1), want)
            for i in {0, m - 1}:
                assert torch.equal(w16.w16_gemm(amx_lib, x[i:i + 1], pv, bf16_rows=1),
                                   want[i:i + 1])
    finally:
        torch.set_num_threads(prev)
        w16.set_amx_few_rows(amx_lib, 16)
    # fp32 dots on the layout (a GEMM below the threshold): the fp32 twin, batch-invariant
    fp32 = w16.w16_gemm(amx_lib, x, pv)
    exact = (x.double() @ w.double().t()).float()
    bound = 4 * k * 2**-24 * (x.abs() @ w.float().abs().t()) + 1e-30
    assert ((fp32 - exact).abs() <= bound).all()
    assert torch.equal(w16.w16_gemm(amx_lib, x[3:4], pv), fp32[3:4])
    # AMX off: bf16 dots in plain C, the bf16-dot twin
    assert not w16.set_amx(amx_lib, False)
    try:
        plain = w16.w16_gemm(amx_lib, x, pv, bf16_rows=1)
    finally:
        assert w16.set_amx(amx_lib, True)
    torch.testing.assert_close(plain, ref.w16_linear_bf16_dot(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(w16.w16_gemm(amx_lib, x[:1], pv, bf16_rows=1)[0],
                       w16.w16_gemm(amx_lib, x, pv, bf16_rows=1)[0])


def test_amx_layout_picked_for_every_row_tables(amx_lib, monkeypatch):
    """The loader packs bf16 tables in the AMX layout only where every row takes the tiles
    (bf16-dot rows settled to 1, K % 16 == 0); fp16 tables, another threshold or AMX off keep
    the kernel's 4 x 16 tiles. The embedding reads rows from either layout."""
    from kvserve.kernels.cpu.cpu_ops import gather_rows
    from kvserve.quant.w16 import table_rows, unpack

    w = _case(1, 50, 64, 1)[1]
    prev = w16.engine_bf16_dot_rows()
    try:
        w16.set_bf16_dot_rows(1)
        assert w16.packing_for(amx_lib, w) == w16.AMX_PACKING
        assert w16.packing_for(amx_lib, w.half()) == amx_lib.packing
        assert w16.packing_for(amx_lib, _case(1, 50, 40, 1)[1]) == amx_lib.packing
        w16.set_bf16_dot_rows(16)
        assert w16.packing_for(amx_lib, w) == amx_lib.packing
        w16.set_bf16_dot_rows(1)
        w16.set_amx(amx_lib, False)
        assert w16.packing_for(amx_lib, w) == amx_lib.packing
    finally:
        w16.set_amx(amx_lib, True)
        w16.set_bf16_dot_rows(prev)
    pv = _vnni(w)
    assert torch.equal(unpack(pv, pv.w16_tiles), w)
    ids = torch.tensor([0, 17, 49, 3])
    assert torch.equal(table_rows(pv, ids), w[ids])
    rows = gather_rows(pv, ids)
    assert rows is None or torch.equal(rows, w[ids].float())
