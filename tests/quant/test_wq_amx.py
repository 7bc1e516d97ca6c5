"""The integer-dot GEMM's AMX-INT8 path (kvserve/csrc/wq_gemm.c, TDPBSUD tile products: the
block sums on CPUs with AMX-INT8, Sapphire Rapids and later) against its AVX-512 VNNI pass, bit
for bit, and against the twin (kvserve.quant.wq / kernels.reference.wq_matmul).

The compile check runs on any x86-64 host with a compiler that targets AMX; the sweeps need a
CPU with AMX-INT8 (the native build, where Linux grants the tile state) and skip elsewhere,
saying so. Run on such a machine:

    python -m pytest -q tests/quant/test_wq_amx.py
"""

from __future__ import annotations

import os
import platform
import subprocess

import pytest
import torch

from kvserve.cbuild import CSRC, _compiler, variant_flags
from kvserve.kernels import reference
from kvserve.kernels.cpu import wq_gemm as wq_cpu
from kvserve.quant import wq


def amx_int8(lib):
    """Yield lib (a GGUF GEMM library) where it has AMX-INT8 tiles, else skip; its tile
    setting is restored afterwards. The fixture body of the wq and kq AMX tests."""
    if lib is None:
        pytest.skip("no C compiler")
    rows = wq_cpu.amx_rows(lib)
    if not rows:
        pytest.skip("this CPU (or its native build, or Linux) has no AMX-INT8 tiles")
    yield lib
    wq_cpu.set_amx(lib, True, rows)


@pytest.fixture(scope="module")
def amx_lib():
    yield from amx_int8(wq_cpu.wq_library())


def _table(n, k, group, bits, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-4).half()
    m = (-(torch.rand(n, k // group, generator=g)) * 0.1).half()
    return u, s, m, wq.pack_codes(u, bits), wq.pack_scales(s, m)


def _gemm(lib, codes, sm, q, dx, qs, n, k, group, bits, threads=1):
    y = torch.empty(q.shape[0], n)
    lib.kvs_wq_gemm(codes.data_ptr(), sm.data_ptr(), q.data_ptr(), dx.data_ptr(), qs.data_ptr(),
                    q.shape[0], n, k, group, bits, threads, y.data_ptr())
    return y


def _bits_equal(a, b):
    """Equal bit for bit (the sign of a zero included)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_amx_path_compiles_with_tdpbsud(tmp_path):
    """Everywhere: the source built for AVX512-VNNI + AMX-INT8 has the tile product (the bf16
    variant, VNNI without AMX, has none)."""
    cc = _compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no C compiler, or not x86-64")
    base = [f for f in variant_flags("bf16") if f not in ("-shared", "-lm")] + ["-S"]
    src = os.path.join(CSRC, "wq_gemm.c")
    asm = {}
    for name, extra in (("amx", ["-mamx-tile", "-mamx-int8"]), ("bf16", [])):
        out = tmp_path / f"{name}.s"
        r = subprocess.run([cc, src, "-o", str(out), *base, *extra], capture_output=True)
        if r.returncode and name == "amx":
            pytest.skip(f"this compiler does not target AMX: {r.stderr.decode()[-200:]}")
        assert r.returncode == 0, r.stderr.decode()[-500:]
        asm[name] = out.read_text()
    assert "tdpbsud" in asm["amx"] and "ldtilecfg" in asm["amx"]
    assert "tdpbsud" not in asm["bf16"] and "vpdpbusd" in asm["bf16"]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", [(32, 64, 32), (48, 128, 64), (80, 256, 128),
                                       (16, 96, 32)])
def test_amx_equals_vnni_bit_for_bit(amx_lib, bits, n, k, group):
    """M = 1 .. 70 (the few-row path: two blocks per product to 8 rows, odd block counts
    included, one chunk to 16 rows, two to 28; from 29 the one-C-tile loop's whole and
    overlapping 16-row tiles), weight tile counts that leave the last group of 3 part-aliased,
    groups of 1-4 blocks: every output equals the VNNI pass's and is near the twin's."""
    u, s, mn, codes, sm = _table(n, k, group, bits, n + k + group + bits)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(bits))
    x[3, :32] = 0.0  # a zero block
    q, dx, qs = reference.wq_quantize_act(x)
    ref = reference.wq_matmul(x, u, s, mn, group)
    for m in range(1, 71):
        args = (codes, sm, q[:m].contiguous(), dx[:m].contiguous(), qs[:m].contiguous(), n, k,
                group, bits)
        assert wq_cpu.set_amx(amx_lib, False) == 0
        vnni = _gemm(amx_lib, *args)
        assert wq_cpu.set_amx(amx_lib, True, 1) == 1
        amx = _gemm(amx_lib, *args, threads=2)
        assert _bits_equal(amx, vnni), (m, (amx - vnni).abs().max())
        torch.testing.assert_close(amx, ref[:m], rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
def test_linear_amx_equals_vnni_and_is_batch_invariant(amx_lib, terms, bits):
    """The one-call layer (quantize, GEMM, add the terms) with the tiles from 1 row and from
    the kernel's own threshold: bit for bit the VNNI result, and each row alone equals that
    row in a batch of 37 (AMX on both sides, or VNNI alone against AMX in the batch)."""
    u, s, mn, codes, sm = _table(64, 256, 32, bits, 7 + bits)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(terms))
    wq_cpu.set_amx(amx_lib, False)
    vnni = wq_cpu.wq_linear(amx_lib, x, codes, sm, 64, 32, bits, terms)
    ref = reference.wq_matmul(x, u, s, mn, 32, terms)
    torch.testing.assert_close(vnni, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for rows in (1, 4):
        assert wq_cpu.set_amx(amx_lib, True, rows) == rows
        full = wq_cpu.wq_linear(amx_lib, x, codes, sm, 64, 32, bits, terms)
        assert _bits_equal(full, vnni)
        for i in range(0, 37, 3):
            for take in (1, 2, 5):
                part = wq_cpu.wq_linear(amx_lib, x[i:i + take].contiguous(), codes, sm, 64, 32,
                                        bits, terms)
                assert _bits_equal(part[0], full[i]), (rows, i, take)


def test_extreme_codes_and_activations_on_tiles(amx_lib):
    """Codes 0 / 255 against activations at +-127 (TDPBSUD: signed A, unsigned B): the
    block sums reach +-32 * 255 * 127 exactly, as vpdpbusd's do."""
    n, k = 32, 64
    u = torch.zeros(n, k, dtype=torch.uint8)
    u[1::2] = 255
    u[2::4, ::3] = 0x80
    s = torch.full((n, k // 32), 0.01).half()
    m = torch.full((n, k // 32), -0.5).half()
    x = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0).repeat(20, 1)
    x[1], x[2] = 1.0, -1.0
    q, dx, qs = reference.wq_quantize_act(x)
    codes, sm = wq.pack_codes(u, 8), wq.pack_scales(s, m)
    wq_cpu.set_amx(amx_lib, False)
    vnni = _gemm(amx_lib, codes, sm, q, dx, qs, n, k, 32, 8)
    wq_cpu.set_amx(amx_lib, True, 1)
    amx = _gemm(amx_lib, codes, sm, q, dx, qs, n, k, 32, 8)
    assert _bits_equal(amx, vnni)
    ref = reference.wq_matmul(x, u, s, m, 32)
    torch.testing.assert_close(amx, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_amx_setting_parses_the_environment(monkeypatch):
    monkeypatch.delenv("KVSERVE_CPU_AMX_INT8", raising=False)
    assert wq_cpu.amx_setting() == -1
    monkeypatch.setenv("KVSERVE_CPU_AMX_INT8", "0")
    assert wq_cpu.amx_setting() == 0
    monkeypatch.setenv("KVSERVE_CPU_AMX_INT8", "16")
    assert wq_cpu.amx_setting() == 16
    monkeypatch.setenv("KVSERVE_CPU_AMX_INT8", "on")
    with pytest.raises(ValueError, match="KVSERVE_CPU_AMX_INT8"):
        wq_cpu.amx_setting()


def test_startup_log_names_the_tiles():
    """The start-up log's CPU path line says whether the GGUF GEMMs take AMX-INT8 tiles, and
    from how many rows."""
    from kvserve.engine.builder import describe_cpu_path
    from kvserve.kernels.cpu import kq_gemm as kq_cpu

    lib, kq = wq_cpu.wq_library(), kq_cpu.kq_library()
    if lib is None or kq is None:
        pytest.skip("no C compiler")
    line = describe_cpu_path(torch.float32, torch.bfloat16)
    rows, kq_rows = wq_cpu.amx_rows(lib), wq_cpu.amx_rows(kq)
    assert ("AMX-INT8 tiles" in line) == bool(rows or kq_rows)
    if rows and kq_rows:
        assert (f"integer-dot GGUF GEMM (AMX-INT8 tiles from {rows} rows, K-quants from "
                f"{kq_rows} rows)") in line
