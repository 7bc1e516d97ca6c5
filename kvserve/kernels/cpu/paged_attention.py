"""Bindings of ``kvserve/csrc/paged_attention.c``: the paged-attention kernel and the 8-bit
KV writers.

Compiled on first use by ``kvserve.cbuild`` (system C compiler, no torch headers), called
through ctypes on raw tensor pointers. If no compiler is available, or ``KVSERVE_CPU_KERNEL=0``,
``load()`` returns None and the torch backend uses its pure-torch path (the kernel's twin).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kvserve.kernels.cpu import FLOAT, INT, PTR, load_library

DTYPE_CODES = {
    torch.float32: 0, torch.bfloat16: 1, torch.float16: 2,
    torch.float8_e4m3fn: 3, torch.float8_e5m2: 4, torch.int8: 5,
}


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    return load_library("paged_attention", {
        "kvs_paged_attention": ([PTR, PTR, INT, PTR, PTR, PTR, PTR, INT, INT, INT, INT, INT, INT,
                                 FLOAT, INT, INT, PTR], None),
        "kvs_attention_simd": ([], INT),
        "kvs_write_fp8": ([PTR, PTR, INT, INT, INT, INT, PTR, PTR, PTR], None),
        "kvs_write_int8": ([PTR, PTR, INT, INT, INT, PTR, PTR], None),
        "kvs_int8_scale_table": ([PTR], None),
    })


def simd() -> bool:
    """True if the kernel was built with its AVX2 job (else every call runs the portable one)."""
    dll = load()
    return dll is not None and bool(dll.kvs_attention_simd())


def paged_attention(kv_layer: torch.Tensor, scales_layer: torch.Tensor | None, q: torch.Tensor,
                    block_tables: torch.Tensor, row_seq: torch.Tensor | None,
                    lens: torch.Tensor, sm_scale: float, out: torch.Tensor, *,
                    force_scalar: bool = False) -> torch.Tensor:
    """Each query row r attends tokens [0, lens[r]) of sequence ``row_seq[r]`` (row r itself
    when ``row_seq`` is None).

    kv_layer [NB+1, 2, bs, H, D]; scales_layer [NB+1, 2, bs, H]: bf16 (FP8), int8 log-scale
    codes (INT8, kvserve/quant/int8.py), else None;
    q [n, H*G, D] fp32 contiguous; block_tables [S, mb] int64;
    row_seq [n] int64 or None; lens [n] int64; out [n, H*G, D] fp32 (written).
    ``force_scalar`` runs the portable job even where the AVX2 one exists (tests)."""
    dll = load()
    assert dll is not None
    _, _, bs, h, d = kv_layer.shape
    n, hq, _ = q.shape
    assert q.is_contiguous() and q.dtype == torch.float32 and out.is_contiguous()
    assert block_tables.dtype == torch.int64 and block_tables.is_contiguous()
    assert lens.dtype == torch.int64 and lens.is_contiguous() and lens.numel() == n
    assert row_seq is None or (row_seq.dtype == torch.int64 and row_seq.is_contiguous())
    assert hq % h == 0 and hq // h <= 64
    if scales_layer is not None:
        want = torch.int8 if kv_layer.dtype == torch.int8 else torch.bfloat16
        assert scales_layer.dtype == want and scales_layer.is_contiguous()
    dll.kvs_paged_attention(
        kv_layer.data_ptr(), scales_layer.data_ptr() if scales_layer is not None else None,
        DTYPE_CODES[kv_layer.dtype], q.data_ptr(), block_tables.data_ptr(),
        row_seq.data_ptr() if row_seq is not None else None, lens.data_ptr(), n,
        block_tables.shape[1], bs, h, hq // h, d, sm_scale, torch.get_num_threads(),
        int(force_scalar), out.data_ptr(),
    )
    return out


def write_fp8(x: torch.Tensor, rows: torch.Tensor, dst_rows: torch.Tensor,
              scale_rows: torch.Tensor, static_scales: torch.Tensor | None = None) -> None:
    """Quantize x [T, H, D] (fp32) into dst_rows [R, H, D] (fp8) at ``rows``, with dynamic
    per-row bf16 scales into scale_rows [R, H] (or the given static bf16 scales [H])."""
    dll = load()
    assert dll is not None
    x = x.float().contiguous()
    t, h, d = x.shape
    assert rows.dtype == torch.int64 and rows.is_contiguous()
    assert dst_rows.is_contiguous() and scale_rows.is_contiguous()
    if static_scales is not None:
        static_scales = static_scales.to(torch.bfloat16).contiguous()
    dll.kvs_write_fp8(x.data_ptr(), rows.data_ptr(), t, h, d, DTYPE_CODES[dst_rows.dtype],
                      dst_rows.data_ptr(), scale_rows.data_ptr(),
                      static_scales.data_ptr() if static_scales is not None else None)


def write_int8(x: torch.Tensor, rows: torch.Tensor, dst_rows: torch.Tensor,
               scale_rows: torch.Tensor) -> None:
    """Quantize x [T, H, D] (fp32) into dst_rows [R, H, D] (int8) at ``rows``, symmetric, with
    dynamic per-row 1-byte log-scale codes into scale_rows [R, H] int8 (twin:
    kvserve/quant/int8.py ``quantize_dynamic``)."""
    dll = load()
    assert dll is not None
    x = x.float().contiguous()
    t, h, d = x.shape
    assert rows.dtype == torch.int64 and rows.is_contiguous()
    assert dst_rows.dtype == torch.int8 and dst_rows.is_contiguous()
    assert scale_rows.dtype == torch.int8 and scale_rows.is_contiguous()
    dll.kvs_write_int8(x.data_ptr(), rows.data_ptr(), t, h, d, dst_rows.data_ptr(),
                       scale_rows.data_ptr())


def int8_scale_table() -> torch.Tensor:
    """The kernel's 256 INT8 scales (index code + 128), fp32; tests compare them with
    ``kvserve.quant.int8.SCALE_TABLE``."""
    dll = load()
    assert dll is not None
    out = torch.empty(256, dtype=torch.float32)
    dll.kvs_int8_scale_table(out.data_ptr())
    return out
