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


@cache
def build_library(name: str) -> ctypes.CDLL | None:
    """Compile (once per source version) and load ``kvserve/csrc/<name>.c``."""
    if os.environ.get("KVSERVE_CPU_KERNEL", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        logger.info("no C compiler: %s falls back to pure torch", name)
        return None
    src_path = os.path.join(CSRC, f"{name}.c")
    with open(src_path, "rb") as f:
        src = f.read()
    # shared headers (csrc/*.h) are part of every kernel's version
    headers = b"".join(pathlib.Path(CSRC, h).read_bytes()
                       for h in sorted(os.listdir(CSRC)) if h.endswith(".h"))
    key = hashlib.sha256(src + headers + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache_dir = os.path.join(
        os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "kvserve")
    lib = os.path.join(cache_dir, f"{name}_{key}.so")
    if not os.path.isfile(lib):
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        try:
            subprocess.run([cc, src_path, "-o", tmp, *FLAGS], check=True, capture_output=True)
            os.replace(tmp, lib)
        except (OSError, subprocess.CalledProcessError) as e:
            err = getattr(e, "stderr", b"") or b""
            logger.warning("building %s failed (%s); using pure torch", name,
                           err.decode()[-500:])
            if os.path.exists(tmp):
                os.remove(tmp)
            return None
    return ctypes.CDLL(lib)


# Builds the kernel tests make besides the native one, to cover every ISA path on any machine
# that has a compiler: "avx2" is what an AVX2 + FMA + F16C CPU without AVX-512 builds natively,
# "portable" has no AVX at all (the plain C paths).
ISA_FLAGS = {"avx2": ("-march=haswell",),
             "portable": ("-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f")}


def build_variant(name: str, isa: str, out_dir: str) -> ctypes.CDLL | None:
    """Compile ``kvserve/csrc/<name>.c`` for ``isa`` (a key of ISA_FLAGS) into ``out_dir`` and
    load it; None without a C compiler or off x86-64 (the flags are x86 flags)."""
    import platform

    cc = _compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    out = os.path.join(out_dir, f"{name}_{isa}.so")
    flags = [f for f in FLAGS if f != "-march=native"]
    subprocess.run([cc, os.path.join(CSRC, f"{name}.c"), "-o", out, *flags, *ISA_FLAGS[isa]],
                   check=True, capture_output=True)
    return ctypes.CDLL(out)


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
