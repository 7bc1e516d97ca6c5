"""The K-quant GEMM's AMX-INT8 path (kvserve/csrc/kq_gemm.c, TDPBSUD tile products of the
unpacked 5 / 6-bit codes) against its AVX-512 VNNI pass, bit for bit, for Q5_0 / Q5_1 / Q4_K /
Q5_K / Q6_K, and against the twin (kvserve.kernels.reference.kq_matmul). The sweeps need a CPU
with AMX-INT8 (the native build, where Linux grants the tile state) and skip elsewhere, saying
so; the compile check runs on any x86-64 host whose compiler targets AMX."""

from __future__ import annotations

import os
import platform
import subprocess

import pytest
import torch

from kvserve.cbuild import CSRC, _compiler, variant_flags
from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import kq_gemm as kq_cpu
from kvserve.kernels.cpu import wq_gemm as wq_cpu
from tests.quant.test_kq import TYPES, _close, _run, parts_of
from tests.quant.test_wq_amx import amx_int8

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def amx_lib():
    yield from amx_int8(kq_cpu.kq_library())


def _bits_equal(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_amx_path_compiles_with_tdpbsud(tmp_path):
    cc = _compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no C compiler, or not x86-64")
    base = [f for f in variant_flags("bf16") if f not in ("-shared", "-lm")] + ["-S"]
    out = tmp_path / "amx.s"
    r = subprocess.run([cc, os.path.join(CSRC, "kq_gemm.c"), "-o", str(out), *base,
                        "-mamx-tile", "-mamx-int8"], capture_output=True)
    if r.returncode:
        pytest.skip(f"this compiler does not target AMX: {r.stderr.decode()[-200:]}")
    assert "tdpbsud" in out.read_text()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n,k", [(40, 512), (21, 256)])
def test_amx_equals_vnni_bit_for_bit(amx_lib, name, n, k):
    """M = 1 .. 40 (tiles of M rows, whole and overlapping 16-row tiles), a partial last tile
    of outputs, terms 1 and 2: every output equals the VNNI pass's and is near the twin's."""
    p, _ = parts_of(name, n, k, seed=n + k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(n))
    x[2, :32] = 0.0
    for terms in (1, 2):
        for m in list(range(1, 20)) + [31, 32, 33, 40]:
            xm = x[:m].contiguous()
            assert wq_cpu.set_amx(amx_lib, False) == 0
            vnni = _run(amx_lib, xm, [p], terms)
            assert wq_cpu.set_amx(amx_lib, True, 1) == 1
            amx = _run(amx_lib, xm, [p], terms)
            assert _bits_equal(amx, vnni), (name, m, terms, (amx - vnni).abs().max())
        _close(amx, ref.kq_matmul(xm, [p], terms), xm, [p], terms)


def test_fused_shards_and_batch_invariance_on_tiles(amx_lib):
    """Three types in one call with the kernel's own threshold: bit for bit VNNI, and each row
    alone (VNNI below the threshold) equals that row in the batch of 23 (tiles)."""
    k = 512
    parts = [parts_of("Q4_K", 48, k, 1)[0], parts_of("Q6_K", 20, k, 2)[0],
             parts_of("Q5_0", 16, k, 3)[0], parts_of("Q5_1", 16, k, 4)[0]]
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(4))
    wq_cpu.set_amx(amx_lib, False)
    vnni = _run(amx_lib, x, parts, 2)
    wq_cpu.set_amx(amx_lib, True, 6)
    full = _run(amx_lib, x, parts, 2)
    assert _bits_equal(full, vnni)
    for i in range(0, 23, 4):
        for take in (1, 3, 7):
            part = _run(amx_lib, x[i:i + take].contiguous(), parts, 2)
            assert _bits_equal(part[0], full[i]), (i, take)
