"""Loader for the C decode-attention kernel (``kvserve/csrc/paged_attention.c``).

Compiled on first use by ``kvserve.cbuild`` (system C compiler, no torch headers), called
through ctypes on raw tensor pointers. If no compiler is available, or ``KVSERVE_CPU_KERNEL=0``,
``load()`` returns None and the torch backend uses its pure-torch path (the kernel's twin).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kvserve.cbuild import build_library

DTYPE_CODES = {
    torch.float32: 0, torch.bfloat16: 1, torch.float16: 2,
    torch.float8_e4m3fn: 3, torch.float8_e5m2: 4,
}


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    dll = build_library("paged_attention")
    if dll is None:
        return None
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    dll.kvs_paged_decode.argtypes = [p, p, i, p, p, p, i, i, i, i, i, i, f, i, p]
    dll.kvs_paged_decode.restype = None
    dll.kvs_write_fp8.argtypes = [p, p, i, i, i, i, p, p, p]
    dll.kvs_write_fp8.restype = None
    return dll


def paged_decode(kv_layer: torch.Tensor, scales_layer: torch.Tensor | None, q: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                 out: torch.Tensor) -> torch.Tensor:
    """kv_layer [NB+1, 2, bs, H, D]; q [n, H*G, D] fp32 contiguous; block_tables [n, mb] int64;
    seq_lens [n] int64; out [n, H*G, D] fp32 (written)."""
    dll = load()
    assert dll is not None
    _, _, bs, h, d = kv_layer.shape
    n, hq, _ = q.shape
    assert q.is_contiguous() and q.dtype == torch.float32 and out.is_contiguous()
    assert block_tables.dtype == torch.int64 and block_tables.is_contiguous()
    assert hq % h == 0 and hq // h <= 64
    dll.kvs_paged_decode(
        kv_layer.data_ptr(), scales_layer.data_ptr() if scales_layer is not None else None,
        DTYPE_CODES[kv_layer.dtype], q.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), n, block_tables.shape[1], bs, h, hq // h, d, sm_scale,
        torch.get_num_threads(), out.data_ptr(),
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
