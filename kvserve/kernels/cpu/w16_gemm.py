"""ctypes binding of kvserve/csrc/w16_gemm.c: fp32 x times 16-bit (bf16 / fp16) weights read
as 16-bit (twin: kvserve.kernels.reference.w16_linear).

On a CPU with AVX512-BF16 whose build has the path, bf16-weight GEMMs of at least
``bf16_dot_rows`` rows can round x to bf16 and use vdpbf16ps -- or, where the CPU has AMX
(Sapphire Rapids and later), AMX tile products (TDPBF16PS) for all of them (twin:
kvserve.kernels.reference.w16_linear_bf16_dot). The engine's threshold is settled once by its
builder (``--cpu-bf16-dot-rows``, auto: kvserve.config.resolve_bf16_dot_rows -- 1, every row,
batch-invariant, on AVX512-BF16 / AMX CPUs for bf16 tables; 0, the exact fp32 path, elsewhere
and with ``--dtype float32``) and set here by each worker. Without an engine (kernel tests,
benchmarks) ``KVSERVE_CPU_BF16_ROWS`` names it, off when unset. Rounding the activations costs
KL 1.9e-4 / top-1 0.992 against fp32 on SmolLM2 (benchmarks/bf16_dot_kl.py); docs/cpu.md has
the figures and what the path means for batch invariance."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kvserve import cbuild
from kvserve.cbuild import build_library
from kvserve.kernels.cpu.graph import Rows, launch
from kvserve.kernels.reference import w16_linear
from kvserve.quant.w16 import KINDS, W16Tiles, pack, tiles_of, unpack


@functools.cache
def w16_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, or KVSERVE_CPU_KERNEL=0): callers use the
    twin."""
    dll = build_library("w16_gemm")
    return None if dll is None else bind(dll)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's signatures (also for the tests' other-ISA builds) and ask once
    for its packed layout (``dll.packing``) and whether it has the bf16-dot path on this CPU
    (``dll.bf16_dot_built``; never asked while a graph records, where the query would be
    refused as a kernel without an adapter)."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.kvs_w16_gemm.argtypes = [p, i64, i64, i64, p, i64, i64, c_int, c_int, p, i64, i64,
                                 c_int]
    dll.kvs_w16_gemm.restype = c_int
    dll.packing = None  # (rows per tile, columns per step) of its packed tiles
    if hasattr(dll, "kvs_w16_packing"):  # (an older source built by a benchmark lacks it)
        dll.kvs_w16_packing.argtypes, dll.kvs_w16_packing.restype = [p], None
        out = torch.zeros(2, dtype=torch.int64)
        launch(dll, "kvs_w16_packing", out)
        dll.packing = (int(out[0]), int(out[1]))
    dll.bf16_dot_built = False
    if hasattr(dll, "kvs_w16_bf16_dot"):  # (an older source built by a benchmark lacks it)
        dll.kvs_w16_bf16_dot.argtypes, dll.kvs_w16_bf16_dot.restype = [], c_int
        dll.bf16_dot_built = bool(launch(dll, "kvs_w16_bf16_dot"))
    dll.amx = False  # its bf16 dot products run as AMX tile products (w16_gemm.c)
    if hasattr(dll, "kvs_w16_amx"):
        dll.kvs_w16_amx.argtypes, dll.kvs_w16_amx.restype = [c_int], c_int
        dll.amx = bool(launch(dll, "kvs_w16_amx", -1))  # asks Linux for the tile state once
    for name in ("kvs_w16_amx_block_rows", "kvs_w16_amx_few_rows"):
        if hasattr(dll, name):
            getattr(dll, name).argtypes, getattr(dll, name).restype = [i64], i64
    return dll


def has_amx(lib: ctypes.CDLL) -> bool:
    """``lib``'s bf16 dot products run on AMX tiles (built with AMX, the CPU has AMX-BF16 and
    Linux granted the tile state); else, with AVX512-BF16, on vdpbf16ps."""
    return bool(getattr(lib, "amx", False)) and has_bf16_dot(lib)


def set_amx(lib: ctypes.CDLL, on: bool) -> bool:
    """Turn ``lib``'s AMX path on (where available) or off (vdpbf16ps); returns whether it is
    on. For tests and benchmarks that compare the two: the engine leaves it as bound."""
    lib.amx = bool(launch(lib, "kvs_w16_amx", int(on))) if hasattr(lib, "kvs_w16_amx") \
        else False
    return lib.amx


def set_amx_block_rows(lib: ctypes.CDLL, rows: int) -> int:
    """From how many rows ``lib``'s AMX bf16 dots take the cache-blocked path (16 x 16 tiles,
    weights repacked per call) instead of reading the packed tiles in place; both give the same
    bits. ``rows`` >= 1 sets it, 0 restores the build's default, -1 only asks; returns the
    value in force (0: no AMX in the build). For tests and benchmarks that compare the two."""
    if not hasattr(lib, "kvs_w16_amx_block_rows"):
        return 0
    return int(launch(lib, "kvs_w16_amx_block_rows", rows))


def set_amx_few_rows(lib: ctypes.CDLL, rows: int) -> int:
    """Up to how many rows (at most 16) ``lib``'s AMX bf16 dots take the few-row loop (A and C
    tiles of exactly M rows; on 4 x 16 tables the B tiles transposed a few steps ahead, on
    VNNI tables read in place) instead of the blocked one; all give the same bits. ``rows`` >=
    0 sets it (0: never), -1 only asks; returns the value in force (0: no AMX in the build).
    For tests and benchmarks that compare the loops."""
    if not hasattr(lib, "kvs_w16_amx_few_rows"):
        return 0
    return int(launch(lib, "kvs_w16_amx_few_rows", rows))


# The AMX tiles' own layout for bf16 tables (kvserve.quant.w16's tiles of 16 rows x 2
# columns: [N / 16][K / 2][16][2], each 16-column step of 16 weight rows one 512-byte VNNI B
# tile). The AMX loops read it in place (no per-call repack or transpose: a batch-1 step
# streams its weights ~1.3x faster than from the 4 x 16 tiles); every other path reads it
# through a plain, slow loop. So the loader packs it only where every bf16-table GEMM takes
# the tiles (``amx_packing``).
AMX_PACKING = (16, 2)


def amx_packing(lib: ctypes.CDLL, weight: torch.Tensor) -> bool:
    """Pack ``weight`` in the AMX layout: a bf16 table with K % 16 == 0, ``lib``'s bf16 dots
    on AMX tiles, and every row of every step taking them (the settled bf16-dot rows = 1)."""
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 16 == 0
            and hasattr(lib, "kvs_w16_amx_few_rows") and has_amx(lib)
            and bf16_dot_rows(lib) == 1)


# No engine setting and KVSERVE_CPU_BF16_ROWS unset: no bf16 dot products (the exact fp32
# path); the threshold the engine's auto picks on AVX512-BF16 / AMX CPUs (every row), which
# benchmarks/bf16_dot_kl.py measures by default
BF16_DOT_DEFAULT_ROWS = 0
BF16_DOT_SUGGESTED_ROWS = 1


def has_bf16_dot(lib: ctypes.CDLL) -> bool:
    """``lib`` was built with the bf16-dot path, and this CPU can run it: its flags list
    avx512_bf16 and cpuid agrees (the kernel asks it too)."""
    return "avx512_bf16" in cbuild.cpu_flags() and getattr(lib, "bf16_dot_built", False)


# The engine's settled --cpu-bf16-dot-rows (EngineArgs.cpu_bf16_dot_rows), set once per process
# by its worker before any step; None: the environment decides (kernel benchmarks, tests).
_engine_rows: int | None = None


def set_bf16_dot_rows(rows: int | None) -> None:
    """The engine's setting for this process (None: ``KVSERVE_CPU_BF16_ROWS`` or off)."""
    global _engine_rows
    assert rows is None or rows >= 0, rows  # validated by EngineArgs
    _engine_rows = rows
    bf16_dot_rows.cache_clear()


def engine_bf16_dot_rows() -> int | None:
    """The setting ``set_bf16_dot_rows`` last gave this process (None: none)."""
    return _engine_rows


@functools.cache
def bf16_dot_rows(lib: ctypes.CDLL) -> int:
    """From how many rows a bf16-weight GEMM on ``lib`` uses bf16 dot products; 0 = never
    (the engine's ``cpu_bf16_dot_rows``, else ``KVSERVE_CPU_BF16_ROWS``, unset or 0, or the
    CPU or the build lacks AVX512-BF16)."""
    if _engine_rows is not None:
        return _engine_rows if _engine_rows and has_bf16_dot(lib) else 0
    raw = os.environ.get("KVSERVE_CPU_BF16_ROWS", str(BF16_DOT_DEFAULT_ROWS))
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"KVSERVE_CPU_BF16_ROWS must be a row count >= 0 (0 = off), got {raw!r}")
    return rows if rows and has_bf16_dot(lib) else 0


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 activations against a 16-bit CPU weight: the case this kernel is for."""
    return (x.dtype == torch.float32 and weight.dtype in KINDS and x.device.type == "cpu"
            and weight.device.type == "cpu")


def packing(lib: ctypes.CDLL) -> tuple[int, int]:
    """The packed layout ``lib`` reads: (rows per tile, columns per step) (kvserve.quant.w16)."""
    return lib.packing


def w16_gemm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
             bf16_rows: int = 0) -> torch.Tensor:
    """fp32 x [..., K] @ 16-bit weight [N, K]^T -> fp32 [..., N] in one C call; the weight
    row-major, or packed in ``lib``'s tiles (``w16_tiles``: kvserve.quant.w16). With
    ``bf16_rows`` > 0, row-major bf16 weights and at least that many rows use bf16 dot products
    where ``lib`` and the CPU have them (``bf16_dot_rows``)."""
    k = x.shape[-1]
    tiles = tiles_of(weight)
    if tiles is None:
        n, ldw = weight.shape[0], weight.stride(0)
        assert weight.shape[1] == k and weight.stride(1) == 1
    else:
        n, ldw = tiles.rows, 0
        layout = (tiles.tile_rows, tiles.tile_cols)
        amx = layout == AMX_PACKING and weight.dtype == torch.bfloat16 and k % 16 == 0 \
            and hasattr(lib, "kvs_w16_amx_few_rows")
        # (checked, not asserted: a mismatch would have the C read past the table)
        if tiles.cols != k or (layout != lib.packing and not amx) \
                or not weight.is_contiguous():
            raise RuntimeError(f"packed weight {tiles} does not fit x [..., {k}] and this "
                               f"kernel's tiles {lib.packing}")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        rc = launch(lib, "kvs_w16_gemm", x2, Rows(m), k, x2.stride(0), weight, n, ldw,
                    KINDS[weight.dtype], torch.get_num_threads(), y, n, bf16_rows,
                    0 if tiles is None else 1 if layout == lib.packing else 2)
        if rc == 2:
            raise RuntimeError("kvs_w16_gemm: packed weights with K % tile_cols != 0")
        if rc:
            raise MemoryError("kvs_w16_gemm: no scratch memory")
    return y.reshape(*x.shape[:-1], n)


def linear_w16(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for fp32 x and a 16-bit weight (row-major or packed): the C kernel, else
    the twin."""
    lib = w16_library()
    tiles = tiles_of(weight)
    if lib is None or (tiles is None and weight.stride(1) != 1):
        return w16_linear(x, weight if tiles is None else unpack(weight, tiles), bias)
    y = w16_gemm(lib, x, weight, bf16_dot_rows(lib))
    return y if bias is None else y + bias.float()


def packing_for(lib: ctypes.CDLL, weight: torch.Tensor) -> tuple[int, int]:
    """The tiles (rows, columns) the loader packs ``weight`` in: AMX_PACKING where
    ``amx_packing`` holds, else ``lib``'s own."""
    return AMX_PACKING if amx_packing(lib, weight) else lib.packing


def pack_weight(lib: ctypes.CDLL, weight: torch.nn.Parameter) -> W16Tiles:
    """Repack a row-major 16-bit parameter in place into the tiles ``packing_for`` picks (its
    ``data`` becomes the packed table and ``w16_tiles`` says how; a tied table is one
    parameter, packed once)."""
    packed, tiles = pack(weight.data, *packing_for(lib, weight))
    weight.data = packed
    weight.w16_tiles = tiles  # type: ignore[attr-defined]
    return tiles
