"""ctypes binding of kvserve/csrc/wq_gemm.c: y = W . x^ for integer-dot weight tiles
(layout and twin: kvserve.quant.wq).

On CPUs with AMX-INT8 (Sapphire Rapids and later) whose native build has the path, GEMMs of at
least ``amx_rows(lib)`` rows run the integer block sums as AMX tile products; every output is
bit for bit the AVX-512 VNNI one (docs/cpu.md), so the threshold changes speed only.
``KVSERVE_CPU_AMX_INT8=0`` keeps the VNNI pass for every row count (A/B runs); a number N sets
the threshold to N rows. The same switch and helpers serve kq_gemm.c (``bind_amx``)."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kvserve.cbuild import build_library
from kvserve.kernels.cpu.graph import Rows, launch
from kvserve.quant.wq import BLOCK


@functools.cache
def wq_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, or KVSERVE_CPU_KERNEL=0): callers use the
    twin."""
    dll = build_library("wq_gemm")
    return None if dll is None else bind(dll)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's signatures (also for the tests' other-ISA builds and a
    benchmark's baseline build)."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.kvs_wq_quant_act.argtypes = [p, i64, i64, c_int, c_int, p, p, p]
    dll.kvs_wq_quant_act.restype = None
    dll.kvs_wq_gemm.argtypes = [p, p, p, p, p, i64, i64, i64, i64, c_int, c_int, p]
    dll.kvs_wq_gemm.restype = None
    dll.kvs_wq_linear.argtypes = [p, i64, i64, p, p, i64, i64, c_int, c_int, c_int, p]
    dll.kvs_wq_linear.restype = c_int
    return bind_amx(dll, "kvs_wq_amx")


def bind_amx(dll: ctypes.CDLL, entry: str) -> ctypes.CDLL:
    """Declare a GGUF GEMM library's AMX-INT8 switch ``entry`` (wq_gemm.c's kvs_wq_amx,
    kq_gemm.c's kvs_kq_amx) and settle it from ``KVSERVE_CPU_AMX_INT8`` (asking Linux for the
    tile state once; never while a graph records): ``dll.amx_rows``."""
    dll.amx_entry, dll.amx_rows = entry, 0  # GEMMs of >= amx_rows rows run on tiles (0: none)
    if hasattr(dll, entry):  # (a benchmark's baseline source may lack it)
        fn = getattr(dll, entry)
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        setting = amx_setting()
        dll.amx_rows = int(fn(-1 if setting else 0, max(setting, 0)))  # not recorded
    return dll


def amx_setting() -> int:
    """``KVSERVE_CPU_AMX_INT8``: 0 keeps the AMX path off; N >= 1 sets its row threshold;
    unset or empty: on with the kernel's threshold (-1 here). Raises ValueError otherwise."""
    raw = os.environ.get("KVSERVE_CPU_AMX_INT8", "").strip()
    if not raw:
        return -1
    if not raw.isdigit():
        raise ValueError(f"KVSERVE_CPU_AMX_INT8={raw!r}: expected 0 (off) or a row threshold")
    return int(raw)


def amx_rows(lib: ctypes.CDLL) -> int:
    """The fewest rows a GEMM of ``lib`` needs to run on AMX-INT8 tiles; 0 where it never does
    (no AMX-INT8 in the build or the CPU, Linux refused the tile state, or turned off)."""
    return int(getattr(lib, "amx_rows", 0))


def set_amx(lib: ctypes.CDLL, on: bool, rows: int = 0) -> int:
    """Turn ``lib``'s AMX-INT8 path on (where available; ``rows`` >= 1 also sets its row
    threshold) or off; returns ``amx_rows(lib)``. For tests and benchmarks that compare the
    two: the engine leaves it as bound."""
    entry = getattr(lib, "amx_entry", "")
    lib.amx_rows = int(launch(lib, entry, int(on), rows)) if entry and hasattr(lib, entry) \
        else 0
    return lib.amx_rows


def wq_linear(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, sm: torch.Tensor,
              n_pad: int, group: int, bits: int, terms: int) -> torch.Tensor:
    """fp32 x [M, K] (contiguous) -> fp32 [M, n_pad]: activations quantized to ``terms`` int8
    passes (1: as llama.cpp; 2: ~15-bit, see kvserve.quant.wq), the integer-dot GEMM and the
    passes added, in one C call."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] % BLOCK == 0
    m, k = x.shape
    y = torch.empty(m, n_pad, dtype=torch.float32)
    if launch(lib, "kvs_wq_linear", x, Rows(m), k, codes, sm, n_pad, group, bits, terms,
              torch.get_num_threads(), y):
        raise MemoryError("kvs_wq_linear: no scratch memory")
    return y
