"""Loader for the C decode-attention kernel (``kvserve/csrc/paged_attention.c``).

Compiled on first use with the system C compiler (``cc -O3 -march=native -fopenmp``, ~1 s, no
torch headers) into ``~/.cache/kvserve``, called through ctypes on raw tensor pointers. If no
compiler is available, or ``KVSERVE_CPU_KERNEL=0``, ``load()`` returns None and the torch
backend uses its pure-torch path (the kernel's twin).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache

import torch

logger = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc", "paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11",
          "-ffp-contract=fast", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-lm"]
DTYPE_CODES = {
    torch.float32: 0, torch.bfloat16: 1, torch.float16: 2,
    torch.float8_e4m3fn: 3, torch.float8_e5m2: 4,
}


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    if os.environ.get("KVSERVE_CPU_KERNEL", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        logger.info("no C compiler: using the pure-torch decode attention")
        return None
    with open(_SRC, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode()).hexdigest()[:16]
    cache = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")),
                         "kvserve")
    lib = os.path.join(cache, f"paged_attention_{key}.so")
    if not os.path.isfile(lib):
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([cc, _SRC, "-o", tmp, *_FLAGS], check=True, capture_output=True)
            os.replace(tmp, lib)
        except (OSError, subprocess.CalledProcessError) as e:
            err = getattr(e, "stderr", b"") or b""
            logger.warning("C kernel build failed (%s); using pure torch", err.decode()[-500:])
            if os.path.exists(tmp):
                os.remove(tmp)
            return None
    dll = ctypes.CDLL(lib)
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
