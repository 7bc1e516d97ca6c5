"""Build-on-first-use for kvserve's small C kernels (``kvserve/csrc/*.c``).

Each source is compiled with the system C compiler (``cc -O3 -march=native -fopenmp``, ~1 s,
no torch headers) into ``~/.cache/kvserve/<name>_<hash>.so`` (hash over source + flags, so an
edit rebuilds) and opened with ctypes. ``KVSERVE_CPU_KERNEL=0`` or a missing / failing compiler
gives None: every caller then uses its pure-torch twin.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
from functools import cache

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11",
         "-ffp-contract=fast", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-lm")


def _compiler() -> str | None:
    """The C compiler: $CC (default cc), else gcc; None when neither is on PATH."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def kernel_build() -> str:
    """The build the engine's kernels use: "native" (``-march=native``, the default) or the ISA
    variant KVSERVE_CPU_BUILD names (a key of ISA_FLAGS: e.g. ``avx2`` to rule the AVX-512 code
    out, or ``bf16_emu`` to run the AVX-512 paths on an AVX2 machine while developing them).
    Raises ValueError for a name it does not know or a variant this CPU cannot run (loading it
    would stop the process on an illegal instruction)."""
    build = os.environ.get("KVSERVE_CPU_BUILD", "").strip() or "native"
    if build == "native":
        return build
    if build not in ISA_FLAGS:
        raise ValueError(f"KVSERVE_CPU_BUILD={build!r}: expected native or one of "
                         f"{', '.join(ISA_FLAGS)}")
    if not can_run_variant(build):
        lacks = sorted(ISA_CPU_FLAGS[build] - cpu_flags()) or ["x86-64"]
        raise ValueError(f"KVSERVE_CPU_BUILD={build}: this CPU cannot run that build (lacks "
                         f"{', '.join(lacks)})")
    return build


def variant_flags(isa: str) -> list[str]:
    """The compiler flags of ISA variant ``isa`` (FLAGS with its target in place of
    -march=native). Raises FileNotFoundError for an emulated variant without SIMDe's headers."""
    flags = [f for f in FLAGS if f != "-march=native"] + list(ISA_FLAGS[isa])
    if isa in EMULATED:
        include = simde_include()
        if include is None:
            raise FileNotFoundError(f"the {isa} variant needs SIMDe's headers: pip install "
                                    "simde-py (a dev extra) or apt install libsimde-dev")
        flags += ["-isystem", include, "-include", os.path.join(CSRC, "emu", "avx512_simde.h")]
    return flags


@cache
def build_library(name: str) -> ctypes.CDLL | None:
    """Compile (once per source version and build, see kernel_build) and load
    ``kvserve/csrc/<name>.c``."""
    if os.environ.get("KVSERVE_CPU_KERNEL", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        logger.info("no C compiler: %s falls back to pure torch", name)
        return None
    build = kernel_build()
    flags = FLAGS if build == "native" else variant_flags(build)
    src_path = os.path.join(CSRC, f"{name}.c")
    with open(src_path, "rb") as f:
        src = f.read()
    # shared headers (csrc/*.h, and the emulation's) are part of every kernel's version
    headers = b"".join(pathlib.Path(CSRC, h).read_bytes()
                       for h in sorted(os.listdir(CSRC)) if h.endswith(".h"))
    if build in EMULATED:  # the emulation and the SIMDe it maps onto (its version macros)
        headers += pathlib.Path(CSRC, "emu", "avx512_simde.h").read_bytes()
        headers += pathlib.Path(flags[flags.index("-isystem") + 1], "simde",
                                "simde-common.h").read_bytes()
    key = hashlib.sha256(src + headers + " ".join(flags).encode()).hexdigest()[:16]
    cache_dir = os.path.join(
        os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "kvserve")
    lib = os.path.join(cache_dir, f"{name}_{key}.so")
    if not os.path.isfile(lib):
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        try:
            subprocess.run([cc, src_path, "-o", tmp, *flags], check=True, capture_output=True)
            os.replace(tmp, lib)
        except (OSError, subprocess.CalledProcessError) as e:
            err = (getattr(e, "stderr", b"") or b"").decode()[-500:]
            if os.path.exists(tmp):
                os.remove(tmp)
            if build != "native":  # asked for by name: no quiet fallback to pure torch
                raise RuntimeError(f"KVSERVE_CPU_BUILD={build}: {name} does not build: "
                                   f"{err or e}") from e
            logger.warning("building %s failed (%s); using pure torch", name, err)
            return None
    return ctypes.CDLL(lib)


# Builds the kernel tests make besides the native one, to cover every ISA path on any machine
# that has a compiler: "avx2" is what an AVX2 + FMA + F16C CPU without AVX-512 builds natively,
# "portable" has no AVX at all (the plain C paths), "avx512" an AVX-512 CPU without VNNI or BF16
# (Skylake-SP), "bf16" one with AVX512-VNNI and AVX512-BF16 (Cooper Lake, Zen 4 / 5, Sapphire
# Rapids and later): the 16-bit GEMM's vdpbf16ps path and the integer GEMM's vpdpbusd path.
# Every variant compiles on any x86-64 host with a recent gcc / clang; running one needs the CPU
# flags in ISA_CPU_FLAGS.
ISA_FLAGS = {"avx2": ("-march=haswell",),
             "portable": ("-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f"),
             "avx512": ("-march=skylake-avx512",),
             "bf16": ("-march=skylake-avx512", "-mavx512f", "-mavx512vnni", "-mavx512bf16")}
# The same AVX-512 paths emulated on an AVX2 CPU, for tests only: the kernel is built for Haswell
# with csrc/emu/avx512_simde.h, which maps every _mm512_* intrinsic onto SIMDe's portable
# 512-bit vectors (two native halves) and claims the AVX-512 feature macros, so "avx512_emu"
# and "bf16_emu" run the code of "avx512" and "bf16" (tiles, packed layouts, masks, vdpbf16ps,
# vpdpbusd) on the machines that cannot run those. Needs SIMDe's headers: the simde-py package
# (a dev extra) or the system's (Debian libsimde-dev); see simde_include().
EMULATED = {"avx512_emu": "avx512", "bf16_emu": "bf16"}
# (-O1: SIMDe's inlined 512-bit code takes ~4x longer to compile at -O3 -- 22 s for the attention
# kernel -- and these builds check results, not speed)
ISA_FLAGS |= {"avx512_emu": ("-march=haswell", "-O1", "-Wno-psabi"),
              "bf16_emu": ("-march=haswell", "-O1", "-Wno-psabi", "-DKVS_SIMDE_BF16")}
# /proc/cpuinfo flags a CPU needs to run each variant
ISA_CPU_FLAGS: dict[str, frozenset[str]] = {
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi2"}),
    "portable": frozenset(),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq",
                         "avx512vl", "avx512cd"}),
    "bf16": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                       "avx512cd", "avx512_vnni", "avx512_bf16"}),
    "avx512_emu": frozenset({"avx2", "fma", "f16c", "bmi2"}),
    "bf16_emu": frozenset({"avx2", "fma", "f16c", "bmi2"}),
}


def simde_include() -> str | None:
    """The directory holding SIMDe's ``simde/x86/avx512.h`` (the simde-py package's, else the
    system's), or None: the emulated variants then cannot be built."""
    try:
        import simde_py

        candidates = [simde_py.get_include()]
    except ImportError:
        candidates = []
    candidates += ["/usr/include", "/usr/local/include"]
    return next((d for d in candidates
                 if os.path.isfile(os.path.join(d, "simde", "x86", "avx512.h"))), None)


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere). The one probe of the CPU
    kind: the ISA variants this CPU runs (``can_run_variant``), its kind (``cpu_kind``, the
    start-up log's CPU path) and the kernels' run-time dispatch (the 16-bit GEMM's bf16 dot
    products) read it; ``dtype=auto`` does not depend on it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# The CPU kinds kvserve tells apart (docs/cpu.md), highest first, by the flags they need:
#   amx          AMX-BF16 + AVX512-BF16      Sapphire Rapids and later
#   avx512_bf16  AVX-512 + AVX512-BF16       Zen 4 / 5, Cooper Lake
#   avx512       AVX-512 without BF16        Skylake-SP, Cascade Lake, Ice Lake
#   avx2         AVX2 + FMA + F16C           Haswell .. Zen 3
#   portable     anything else               plain C loops
# On every kind dtype=auto computes fp32 activations with compressed weights and the native
# build's C kernels (kvserve.config.resolve_model_dtypes); the kinds differ in the vector width
# the kernels are built for and, with AVX512-BF16, the 16-bit GEMM's bf16 dot products for
# GEMMs of many rows (kvserve.kernels.cpu.w16_gemm.bf16_dot_rows).
CPU_KINDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("amx", frozenset({"amx_bf16", "avx512_bf16", "avx512f"})),
    ("avx512_bf16", frozenset({"avx512_bf16", "avx512f"})),
    ("avx512", frozenset({"avx512f"})),
    ("avx2", frozenset({"avx2", "fma", "f16c"})),
)


def cpu_kind(flags: frozenset[str] | None = None) -> str:
    """amx, avx512_bf16, avx512, avx2 or portable: this CPU's kind (or that of one with
    ``flags``)."""
    flags = cpu_flags() if flags is None else flags
    return next((name for name, need in CPU_KINDS if need <= flags), "portable")


def can_run_variant(isa: str, flags: frozenset[str] | None = None) -> bool:
    """This CPU (or one with ``flags``) runs the ``isa`` variant (x86-64 only)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    return ISA_CPU_FLAGS[isa] <= (cpu_flags() if flags is None else flags)


def compile_variant(name: str, isa: str, out_dir: str, asm: bool = False) -> str | None:
    """Compile ``kvserve/csrc/<name>.c`` for ``isa`` (a key of ISA_FLAGS) into ``out_dir``
    without loading it: the shared library's path, or with ``asm`` the assembly's (``-S``).
    None without a C compiler or off x86-64 (the flags are x86 flags); raises
    CalledProcessError when it does not compile, FileNotFoundError for an emulated variant
    without SIMDe's headers."""
    import platform

    cc = _compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    out = os.path.join(out_dir, f"{name}_{isa}." + ("s" if asm else "so"))
    flags = variant_flags(isa)
    if asm:
        flags = [f for f in flags if f not in ("-shared", "-lm")] + ["-S"]
    subprocess.run([cc, os.path.join(CSRC, f"{name}.c"), "-o", out, *flags],
                   check=True, capture_output=True)
    return out


def build_variant(name: str, isa: str, out_dir: str) -> ctypes.CDLL | None:
    """Compile ``kvserve/csrc/<name>.c`` for ``isa`` (a key of ISA_FLAGS) into ``out_dir`` and
    load it; None without a C compiler or off x86-64. Load only a variant this CPU runs
    (``can_run_variant``): a library's code may use its ISA anywhere."""
    lib = compile_variant(name, isa, out_dir)
    return None if lib is None else ctypes.CDLL(lib)


def build_source(source: str, out_dir: str) -> ctypes.CDLL:
    """Compile any C file with the native flags (its ``#include "..."`` resolved against
    kvserve/csrc) into ``out_dir`` and load it: benchmarks time another version of a kernel, e.g.
    ``git show REV:kvserve/csrc/w16_gemm.c``, beside this one. Raises if it does not build."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    name = os.path.splitext(os.path.basename(source))[0]
    digest = hashlib.sha256(pathlib.Path(source).read_bytes()).hexdigest()[:12]
    out = os.path.join(out_dir, f"{name}_{digest}.so")
    subprocess.run([cc, source, "-I", CSRC, "-o", out, *FLAGS], check=True, capture_output=True)
    return ctypes.CDLL(out)
