"""ctypes bindings of kvserve/csrc/cpu_ops.c: fused small ops of a decoder layer on CPU.

Each returns False / None when it does not apply (no C library, not fp32 on CPU, a layout it
does not take); the caller then runs its torch code, the twin."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.cbuild import build_library
from kvserve.kernels.cpu.graph import Rows, launch
from kvserve.quant.w16 import tiles_of


@functools.cache
def ops_library() -> ctypes.CDLL | None:
    dll = build_library("cpu_ops")
    if dll is None:
        return None
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.kvs_rope_qk.argtypes = [p, i64, i64, i64, i64, i64, p, p, p, c_int, c_int]
    dll.kvs_rope_qk.restype = None
    dll.kvs_silu_mul.argtypes = [p, i64, i64, p, c_int]
    dll.kvs_silu_mul.restype = None
    dll.kvs_add_rms_norm.argtypes = [p, p, p, i64, i64, ctypes.c_float, p, c_int]
    dll.kvs_add_rms_norm.restype = None
    dll.kvs_gather_rows.argtypes = [p, c_int, i64, i64, p, i64, i64, p, i64, i64]
    dll.kvs_gather_rows.restype = c_int
    dll.kvs_gather_q8.argtypes = [p, p, c_int, i64, i64, p, i64, p]
    dll.kvs_gather_q8.restype = c_int
    dll.kvs_rotate_heads.argtypes = [p, i64, i64, i64, i64, p, p, c_int]
    dll.kvs_rotate_heads.restype = None
    dll.kvs_gelu_tanh_mul.argtypes = [p, i64, i64, p, c_int]
    dll.kvs_gelu_tanh_mul.restype = None
    dll.kvs_head_rms_norm.argtypes = [p, i64, i64, i64, i64, p, ctypes.c_float, c_int]
    dll.kvs_head_rms_norm.restype = None
    dll.kvs_scale.argtypes = [p, i64, i64, ctypes.c_float]
    dll.kvs_scale.restype = None
    dll.kvs_concat_cols.argtypes = [p, i64] + [p, i64, i64] * 4
    dll.kvs_concat_cols.restype = None
    return dll

# kvs_gather_rows' table kinds
GATHER_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _fp32_cpu(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


def rope_qk_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             nheads: int, head_dim: int, interleaved: bool) -> bool:
    """Rotate heads [0, nheads) of every row of x (fp32 [T, W], rows contiguous) in place."""
    lib = ops_library()
    if lib is None or not _fp32_cpu(x, cos, sin) or x.dim() != 2 or x.stride(1) != 1 \
            or positions.dtype != torch.int64 or not positions.is_contiguous() \
            or not cos.is_contiguous() or not sin.is_contiguous():
        return False
    assert nheads * head_dim <= x.shape[1] and positions.numel() == x.shape[0]
    launch(lib, "kvs_rope_qk", x, Rows(x.shape[0]), x.stride(0), nheads, head_dim,
           2 * cos.shape[1], positions, cos, sin, int(interleaved), torch.get_num_threads())
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """fp32 [T, 2I] (gate | up, contiguous) -> [T, I] = silu(gate) * up."""
    lib = ops_library()
    if lib is None or not _fp32_cpu(gate_up) or gate_up.dim() != 2 \
            or not gate_up.is_contiguous():
        return None
    t, i2 = gate_up.shape
    out = torch.empty(t, i2 // 2, dtype=torch.float32)
    launch(lib, "kvs_silu_mul", gate_up, Rows(t), i2 // 2, out, torch.get_num_threads())
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """fp32 [T, 2I] (gate | up, contiguous) -> [T, I] = gelu_tanh(gate) * up (GeGLU)."""
    lib = ops_library()
    if lib is None or not _fp32_cpu(gate_up) or gate_up.dim() != 2 \
            or not gate_up.is_contiguous():
        return None
    t, i2 = gate_up.shape
    out = torch.empty(t, i2 // 2, dtype=torch.float32)
    launch(lib, "kvs_gelu_tanh_mul", gate_up, Rows(t), i2 // 2, out, torch.get_num_threads())
    return out


def head_rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`head_rms_norm_` takes x (fp32 [T, W] on CPU, unit column stride)."""
    return ops_library() is not None and _fp32_cpu(x, weight) and x.dim() == 2 \
        and x.stride(1) == 1 and weight.is_contiguous()


def head_rms_norm_(x: torch.Tensor, first: int, nheads: int, head_dim: int,
                   weight: torch.Tensor, eps: float) -> None:
    """Heads [first, first + nheads) of every row of x (fp32 [T, W], see
    ``head_rms_norm_applies``) RMS-normed per head with ``weight`` [head_dim], in place."""
    assert (first + nheads) * head_dim <= x.shape[1] and weight.numel() == head_dim
    launch(ops_library(), "kvs_head_rms_norm", x[:, first * head_dim:], Rows(x.shape[0]),
           x.stride(0), nheads, head_dim, weight, float(eps), torch.get_num_threads())


def scale_(x: torch.Tensor, s: float) -> bool:
    """x (fp32 [T, D] contiguous, CPU) *= s in place; False, nothing done, where the C op
    does not apply."""
    lib = ops_library()
    if lib is None or not _fp32_cpu(x) or x.dim() != 2 or not x.is_contiguous():
        return False
    launch(lib, "kvs_scale", x, Rows(x.shape[0]), x.shape[1], float(s))
    return True


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """residual += x (in place; x None: no add); returns rms_norm(residual) * weight, or None
    (nothing done) if the C op does not apply. fp32 [T, D], contiguous."""
    lib = ops_library()
    ts = (residual, weight) if x is None else (x, residual, weight)
    if lib is None or not _fp32_cpu(*ts) or not all(t.is_contiguous() for t in ts) \
            or residual.dim() != 2:
        return None
    t, d = residual.shape
    out = torch.empty_like(residual)
    launch(lib, "kvs_add_rms_norm", x, residual, weight, Rows(t), d, float(eps), out,
           torch.get_num_threads())
    return out


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """Embedding lookup widened to fp32: table [V, D] (fp32 / bf16 / fp16, rows contiguous, or
    a 16-bit table packed in the GEMM's tiles: kvserve.quant.w16) at ids int64 [T] -> fp32
    [T, D]; None if the C op does not apply. An id outside [0, V) raises IndexError (as
    F.embedding does)."""
    lib = ops_library()
    tiles = tiles_of(table)
    if lib is None or table.dtype not in GATHER_KINDS or table.device.type != "cpu" \
            or table.dim() != 2 or table.stride(1) != 1 or ids.dtype != torch.int64 \
            or ids.dim() != 1 or not ids.is_contiguous() \
            or (tiles is not None and not table.is_contiguous()):
        return None
    rows, dim = (table.shape[0], table.shape[1]) if tiles is None else (tiles.rows, tiles.cols)
    tr, tc = (0, 0) if tiles is None else (tiles.tile_rows, tiles.tile_cols)
    out = torch.empty(ids.shape[0], dim, dtype=torch.float32)
    if launch(lib, "kvs_gather_rows", table, GATHER_KINDS[table.dtype], rows,
              table.stride(0), ids, Rows(ids.shape[0]), dim, out, tr, tc):
        raise IndexError(f"token id out of range for an embedding of {rows} rows")
    return out


def gather_q8(q: torch.Tensor, d: torch.Tensor, tiled: bool, num_rows: int, k: int,
              ids: torch.Tensor) -> torch.Tensor | None:
    """Rows ``ids`` (int64 [T]) of a GGUF Q8_0 table [num_rows, k], dequantized to fp32
    [T, k]: row-major (q int8 [V, K], d fp16 [V, K/32]) or, ``tiled``, the integer-dot tiles
    of kvserve/quant/wq.py (q = codes, d = scales). None if the C op does not apply; an id
    outside [0, V) raises IndexError."""
    lib = ops_library()
    if lib is None or ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous() \
            or not q.is_contiguous() or not d.is_contiguous() or d.dtype != torch.float16:
        return None
    out = torch.empty(ids.shape[0], k, dtype=torch.float32)
    if launch(lib, "kvs_gather_q8", q, d, int(tiled), num_rows, k, ids, Rows(ids.shape[0]),
              out):
        raise IndexError(f"token id out of range for an embedding of {num_rows} rows")
    return out


def rotate_heads(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor | None:
    """x fp32 [T, H, D] (each row's heads contiguous: strides (any, D, 1)) times R fp32 [D, D]
    (contiguous) -> fp32 [T, H, D] contiguous; None if the C op does not apply (the twin:
    ``kvserve.kernels.reference.rotate_heads``)."""
    lib = ops_library()
    if lib is None or not _fp32_cpu(x, r) or x.dim() != 3 or not r.is_contiguous():
        return None
    t, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or r.shape != (d, d):
        return None
    out = torch.empty(t, h, d, dtype=torch.float32)
    launch(lib, "kvs_rotate_heads", x, Rows(t), x.stride(0), h, d, r, out,
           torch.get_num_threads())
    return out


def concat_cols(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """fp32 parts [T, n_i] (rows may be strided; columns contiguous), at most 4 -> fp32
    [T, sum n_i] side by side; None if the C op does not apply (the twin: ``torch.cat(parts,
    -1)``)."""
    lib = ops_library()
    if lib is None or not 1 <= len(parts) <= 4 or not _fp32_cpu(*parts) \
            or any(p.dim() != 2 or p.stride(1) != 1 for p in parts) \
            or len({p.shape[0] for p in parts}) != 1:
        return None
    t = parts[0].shape[0]
    out = torch.empty(t, sum(p.shape[1] for p in parts), dtype=torch.float32)
    args: list = []
    for i in range(4):
        p = parts[i] if i < len(parts) else None
        args += [p, p.stride(0), p.shape[1]] if p is not None else [None, 0, 0]
    launch(lib, "kvs_concat_cols", out, Rows(t), *args)
    return out
