"""The 16-bit GEMM's bf16 dot-product path (kvserve/csrc/w16_gemm.c, AVX512-BF16 vdpbf16ps)
against its twin (kvserve.kernels.reference.w16_linear_bf16_dot), and its run-time dispatch.

Needs only torch and a C compiler. The "bf16" build (cbuild ISA variant, -mavx512bf16) compiles
on any x86-64 host (checked everywhere); running it needs a CPU with AVX512-BF16 (Zen 4 / 5,
Cooper Lake, Sapphire Rapids and later) and skips elsewhere, saying so. The same sweeps also run
on "bf16_emu", the same source with AVX-512 emulated (SIMDe), on any AVX2 CPU. On such a machine:

    python -m pytest -q tests/kernels/test_w16_bf16.py::test_bf16_dot_matches_twin
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvserve.cbuild import compile_variant
from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import w16_gemm as w16
from kvserve.kernels.reference import w16_linear
from tests.conftest import variant_library


@pytest.fixture(scope="module", params=["bf16", "bf16_emu"])
def bf16_lib(request, tmp_path_factory):
    """The bf16 variant, loaded only where the CPU runs it, and the same source with AVX-512
    emulated (cbuild's bf16_emu: SIMDe on AVX2), which runs on any AVX2 CPU."""
    return w16.bind(variant_library("w16_gemm", request.param,
                                    str(tmp_path_factory.mktemp(request.param))))


def _case(m, n, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), (torch.randn(n, k, generator=g) * 0.05).to(dtype)


def test_bf16_variant_compiles_with_vdpbf16ps(tmp_path):
    """Everywhere: the bf16 variant builds, and its assembly has the dot-product instruction
    (the AVX2 / AVX-512 builds' does not)."""
    try:
        asm = compile_variant("w16_gemm", "bf16", str(tmp_path), asm=True)
    except Exception as e:  # noqa: BLE001 - the reason is the compiler's message
        pytest.skip(f"the compiler cannot target AVX512-BF16: {e}")
    if asm is None:
        pytest.skip("no C compiler, or not x86-64")
    assert "vdpbf16ps" in pathlib.Path(asm).read_text()
    assert compile_variant("w16_gemm", "bf16", str(tmp_path)) is not None  # links too
    for other in ("avx2", "avx512"):
        text = pathlib.Path(compile_variant("w16_gemm", other, str(tmp_path), asm=True))\
            .read_text()
        assert "vdpbf16ps" not in text, other
    # the same variant carries the integer GEMM's AVX512-VNNI path
    wq = pathlib.Path(compile_variant("wq_gemm", "bf16", str(tmp_path), asm=True)).read_text()
    assert "vpdpbusd" in wq


def test_dispatch_follows_the_cpu_flags(simulate_cpu, monkeypatch):
    """bf16_dot_rows: off by default (the exact fp32 path); with KVSERVE_CPU_BF16_ROWS set,
    that threshold only where the CPU's flags list avx512_bf16 AND the build has the path (it
    asks cpuid too); 0 turns it off, anything else but a row count is refused."""

    class Built:  # a library built with the path, on a CPU that has it (w16_gemm.bind)
        bf16_dot_built = True

    lib = Built()
    monkeypatch.delenv("KVSERVE_CPU_BF16_ROWS", raising=False)
    for kind in ("avx2", "avx512", "avx512_bf16", "amx"):
        simulate_cpu(kind)
        assert w16.bf16_dot_rows(lib) == 0, kind
    monkeypatch.setenv("KVSERVE_CPU_BF16_ROWS", "128")
    for kind, want in [("avx2", 0), ("avx512", 0), ("avx512_bf16", 128), ("amx", 128)]:
        simulate_cpu(kind)
        assert w16.bf16_dot_rows(lib) == want, kind
    assert w16.bf16_dot_rows(object()) == 0  # a build without the path (or an old source)
    monkeypatch.setenv("KVSERVE_CPU_BF16_ROWS", "0")
    w16.bf16_dot_rows.cache_clear()
    assert w16.bf16_dot_rows(lib) == 0
    monkeypatch.setenv("KVSERVE_CPU_BF16_ROWS", "many")
    w16.bf16_dot_rows.cache_clear()
    with pytest.raises(ValueError, match="KVSERVE_CPU_BF16_ROWS"):
        w16.bf16_dot_rows(lib)
    monkeypatch.setenv("KVSERVE_CPU_BF16_ROWS", "128")
    native = w16.w16_library()
    if native is not None:  # this CPU's own build: the path exactly where the CPU has BF16
        w16.bf16_dot_rows.cache_clear()
        from kvserve.cbuild import cpu_flags

        has = "avx512_bf16" in cpu_flags()
        assert (w16.bf16_dot_rows(native) > 0) == (has and w16.has_bf16_dot(native))
        w16.bf16_dot_rows.cache_clear()


@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 64, 130])
@pytest.mark.parametrize("n,k", [(4, 32), (7, 40), (33, 576), (130, 1000), (64, 8), (9, 4100)])
def test_bf16_dot_matches_twin(bf16_lib, m, n, k):
    """bf16_rows=1: every GEMM takes the dot products. Against the twin (x rounded to bf16,
    exact products, fp32 sums): within fp32 summation error; rows batch-invariant; and the
    path really ran (the result is the bf16-rounded product, not the fp32 one)."""
    x, w = _case(m, n, k, m * 1000 + n + k)
    y = w16.w16_gemm(bf16_lib, x, w, bf16_rows=1)
    xr = ref.bf16_round(x)
    exact = (xr.double() @ w.double().t()).float()
    assert y.shape == (m, n) and y.dtype == torch.float32
    bound = 4 * k * 2**-24 * (xr.abs() @ w.float().abs().t()) + 1e-30
    assert ((y - exact).abs() <= bound).all()
    torch.testing.assert_close(y, ref.w16_linear_bf16_dot(x, w), rtol=1e-5, atol=1e-5)
    for i in {0, m // 2, m - 1}:  # a row alone equals the row in its batch, bit for bit
        assert torch.equal(w16.w16_gemm(bf16_lib, x[i:i + 1], w, bf16_rows=1), y[i:i + 1])
    # The path really ran: y is the bf16-rounded product (within fp32 summation error), far
    # closer to it than the fp32 product is (that one differs by x's rounding, ~2^-9 relative).
    # A fixed bound cannot say this for long rows: 4k*2^-24 outgrows the rounding's effect.
    fp32 = (x.double() @ w.double().t()).float()
    assert (y - exact).abs().max() * 4 < (fp32 - exact).abs().max()


@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 130])
@pytest.mark.parametrize("n,k", [(4, 32), (7, 48), (33, 576), (130, 1008), (9, 4112), (5, 16)])
def test_bf16_dot_packed_equals_row_major(bf16_lib, m, n, k):
    """The bf16 dot products on the packed tiles (what the engine holds: kvserve.quant.w16)
    equal the row-major ones bit for bit (K % 32 == 16 tails included), hence the twin within
    fp32 summation error; and they are the bf16-dot result, not the fp32 one."""
    from kvserve.quant.w16 import pack

    x, w = _case(m, n, k, m * 7 + n + k)
    packed, tiles = pack(w, *bf16_lib.packing)
    packed.w16_tiles = tiles
    y = w16.w16_gemm(bf16_lib, x, packed, bf16_rows=1)
    assert torch.equal(y, w16.w16_gemm(bf16_lib, x, w, bf16_rows=1))
    torch.testing.assert_close(y, ref.w16_linear_bf16_dot(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(w16.w16_gemm(bf16_lib, x, packed, bf16_rows=m + 1),
                       w16.w16_gemm(bf16_lib, x, w))  # below the threshold: fp32, as row-major
    if k >= 32:
        assert not torch.equal(y, w16.w16_gemm(bf16_lib, x, packed))


def test_threshold_fp16_and_threads(bf16_lib):
    """Below bf16_rows, and for fp16 weights, the fp32 path runs (equal to bf16_rows=0); the
    row order of sums does not depend on the thread count; strided x rows work."""
    x, w = _case(40, 50, 300, 5)
    fp32 = w16.w16_gemm(bf16_lib, x, w)
    assert torch.equal(w16.w16_gemm(bf16_lib, x, w, bf16_rows=41), fp32)
    dot = w16.w16_gemm(bf16_lib, x, w, bf16_rows=40)
    assert not torch.equal(dot, fp32)
    torch.testing.assert_close(fp32, w16_linear(x, w), rtol=1e-5, atol=1e-5)
    x16, w16h = _case(40, 50, 300, 6, torch.float16)
    assert torch.equal(w16.w16_gemm(bf16_lib, x16, w16h, bf16_rows=1),
                       w16.w16_gemm(bf16_lib, x16, w16h))
    wide = torch.zeros(40, 400)
    wide[:, 7:307] = x
    assert torch.equal(w16.w16_gemm(bf16_lib, wide[:, 7:307], w, bf16_rows=1), dot)
    prev = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(w16.w16_gemm(bf16_lib, x, w, bf16_rows=1), dot)
    finally:
        torch.set_num_threads(prev)


def test_engine_setting_decides_over_the_environment(monkeypatch):
    """--cpu-bf16-dot-rows (EngineArgs.cpu_bf16_dot_rows), set by each worker for its process,
    wins over KVSERVE_CPU_BF16_ROWS; unset (None), the environment decides; a negative count is
    refused naming the field."""
    from kvserve import LLM
    from kvserve.engine.arg_utils import EngineArgs

    lib = object()
    monkeypatch.setattr(w16, "has_bf16_dot", lambda _lib: True)  # as on an AVX512-BF16 CPU
    monkeypatch.setenv("KVSERVE_CPU_BF16_ROWS", "128")
    try:
        w16.set_bf16_dot_rows(None)
        assert w16.bf16_dot_rows(lib) == 128
        w16.set_bf16_dot_rows(0)
        assert w16.bf16_dot_rows(lib) == 0
        w16.set_bf16_dot_rows(32)
        assert w16.bf16_dot_rows(lib) == 32
        LLM("demo", cpu_bf16_dot_rows=16, kv_cache_memory="4MiB")
        assert w16.bf16_dot_rows(lib) == 16
        LLM("demo", kv_cache_memory="4MiB")  # no flag: back to the environment
        assert w16.bf16_dot_rows(lib) == 128
    finally:
        w16.set_bf16_dot_rows(None)
    with pytest.raises(ValueError, match="cpu_bf16_dot_rows"):
        EngineArgs(cpu_bf16_dot_rows=-1)
