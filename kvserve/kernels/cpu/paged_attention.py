"""Bindings of ``kvserve/csrc/paged_attention.c``: the paged-attention kernel and the 8-bit
KV writers.

Compiled on first use by ``kvserve.cbuild`` (system C compiler, no torch headers), called
through ctypes on raw tensor pointers. If no compiler is available, or ``KVSERVE_CPU_KERNEL=0``,
``load()`` returns None and the torch backend uses its pure-torch path (the kernel's twin).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

from kvserve.config import KVStorage
from kvserve.kernels.cpu import FLOAT, INT, INT64, PTR, declare, load_library
from kvserve.kernels.cpu.graph import Rows, launch

DTYPE_CODES = {
    torch.float32: 0, torch.bfloat16: 1, torch.float16: 2,
    torch.float8_e4m3fn: 3, torch.float8_e5m2: 4, torch.int8: 5,
}


SIGNATURES = {
    "kvs_paged_attention": ([PTR, PTR, INT, PTR, INT64, PTR, PTR, PTR, INT, INT, INT, INT,
                             INT, INT, FLOAT, INT, INT, PTR, INT], None),
    "kvs_attention_simd": ([], INT),
    "kvs_write_kv": ([PTR, INT64, PTR, INT64, INT64, INT64, INT64, INT, PTR, PTR, PTR], INT),
    "kvs_int8_scale_table": ([PTR], None),
}


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    dll = load_library("paged_attention", SIGNATURES)
    return None if dll is None else bind_amx(dll)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the entry points on another build of the same source (tests: ISA variants)."""
    return bind_amx(declare(dll, SIGNATURES))


def bind_amx(dll: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the AMX-BF16 job's switch (a baseline source built by a benchmark may lack it)
    and settle it from ``KVSERVE_CPU_AMX_ATTN`` (asking Linux for the tile state once): ``dll.amx``
    says whether rows of head_dim % 32 == 0 with BF16 / FP8 / INT8 KV run on AMX tiles."""
    dll.amx = False
    if hasattr(dll, "kvs_attention_amx"):
        fn = dll.kvs_attention_amx
        fn.argtypes, fn.restype = [INT], INT
        dll.amx = bool(fn(int(amx_setting())))  # a setting, never recorded in a graph
    return dll


def amx_setting() -> bool:
    """``KVSERVE_CPU_AMX_ATTN``: 0 keeps the attention's AMX-BF16 job off (the AVX-512 job
    runs), 1 turns it on where the CPU has AMX-BF16; unset or empty: ``AMX_DEFAULT``. Raises
    ValueError otherwise."""
    raw = os.environ.get("KVSERVE_CPU_AMX_ATTN", "").strip()
    if not raw:
        return AMX_DEFAULT
    if raw not in ("0", "1"):
        raise ValueError(f"KVSERVE_CPU_AMX_ATTN={raw!r}: expected 0 (off) or 1 (on)")
    return raw == "1"


# whether the AMX-BF16 job runs where the CPU has it and KVSERVE_CPU_AMX_ATTN is unset
AMX_DEFAULT = False


def has_amx(dll: ctypes.CDLL | None = None) -> bool:
    """The kernel (``dll``, default the engine's build) runs its AMX-BF16 job."""
    dll = dll if dll is not None else load()
    return bool(getattr(dll, "amx", False))


def set_amx(dll: ctypes.CDLL, on: bool) -> bool:
    """Turn ``dll``'s AMX-BF16 job on (where available) or off; returns whether it is on. For
    tests and benchmarks that compare the two: the engine leaves it as bound."""
    dll.amx = bool(launch(dll, "kvs_attention_amx", int(on))) \
        if hasattr(dll, "kvs_attention_amx") else False
    return dll.amx


def simd_level() -> int:
    """2: the build has the AVX-512 job, 1: the AVX2 job, 0: only the portable one."""
    dll = load()
    return 0 if dll is None else int(launch(dll, "kvs_attention_simd"))


def simd() -> bool:
    """True if the kernel was built with a vectorized job (else every call runs the portable
    one)."""
    return simd_level() > 0


def paged_attention(kv_layer: torch.Tensor, scales_layer: torch.Tensor | None, q: torch.Tensor,
                    block_tables: torch.Tensor, row_seq: torch.Tensor | None,
                    lens: torch.Tensor, sm_scale: float, out: torch.Tensor, *,
                    window: int = 0, force_scalar: bool = False,
                    dll: ctypes.CDLL | None = None) -> torch.Tensor:
    """Each query row r attends tokens [0, lens[r]) of sequence ``row_seq[r]`` (row r itself
    when ``row_seq`` is None); with ``window`` > 0 (a sliding-window layer) only the last
    ``window`` of them, [lens[r] - window, lens[r]): blocks before that are never read.

    kv_layer [NB+1, 2, bs, H, D]; scales_layer [NB+1, 2, bs, H]: bf16 (FP8), int8 log-scale
    codes (INT8, kvserve/quant/int8.py), else None;
    q [n, H*G, D] fp32, heads contiguous (rows may be strided, e.g. a view of a fused qkv
    projection); block_tables [S, mb] int64;
    row_seq [n] int64 or None; lens [n] int64; out [n, H*G, D] fp32 contiguous (written).
    ``force_scalar`` runs the portable job even where a vectorized one exists (tests);
    ``dll``: another build of the kernel (``bind``; benchmarks compare builds)."""
    dll = dll if dll is not None else load()
    assert dll is not None
    _, _, bs, h, d = kv_layer.shape
    n, hq, _ = q.shape
    assert q.dtype == torch.float32 and q.stride(2) == 1 and (hq == 1 or q.stride(1) == d)
    assert out.is_contiguous()
    assert block_tables.dtype == torch.int64 and block_tables.is_contiguous()
    assert lens.dtype == torch.int64 and lens.is_contiguous() and lens.numel() == n
    assert row_seq is None or (row_seq.dtype == torch.int64 and row_seq.is_contiguous())
    assert hq % h == 0 and hq // h <= 64
    if scales_layer is not None:
        want = KVStorage(kv_layer.dtype).scale_dtype
        assert scales_layer.dtype == want and scales_layer.is_contiguous()
    launch(dll, "kvs_paged_attention", kv_layer, scales_layer, DTYPE_CODES[kv_layer.dtype], q,
           q.stride(0), block_tables, row_seq, lens, Rows(n), block_tables.shape[1], bs, h,
           hq // h, d, float(sm_scale), torch.get_num_threads(), int(force_scalar), out,
           int(window))
    return out


# the storage dtypes kvs_write_kv writes (FP16 goes through torch)
WRITE_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                          torch.float8_e5m2, torch.int8})


def write_kv(x: torch.Tensor, rows: torch.Tensor, dst_rows: torch.Tensor,
             scale_rows: torch.Tensor | None = None, static_scales: torch.Tensor | None = None,
             row_offset: int = 0) -> None:
    """Twin: :func:`kvserve.kernels.reference.write_rows` (same arguments; bit-exact).

    Write x [T, H, D] fp32 (heads contiguous; token rows may be strided) into dst_rows
    [R, H, D] at rows ``rows + row_offset`` (int64 [T]), in dst's dtype (``WRITE_DTYPES``):

      fp32 / bf16  converted (round to nearest even), no scales;
      FP8          per-row bf16 scales into scale_rows [R, H] (dynamic, or the given static
                   bf16 scales [H]);
      INT8         symmetric, per-row 1-byte log-scale codes into scale_rows [R, H] int8."""
    dll = load()
    assert dll is not None and dst_rows.dtype in WRITE_DTYPES
    t, h, d = x.shape
    assert x.dtype == torch.float32 and x.stride(2) == 1 and (h == 1 or x.stride(1) == d)
    assert rows.dtype == torch.int64 and rows.is_contiguous() and rows.numel() == t
    assert dst_rows.is_contiguous() and dst_rows.shape[1:] == (h, d)
    assert scale_rows is None or scale_rows.is_contiguous()
    if static_scales is not None:
        assert static_scales.dtype == torch.bfloat16 and static_scales.is_contiguous()
    rc = launch(dll, "kvs_write_kv", x, x.stride(0), rows, row_offset, Rows(t), h, d,
                DTYPE_CODES[dst_rows.dtype], dst_rows, scale_rows, static_scales)
    assert rc == 0


def int8_scale_table() -> torch.Tensor:
    """The kernel's 256 INT8 scales (index code + 128), fp32; tests compare them with
    ``kvserve.quant.int8.SCALE_TABLE``."""
    dll = load()
    assert dll is not None
    out = torch.empty(256, dtype=torch.float32)
    launch(dll, "kvs_int8_scale_table", out)
    return out
