"""How an INT4 layer computes (vLLM's ``LinearMethod`` idea): one method object per layer,
chosen once when the layer is built (CPU) or repacked for a GPU kernel, holding its layout's
buffers (``kvserve.layers.int4.layouts``) and the kernel calls. ``Int4Linear`` itself only
permutes columns, adds the bias and reshapes.

Every method maps x2 [m, K] (columns already permuted, m >= 1) to [m, N] in x2's dtype
(``matmul``) and gives the fp32 [N, K] weight it computes with, in stored column order
(``dequantize``), and its weight as unsigned nibbles for a repack (``canonical``).

CPU (Zen2/3 AVX2, 1 thread, K = N = 4096, group 128, median ms, quiet host)::

    M     dense bf16  dense fp32  C kernel (fp32 x)  int4 op (bf16)  dequant->fp32 GEMM
    1     3.2         2.2         0.75               2.35            ~25
    32    -           -           15.3               24.5            36.6
    64    196         37          30.6               49.4            48.0
    128   -           -           61.4               99.2            73.6

* ``WqMethod`` -- GGUF Q4_0 / Q4_1 (min form) with ``act_terms`` 1 or 2: integer-dot tiles
  (kvserve.quant.wq); every M runs kvserve/csrc/wq_gemm.c (activations quantized per 32
  columns to one or two int8 terms, as llama.cpp does), or its torch twin without the library.
* ``CpuPackMethod`` -- the bytes of torch's CPU int4 op (group a multiple of 32):
  M <= ``gemv_max_m`` (default 64, decode): the C kernel kvserve/csrc/int4_gemv.c on the same
  bytes with fp32 activations (zero point folded per group via sum(x); ~3x the op at M = 1,
  exact to fp32 rounding against the twin); M < ``dequant_min_m`` (default 96, the op/dequant
  crossover): ``aten._weight_int4pack_mm_for_cpu`` in bf16 (fp16 / fp32 activations cast for
  it); above: the bytes dequantized to fp32 in ~4 MiB row chunks (C, or torch) and an fp32
  GEMM. GGUF min-form layers with fp32 activations skip the bf16 op (GEMV up to 24 rows).
* ``CanonicalMethod`` -- anything else (group not a multiple of 32, irregular act-order
  groups, no CPU op): the compressed-tensors pack, chunked dequantize -> fp32 GEMM for all M.

GPU (``Int4Linear.to_device_layout``; ``EngineArgs.int4_cuda_kernel``): ``TritonMethod``
(kvserve/kernels/triton/int4.py; on CPU under TRITON_INTERPRET=1, else the twin
kernels.reference.int4_matmul), ``TinygemmMethod`` (torch's CUDA ``_weight_int4pack_mm``, bf16
activations, sm80+), ``DenseMethod`` (irregular act-order groups: a plain fp32 matmul).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import int4_gemv as int4_cpu
from kvserve.kernels.cpu import wq_gemm as wq_cpu
from kvserve.kernels.triton import interpreting
from kvserve.layers.int4 import layouts
from kvserve.quant import int4, wq
from kvserve.quant.int4 import Int4Weight

DEQUANT_MIN_M = 96  # rows of x from which dequant -> fp32 GEMM beats the int4 op (measured)
GEMV_MAX_M = 64  # rows of x up to which the C kernel (kvserve/csrc/int4_gemv.c) is fastest
# GGUF min-form layers skip the bf16 op (fp32 activations throughout): past this many rows the
# C dequantize (kvs_int4_dequant_t, ~1.5 ns per weight on one thread) + fp32 GEMM beats the GEMV,
# which is compute-bound (~0.07 ms per row of x at SmolLM2's 1536 x 576, AVX-512 Xeon, vs
# ~0.01-0.02 ms per row for the fp32 GEMM): crossover ~24 rows (GEMV 1.1 / 2.2 ms vs 1.7 / 1.8
# at 16 / 32 rows).
MIN_FORM_GEMV_MAX_M = 24
_CHUNK_BYTES = 4 << 20  # fp32 weight rows dequantized per GEMM call in the dequant path

# (u uint8 [N, K] or None (irregular groups), scales fp32 [N, G], zp [N, G] or None, group)
Canonical = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, int]


class Int4Method(nn.Module):
    """A layer's layout + kernels. ``n``, ``k``: the layer's out / in features."""

    device_kernel: ClassVar[str | None] = None  # None: a CPU layout
    path: ClassVar[str]

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.n, self.k = n, k

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def canonical(self) -> Canonical:
        raise NotImplementedError

    def finish(self) -> None:
        """After a move to the device: layout work only the device can do."""


def select_cpu_method(w: Int4Weight, *, act_terms: int = 0, dequant_min_m: int = DEQUANT_MIN_M,
                      gemv_max_m: int | None = None) -> Int4Method:
    """The CPU method for w (columns already in stored order), chosen once."""
    if act_terms not in (0, 1, 2):
        raise ValueError(f"act_terms must be 0 (fp32), 1 or 2, got {act_terms}")
    if dequant_min_m < 1:
        raise ValueError(f"dequant_min_m must be >= 1, got {dequant_min_m}")
    if gemv_max_m is None:  # min form: no bf16 op in between, the C dequant GEMM next
        gemv_max_m = MIN_FORM_GEMV_MAX_M if w.mins is not None else GEMV_MAX_M
    if gemv_max_m < 0:
        raise ValueError(f"gemv_max_m must be >= 0 (0: never the C kernel), got {gemv_max_m}")
    if act_terms and layouts.wq_form_ok(w):
        return WqMethod(w, act_terms)
    layout, group = layouts.int4pack_layout(), layouts.op_group(w)
    if layout is not None and group is not None and w.g_idx is None:
        return CpuPackMethod(w, layout, group, dequant_min_m, gemv_max_m)
    return CanonicalMethod(w)


class WqMethod(Int4Method):
    """GGUF min form on CPU: integer-dot tiles (kvserve.quant.wq) and nothing else."""

    path = "w4a8"

    def __init__(self, w: Int4Weight, act_terms: int) -> None:
        super().__init__(w.out_features, w.in_features)
        self.group, self.act_terms = w.group_size, act_terms
        codes, sm, self.n_pad = layouts.pack_wq(w)
        self.register_buffer("wq_codes", codes, persistent=False)
        self.register_buffer("wq_sm", sm, persistent=False)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u uint8 [N, K], s fp16 [N, G], m fp16 [N, G]) (unpadded)."""
        u = wq.unpack_codes(self.wq_codes, self.n_pad, self.k, 4)[: self.n]
        s, m = wq.unpack_scales(self.wq_sm)
        return u, s[: self.n], m[: self.n]

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """int8 activations x integer-dot tiles (kvserve/csrc/wq_gemm.c), or the same
        arithmetic in torch without the C library."""
        xf = x2.float().contiguous()
        lib = wq_cpu.wq_library() if xf.device.type == "cpu" else None
        if lib is not None:
            y = wq_cpu.wq_linear(lib, xf, self.wq_codes, self.wq_sm, self.n_pad, self.group, 4,
                                 self.act_terms)
            return (y if self.n_pad == self.n else y[:, : self.n]).to(x2.dtype)
        u, s, m = self.parts()
        y = ref.wq_fake_quant_act(xf, self.act_terms) @ ref.wq_dequantize(u, s, m, self.group).t()
        return y.to(x2.dtype)

    def dequantize(self) -> torch.Tensor:
        u, s, m = self.parts()
        return ref.wq_dequantize(u, s, m, self.group)

    def canonical(self) -> Canonical:
        u, s, m = self.parts()
        return u, s.float(), layouts.min_form_zero_points(s.float(), m), self.group


class _ChunkedDequant(Int4Method):
    """The dequantize -> fp32 GEMM path over row chunks of W^T (``rows_t``)."""

    n_pad: int
    k_pad: int
    block_n: int = 1  # chunks are whole row blocks of the layout

    def rows_t(self, r0: int, r1: int) -> torch.Tensor:
        """fp32 [k_pad, r1 - r0]: W^T of stored rows [r0, r1)."""
        raise NotImplementedError

    def row_chunks(self) -> list[tuple[int, int]]:
        rows = max(self.block_n, (_CHUNK_BYTES // (4 * self.k_pad)) // self.block_n
                   * self.block_n)
        return [(r, min(r + rows, self.n_pad)) for r in range(0, self.n_pad, rows)]

    def dequant_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        xf = _pad_k(x2.float(), self.k_pad)
        y = torch.empty(x2.shape[0], self.n_pad, dtype=torch.float32)
        for r0, r1 in self.row_chunks():
            y[:, r0:r1] = xf @ self.rows_t(r0, r1)
        return y[:, : self.n].to(x2.dtype) if self.n_pad != self.n else y.to(x2.dtype)

    def dequantize(self) -> torch.Tensor:
        # clone: the C path returns a reused workspace
        w_t = torch.cat([self.rows_t(r0, r1).clone() for r0, r1 in self.row_chunks()], 1)
        return w_t.t()[: self.n, : self.k].contiguous()


class CpuPackMethod(_ChunkedDequant):
    """The bytes of torch's CPU int4 op: C GEMV / the op / C (or torch) dequant + GEMM."""

    path = "int4-op"

    def __init__(self, w: Int4Weight, layout: tuple[int, str], group: int, dequant_min_m: int,
                 gemv_max_m: int) -> None:
        super().__init__(w.out_features, w.in_features)
        self.block_n, self.mode = layout
        self.op_group, self.group_size = group, w.group_size
        self.symmetric = w.symmetric
        # GGUF Q4_0 / Q4_1 "min" form (w = u * s + m): (s, m) held in fp16, exactly as stored
        self.min_form = w.mins is not None
        self.dequant_min_m, self.gemv_max_m = dequant_min_m, gemv_max_m
        self.k_pad = layouts.ceil_to(self.k, w.group_size if w.n_groups > 1 else group)
        self.n_pad = layouts.ceil_to(self.n, self.block_n)
        packed, sz = layouts.pack_for_op(w, group, self.k_pad, self.n_pad)
        self.register_buffer("packed", packed, persistent=False)  # uint8 [n_pad, k_pad/2]
        # [k_pad/G', n_pad, 2]: bf16 (s, z), w = (u - 8) s + z; min form fp16 (s, m): u s + m
        self.register_buffer("scales_zeros", sz, persistent=False)

    def _pairs(self, dtype: torch.dtype) -> torch.Tensor:
        sz = self.scales_zeros
        return sz if sz.dtype == dtype else sz.to(dtype)  # a module-wide .to(dtype) cast it

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        m = x2.shape[0]
        if m <= self.gemv_max_m and gemv_lib() is not None:
            return self.gemv(x2)
        if m < self.dequant_min_m and not self.min_form:
            return self.op(x2)  # bf16 activations: min-form (GGUF) layers keep fp32
        return self.dequant_matmul(x2)

    def gemv(self, x2: torch.Tensor) -> torch.Tensor:
        """C/AVX2 skinny GEMM on the op's packed bytes, fp32 activations."""
        assert self.packed.is_contiguous()
        xf = _pad_k(x2.float(), self.k_pad).contiguous()
        want = torch.float16 if self.min_form else torch.bfloat16
        y = int4_cpu.gemv(gemv_lib(), self.packed, self._pairs(want), xf, self.op_group,
                          self.block_n, self.min_form)
        return (y if self.n_pad == self.n else y[:, : self.n]).to(x2.dtype)

    def op(self, x2: torch.Tensor) -> torch.Tensor:
        """tinygemm int4 op in bf16."""
        xb = _pad_k(x2.to(torch.bfloat16), self.k_pad)
        sz = self.scales_zeros
        if self.min_form:  # the op's form w = (u - 8) s + z: z = m + 8 s, rounded to bf16
            sf = sz.float()
            sz = torch.stack((sf[..., 0], sf[..., 1] + 8.0 * sf[..., 0]), -1)
        if sz.dtype != torch.bfloat16:  # a module-wide .to(dtype) cast it
            sz = sz.bfloat16()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), self.packed,
                                                       self.op_group, sz)
        return (y if self.n_pad == self.n else y[:, : self.n]).to(x2.dtype)

    def rows_t(self, r0: int, r1: int) -> torch.Tensor:
        rows, g = r1 - r0, self.op_group
        lib = gemv_lib()
        if lib is not None and self.scales_zeros.dtype == (
                torch.float16 if self.min_form else torch.bfloat16):
            # the C twin of the torch code below, bit for bit (a workspace view: consumed by
            # the caller's GEMM before the next call)
            out = _workspace(self.k_pad * rows).view(self.k_pad, rows)
            return int4_cpu.dequant_t(lib, self.packed, self.scales_zeros, self.k_pad, g,
                                      self.block_n, self.min_form, r0, r1, out)
        ng = self.k_pad // g
        # nibbles as [k_pad, rows] (uint8): column c is stored row r0 + c
        u = layouts.unpack_blocks(self.packed, self.n_pad, self.k_pad, self.block_n, self.mode,
                                  r0 // self.block_n, r1 // self.block_n, k_major=True)
        sz = self.scales_zeros[:, r0:r1].float()  # [ng, rows, 2]
        s, z = sz[..., 0].unsqueeze(1), sz[..., 1].unsqueeze(1)  # [ng, 1, rows]
        w = torch.mul(u.view(ng, g, rows), s)  # uint8 * fp32 -> fp32, one pass
        w.add_(z if self.min_form else z - int4.OFFSET * s)  # u s + m  or  (u - 8) s + z
        return w.view(self.k_pad, rows)

    def canonical(self) -> Canonical:
        """The op's nibbles exactly, its pairs per op group (the zero point recovered as the
        integer round(8 - zero / scale))."""
        u = layouts.unpack_blocks(self.packed, self.n_pad, self.k_pad, self.block_n, self.mode,
                                  0, self.n_pad // self.block_n, k_major=True)  # [k_pad, n_pad]
        u = u.t()[: self.n, : self.k].contiguous()
        sz = self.scales_zeros.float()[:, : self.n]  # [k_pad / g, n, 2]
        s, z = sz[..., 0].t().contiguous(), sz[..., 1].t()  # [n, G']
        if self.min_form:  # w = u s + m = (u - zp) s with a fractional zp = -m / s
            return u, s, layouts.min_form_zero_points(s, z), self.op_group
        zp = None
        if not self.symmetric:
            safe = torch.where(s == 0, torch.ones_like(s), s)
            zp = torch.where(s == 0, torch.full_like(s, float(int4.OFFSET)),
                             (int4.OFFSET - z / safe).round()).to(torch.int16)
        return u, s, zp, self.op_group


class CanonicalMethod(_ChunkedDequant):
    """The compressed-tensors pack (int32 [n, ceil(k/8)] + scales, zeros / mins, group index),
    chunked dequantize -> fp32 GEMM for every M."""

    path = "dequant"

    def __init__(self, w: Int4Weight) -> None:
        super().__init__(w.out_features, w.in_features)
        self.n_pad, self.k_pad, self.group = self.n, self.k, w.group_size
        self.register_buffer("ct_packed", int4.pack_int4(w.values, 1), persistent=False)
        self.register_buffer("ct_scales", w.scales.float().contiguous(), persistent=False)
        self.register_buffer("ct_zeros", w.zeros, persistent=False)
        self.register_buffer("ct_mins", None if w.mins is None else w.mins.float().contiguous(),
                             persistent=False)
        self.register_buffer("ct_group_index", w.group_index(), persistent=False)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return self.dequant_matmul(x2)

    def rows_t(self, r0: int, r1: int) -> torch.Tensor:
        v = int4.unpack_nibbles(self.ct_packed[r0:r1], self.k, 1).float()
        gi = self.ct_group_index
        if self.ct_mins is not None:  # fl(fl(u * s) + m), as int4.dequantize
            return (v * self.ct_scales[r0:r1][:, gi] + self.ct_mins[r0:r1][:, gi]).t()
        v -= int4.OFFSET
        if self.ct_zeros is not None:
            v -= self.ct_zeros[r0:r1].float()[:, gi]
        return (v * self.ct_scales[r0:r1][:, gi]).t()

    def canonical(self) -> Canonical:
        gi, group = self.ct_group_index, self.group
        if not torch.equal(gi, torch.arange(self.k, device=gi.device) // group):
            return None, self.ct_scales, None, group
        u = int4.unpack_nibbles(self.ct_packed, self.k, 1).to(torch.uint8)  # unsigned nibbles
        s = self.ct_scales.float()
        if self.ct_mins is not None:
            return u, s, layouts.min_form_zero_points(s, self.ct_mins), group
        zp = None if self.ct_zeros is None else self.ct_zeros.to(torch.int16) + int4.OFFSET
        return u, s, zp, group


# --------------------------------------------------------------------------------- GPU


class TritonMethod(Int4Method):
    """kvserve/kernels/triton/int4.py on the compressed-tensors layout (see
    ``layouts.pack_triton``); a CPU module runs the twin (or the interpreter)."""

    device_kernel = "triton"
    path = "triton"

    def __init__(self, n: int, k: int, c: Canonical) -> None:
        super().__init__(n, k)
        u, scales, zp, self.dev_group = c
        assert u is not None
        packed, scales, zeros = layouts.pack_triton(u, scales, zp)
        self.register_buffer("dev_packed", packed, persistent=False)
        self.register_buffer("dev_scales", scales, persistent=False)
        self.register_buffer("dev_zeros", zeros, persistent=False)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.is_cuda or interpreting():
            from kvserve.kernels.triton import int4 as triton_int4

            mm = triton_int4.int4_matmul
        else:
            mm = ref.int4_matmul  # the twin: a CPU module holding the GPU layout
        return mm(x2.contiguous(), self.dev_packed, self.dev_scales, self.dev_zeros,
                  self.dev_group)

    def dequantize(self) -> torch.Tensor:
        return ref.dequantize_int4(self.dev_packed, self.dev_scales, self.dev_zeros,
                                   self.dev_group, k=self.k)


class TinygemmMethod(Int4Method):
    """torch's CUDA ``_weight_int4pack_mm`` (bf16 activations): dev_u8 / dev_sz from
    ``layouts.pack_tinygemm``; ``finish`` on CUDA turns dev_u8 into the op's int32
    tiles (dev_packed)."""

    device_kernel = "tinygemm"
    path = "tinygemm"

    def __init__(self, n: int, k: int, c: Canonical) -> None:
        super().__init__(n, k)
        u, scales, zp, self.dev_group = c
        assert u is not None
        u8, sz = layouts.pack_tinygemm(u, scales, zp, self.dev_group)
        self.register_buffer("dev_u8", u8, persistent=False)
        self.register_buffer("dev_sz", sz, persistent=False)
        self.register_buffer("dev_packed", None, persistent=False)

    def finish(self) -> None:
        if self.dev_u8 is None or not self.dev_u8.is_cuda:
            return
        k_pad = self.dev_u8.shape[1] * 2
        tiles = next(t for t in (8, 4, 2) if k_pad % (16 * t) == 0)
        packed = torch.ops.aten._convert_weight_to_int4pack(self.dev_u8, tiles)
        self.register_buffer("dev_packed", packed, persistent=False)
        self.register_buffer("dev_u8", None, persistent=False)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        k_pad = self.dev_sz.shape[0] * self.dev_group
        xb = _pad_k(x2.to(torch.bfloat16), k_pad)
        y = torch.ops.aten._weight_int4pack_mm(xb.contiguous(), self.dev_packed,
                                               self.dev_group, self.dev_sz.bfloat16())
        return y[:, : self.n].to(x2.dtype)

    def dequantize(self) -> torch.Tensor:
        k_pad = self.dev_sz.shape[0] * self.dev_group
        eye = torch.eye(k_pad, dtype=torch.bfloat16, device=self.dev_sz.device)
        w = self.matmul(eye[:, : self.k]).float().t()  # [N, k_pad]
        return w[:, : self.k].contiguous()  # bf16-rounded products: what the op computes


class DenseMethod(Int4Method):
    """Act-order groups that are not contiguous (no kernel takes them): fp32 [N, K] in the
    original column order (the layer drops its permutation), a plain matmul."""

    device_kernel = "dense"
    path = "dense"

    def __init__(self, dense: torch.Tensor) -> None:
        super().__init__(*dense.shape)
        self.register_buffer("dev_dense", dense.contiguous(), persistent=False)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return (x2.float() @ self.dev_dense.t().float()).to(x2.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.dev_dense.float().clone()


def gpu_method(kernel: str, n: int, k: int, c: Canonical,
               dense: Callable[[], torch.Tensor]) -> Int4Method:
    """The GPU method for ``kernel`` over a CPU method's canonical weight ``c``; ``dense``
    gives the fp32 weight in original column order (irregular groups: no kernel takes
    them). tinygemm falls back to triton for groups its op does not take."""
    if kernel not in layouts.CUDA_KERNELS:
        raise ValueError(f"kernel must be one of {layouts.CUDA_KERNELS}, got {kernel!r}")
    if c[0] is None or kernel == "dense":
        return DenseMethod(dense())
    if kernel == "tinygemm" and layouts.tinygemm_ok(c[3]):
        return TinygemmMethod(n, k, c)
    return TritonMethod(n, k, c)


# --------------------------------------------------------------------------------- helpers

_WORKSPACE = threading.local()


def _workspace(numel: int) -> torch.Tensor:
    """A reusable fp32 buffer per thread for dequantized weight tiles: a fresh 4 MiB tensor
    per call page-faults (~1.5 ms, as much as the dequantize itself)."""
    buf = getattr(_WORKSPACE, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _WORKSPACE.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


def _pad_k(x: torch.Tensor, k_pad: int) -> torch.Tensor:
    """x [m, K] zero-padded to [m, k_pad]."""
    return x if x.shape[1] == k_pad else F.pad(x, (0, k_pad - x.shape[1]))


@functools.cache
def gemv_lib() -> ctypes.CDLL | None:
    """The C int4 GEMV, if it builds and this CPU's int4pack layout is one it reads."""
    layout = layouts.int4pack_layout()
    if layout is None or layout[1] != "halves" or layout[0] not in (32, 64):
        return None
    return int4_cpu.load()
