"""The emulated AVX-512 builds (kvserve.cbuild.EMULATED: "avx512_emu", "bf16_emu") really run
the AVX-512 code on an AVX2 CPU: they report the AVX-512 tile shapes and jobs, their machine code
has no 512-bit register, and without SIMDe's headers they refuse with a clear error. The
kernel-vs-twin sweeps over these builds live with each kernel's tests (ISA_VARIANTS)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from kvserve import cbuild
from kvserve.kernels.cpu import w16_gemm as w16
from tests.conftest import require_simde, variant_library


@pytest.mark.slow  # compiles (an emulated attention build: ~20 s)
@pytest.mark.parametrize(("isa", "bf16_dot"), [("avx512_emu", 0), ("bf16_emu", 1)])
def test_emulated_builds_take_the_avx512_paths(tmp_path, isa, bf16_dot):
    """The 16-bit GEMM packs for AVX-512 (4 rows x 16 columns, not AVX2's 6 x 8), the attention
    kernel runs its AVX-512 job (2), and only bf16_emu has the bf16 dot products."""
    lib = variant_library("w16_gemm", isa, str(tmp_path))
    assert w16.packing(w16.bind(lib)) == (4, 16)
    assert lib.kvs_w16_bf16_dot() == bf16_dot
    if isa == "avx512_emu":  # (the attention kernel has no BF16 code; its build takes ~20 s)
        attention = variant_library("paged_attention", isa, str(tmp_path))
        assert attention.kvs_attention_simd() == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w16_gemm", "wq_gemm"])
def test_emulated_machine_code_runs_on_avx2(tmp_path, name):
    """No zmm register and no AVX-512-only instruction in the emulated build (it runs where
    AVX2 does); the real bf16 build of the same source has them."""
    require_simde()
    try:
        emu = cbuild.compile_variant(name, "bf16_emu", str(tmp_path), asm=True)
    except subprocess.CalledProcessError as e:
        pytest.fail(e.stderr.decode()[-500:])
    if emu is None:
        pytest.skip("no C compiler, or not x86-64")
    text = pathlib.Path(emu).read_text()
    for insn in ("%zmm", "vdpbf16ps", "vpdpbusd", "%k1"):
        assert insn not in text, insn
    real = pathlib.Path(cbuild.compile_variant(name, "bf16", str(tmp_path), asm=True)).read_text()
    assert "%zmm" in real


def test_emulated_variant_without_simde_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(cbuild, "simde_include", lambda: None)
    if cbuild._compiler() is None:
        pytest.skip("no C compiler")
    with pytest.raises(FileNotFoundError, match="simde-py"):
        cbuild.compile_variant("w16_gemm", "avx512_emu", str(tmp_path))


def test_the_emulation_header_refuses_a_real_avx512_target(tmp_path):
    """Built for a CPU that has AVX-512, the header would shadow the real intrinsics: it stops
    the build instead."""
    require_simde()
    include, cc = cbuild.simde_include(), cbuild._compiler()
    if cc is None:
        pytest.skip("needs a C compiler")
    src = tmp_path / "t.c"
    src.write_text("int f(void) { return 1; }\n")
    r = subprocess.run([cc, "-march=skylake-avx512", "-isystem", include, "-include",
                        str(pathlib.Path(cbuild.CSRC, "emu", "avx512_simde.h")), "-c",
                        str(src), "-o", str(tmp_path / "t.o")], capture_output=True)
    assert r.returncode != 0 and b"emulates AVX-512" in r.stderr


def test_kernel_build_setting(monkeypatch):
    """KVSERVE_CPU_BUILD picks the engine's build: native by default, any variant this CPU
    runs, and a clear error for a name it does not know or a build the CPU cannot run."""
    import platform

    from tests.conftest import SIMULATED_CPUS

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the variants are x86 builds")
    monkeypatch.delenv("KVSERVE_CPU_BUILD", raising=False)
    assert cbuild.kernel_build() == "native"
    monkeypatch.setenv("KVSERVE_CPU_BUILD", "portable")
    assert cbuild.kernel_build() == "portable"
    monkeypatch.setenv("KVSERVE_CPU_BUILD", "avx9")
    with pytest.raises(ValueError, match=r"KVSERVE_CPU_BUILD='avx9': expected native or one of"):
        cbuild.kernel_build()
    monkeypatch.setattr(cbuild, "cpu_flags", lambda: SIMULATED_CPUS["avx2"][0])
    monkeypatch.setenv("KVSERVE_CPU_BUILD", "bf16")
    with pytest.raises(ValueError, match="cannot run that build .lacks avx512_bf16"):
        cbuild.kernel_build()
    monkeypatch.setenv("KVSERVE_CPU_BUILD", "bf16_emu")
    assert cbuild.kernel_build() == "bf16_emu"


def test_a_named_build_that_does_not_compile_stops_the_engine(tmp_path, monkeypatch):
    """native: a failed build falls back to pure torch (None); a build named in
    KVSERVE_CPU_BUILD raises with the compiler's message instead of running something else."""
    import shutil

    if shutil.which("false") is None:
        pytest.skip("needs the false command")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached: it must compile
    monkeypatch.setattr(cbuild, "_compiler", lambda: shutil.which("false"))
    monkeypatch.delenv("KVSERVE_CPU_BUILD", raising=False)
    assert cbuild.build_library.__wrapped__("w16_gemm") is None
    if not cbuild.can_run_variant("portable"):
        pytest.skip("the variants are x86 builds")
    monkeypatch.setenv("KVSERVE_CPU_BUILD", "portable")
    with pytest.raises(RuntimeError, match="KVSERVE_CPU_BUILD=portable: w16_gemm does not build"):
        cbuild.build_library.__wrapped__("w16_gemm")
