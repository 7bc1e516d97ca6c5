"""INT4 weight-only linear layer (W4A16) for CPU, and CUDA via ``to_device_layout``.

On CUDA (``.to("cuda")``; the loader moves INT4 modules for ``--device cuda``) the layer is
repacked once for the Triton W4A16 kernel (kvserve/kernels/triton/int4.py) or torch's CUDA
tinygemm (``$KVSERVE_INT4_CUDA_KERNEL=tinygemm``); see "GPU layouts" below.

Building (packing happens once, here; the layer is immutable afterwards)::

    Int4Linear.from_compressed_tensors(weight_packed, weight_scale, weight_shape,
                                       weight_zero_point=None, group_size=None, bias=None)
    Int4Linear.from_gptq(qweight, qzeros, scales, g_idx=None, *, group_size, sym=True,
                         checkpoint_format="gptq", bias=None)     # "gptq" (v1) or "gptq_v2"
    Int4Linear.from_dense(weight, group_size=128, symmetric=True, bias=None)
    Int4Linear(int4_weight, bias=None)          # any kvserve.quant.int4.Int4Weight
    int4_experts_from_dense(w[E, out, in], ...) # MoE: an nn.ModuleList of E Int4Linear

Fused projections (q/k/v, gate/up): build each part's Int4Weight and pass
``kvserve.quant.int4.concat_out(parts)`` to the constructor.

``forward(x[..., in])`` -> ``[..., out]`` in x's dtype (bf16, fp16 or fp32). ``dequantize()``
returns the dense fp32 [out, in] weight the layer computes with (the twin);
``weight_bytes()`` the bytes held. Buffers are non-persistent: the packed layout is specific to
this CPU and process, so rebuild from the checkpoint tensors instead of saving a state_dict.

Compute paths (Zen2/3 AVX2, 1 thread, K = N = 4096, group 128, median ms, quiet host)::

    M     dense bf16  dense fp32  C kernel (fp32 x)  int4 op (bf16)  dequant->fp32 GEMM
    1     3.2         2.2         0.75               2.35            ~25
    32    -           -           15.3               24.5            36.6
    64    196         37          30.6               49.4            48.0
    128   -           -           61.4               99.2            73.6

* GGUF Q4_0 / Q4_1 ("min form", w = u s + m) with ``act_terms`` 1 or 2 (the engine's
  ``gguf_activations`` int8 / int8x2, default int8x2): the layer holds only integer-dot tiles
  (kvserve.quant.wq) and every M runs kvserve/csrc/wq_gemm.c -- activations quantized per 32
  columns to one or two int8 terms, AVX-512 VNNI / AVX2 / plain-C integer dot products, as
  llama.cpp does. ``act_terms`` 0 (fp32) keeps the paths below.
* M <= ``gemv_max_m`` (default 64; decode): the C kernel
  ``kvserve/csrc/int4_gemv.c`` (``kvserve.cbuild``) on the *same* packed bytes and bf16 (scale,
  zero) pairs, with fp32 activations: nibbles are masked in place and widened with one convert
  per 8 weights, the zero point folded per group via sum(x); rows of x in pairs. ~3x the op
  at M = 1, ~1.6x at M = 32-64, exact to fp32 rounding against the twin
  (tests/quant/test_int4_gemv.py). Without it (no compiler, a pack layout it does not read)
  the op below takes these rows.
* M < ``dequant_min_m`` (default 96, the op/dequant crossover: ~64 on a quiet host, ~128 on a loaded
  one): ``aten._weight_int4pack_mm_for_cpu`` (tinygemm). It computes w = (u - 8) * scale + zero with
  u the unsigned nibble and (scale, zero) in x's dtype; bf16 is its only fast dtype here (fp32 runs
  a scalar loop, ~14x slower), so fp16 / fp32 activations are cast to bf16 for it and the result
  cast back. Its constraints: N % 16 == 0, K % group == 0, group in {32, 64, 128, 256}: N is padded
  to the op's row block (extra rows sliced off), K to a whole number of groups (x is zero-padded at
  runtime), larger groups that are multiples of 32 (and channel-wise) are split into op groups with
  repeated scales. (scale, zero) are held in bf16: fp16/fp32 checkpoint scales lose <0.4% relative
  precision, far below the int4 rounding error.
* M >= ``dequant_min_m`` (prefill): the same packed bytes are unpacked to fp32 in row chunks
  (~4 MiB each, cache-resident) and fed to an fp32 GEMM. dense bf16 GEMM is never used: without
  AVX512-BF16 it is ~5x slower than fp32 on this CPU.
* Twin / fallback: if the op is missing, the group size is not a multiple of 32, or act-order
  groups are irregular, the layer keeps the canonical pack (compressed-tensors layout) and
  computes chunked dequantize -> fp32 GEMM for every M.

GPTQ act-order (g_idx): input columns are permuted once so each group is contiguous (as vLLM's
Marlin does) and x is permuted with ``index_select`` per call.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.cpu import int4_gemv as int4_cpu
from kvserve.kernels.cpu import wq_gemm as wq_cpu
from kvserve.kernels.triton import interpreting
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
_OP_GROUPS = (256, 128, 64, 32)  # group sizes the CPU int4 op accepts
_CHUNK_BYTES = 4 << 20  # fp32 weight rows dequantized per GEMM call in the dequant path


@functools.cache
def int4pack_layout() -> tuple[int, str] | None:
    """How ``_convert_weight_to_int4pack_for_cpu`` lays out [N, K] nibbles on this CPU.

    Returns (block_n, mode): bytes view as [N / block_n, K, block_n / 2]; mode "halves": low
    nibbles are rows 0..block_n/2-1 of the block, high nibbles the rest (AVX2: 32, AVX512: 64);
    "pairs": byte j holds rows 2j (low) and 2j+1 (high) (scalar build). Found by packing a
    probe and checking each candidate; None if the op is missing or nothing matches.
    """
    op = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if op is None or getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None) is None:
        return None
    g = torch.Generator().manual_seed(0)
    n, k = 128, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    try:
        packed = op(q, 2)
    except RuntimeError:
        return None
    for block_n in (64, 32, 16):
        for mode in ("halves", "pairs"):
            try:
                got = _unpack_blocks(packed, n, k, block_n, mode, 0, n // block_n)
            except RuntimeError:
                continue
            if torch.equal(got.permute(0, 2, 1).reshape(n, k).int(), q):
                return block_n, mode
    return None


def _unpack_blocks(packed: torch.Tensor, n: int, k: int, block_n: int, mode: str, b0: int,
                   b1: int, k_major: bool = False) -> torch.Tensor:
    """uint8 nibbles of row blocks [b0, b1): [b1 - b0, K, block_n] (W^T per block), or with
    ``k_major`` [K, (b1 - b0) * block_n] (W^T of those rows, contiguous)."""
    blk = packed.view(n // block_n, k, block_n // 2)[b0:b1]  # [nb, K, block_n / 2]
    if k_major:
        blk = blk.permute(1, 0, 2)  # [K, nb, block_n / 2]; the cat/stack below copies
    lo, hi = blk & 15, blk >> 4
    u = torch.cat((lo, hi), -1) if mode == "halves" else torch.stack((lo, hi), -1)
    return u.reshape(k, -1) if k_major else u.view(b1 - b0, k, block_n)


class Int4Linear(nn.Module):
    """y = x W^T + b with W held as 4-bit groups (see module docstring)."""

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None = None,
        *,
        dequant_min_m: int = DEQUANT_MIN_M,
        gemv_max_m: int | None = None,
        act_terms: int = 0,
    ) -> None:
        super().__init__()
        n, k = weight.out_features, weight.in_features
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias must be [out={n}], got {tuple(bias.shape)}")
        if dequant_min_m < 1:
            raise ValueError(f"dequant_min_m must be >= 1, got {dequant_min_m}")
        if gemv_max_m is None:  # min form: no bf16 op in between, the C dequant GEMM next
            gemv_max_m = MIN_FORM_GEMV_MAX_M if weight.mins is not None else GEMV_MAX_M
        if gemv_max_m < 0:
            raise ValueError(f"gemv_max_m must be >= 0 (0: never the C kernel), got {gemv_max_m}")
        self.in_features, self.out_features = k, n
        self.group_size = weight.group_size
        self.symmetric = weight.symmetric
        # GGUF Q4_0 / Q4_1 "min" form (w = u * s + m): (s, m) held in fp16, exactly as stored
        self.min_form = weight.mins is not None
        self.dequant_min_m = dequant_min_m
        self.gemv_max_m = gemv_max_m
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None,
                             persistent=False)

        # 1. act-order: sort columns so groups are contiguous and regular
        perm: torch.Tensor | None = None
        if weight.g_idx is not None:
            gi = weight.g_idx.long()
            perm = torch.argsort(gi, stable=True)
            if torch.equal(gi[perm], torch.arange(k) // weight.group_size) and \
                    weight.n_groups == math.ceil(k / weight.group_size):
                weight = Int4Weight(weight.values[:, perm].contiguous(), weight.scales,
                                    weight.zeros, weight.group_size, None, weight.mins)
            else:
                perm = None  # irregular groups: canonical path with g_idx
        self.register_buffer("perm", perm, persistent=False)
        for name in ("wq_codes", "wq_sm"):
            self.register_buffer(name, None, persistent=False)
        if act_terms not in (0, 1, 2):
            raise ValueError(f"act_terms must be 0 (fp32), 1 or 2, got {act_terms}")
        self.act_terms = act_terms if self.min_form and perm is None and _wq_form_ok(weight) \
            else 0
        if self.act_terms:
            self._init_wq(weight)
            return

        # 2. fast-op grouping: op group G' divides the group (or anything, channel-wise)
        layout = int4pack_layout()
        op_group = self._op_group(weight)
        self.fast = layout is not None and op_group is not None and weight.g_idx is None
        self._layout = layout
        if self.fast:
            assert layout is not None and op_group is not None
            block_n = layout[0]
            self.op_group = op_group
            self.k_pad = _ceil_to(k, weight.group_size if weight.n_groups > 1 else op_group)
            self.n_pad = _ceil_to(n, block_n)
            packed, sz = self._pack_for_op(weight, op_group, self.k_pad, self.n_pad)
            self.register_buffer("packed", packed, persistent=False)  # uint8 [n_pad, k_pad/2]
            # [k_pad/G', n_pad, 2]: bf16 (s, z), w = (u - 8) s + z; min form fp16 (s, m): u s + m
            self.register_buffer("scales_zeros", sz, persistent=False)
            for name in ("ct_packed", "ct_scales", "ct_zeros", "ct_mins", "ct_group_index"):
                self.register_buffer(name, None, persistent=False)
        else:
            self.op_group = 0
            self.k_pad, self.n_pad = k, n
            self.register_buffer("packed", None, persistent=False)
            self.register_buffer("scales_zeros", None, persistent=False)
            # canonical compressed-tensors pack: int32 [n, ceil(k/8)] + scales (+ zeros, g_idx)
            self.register_buffer("ct_packed", int4.pack_int4(weight.values, 1), persistent=False)
            self.register_buffer("ct_scales", weight.scales.float().contiguous(),
                                 persistent=False)
            self.register_buffer("ct_zeros", weight.zeros, persistent=False)
            self.register_buffer("ct_mins", None if weight.mins is None else
                                 weight.mins.float().contiguous(), persistent=False)
            self.register_buffer("ct_group_index", weight.group_index(), persistent=False)

    def _init_wq(self, weight: Int4Weight) -> None:
        """GGUF min form on CPU: integer-dot tiles (kvserve.quant.wq) and nothing else."""
        n, k = self.out_features, self.in_features
        self.fast, self._layout, self.op_group = False, None, 0
        self.k_pad, self.n_pad = k, _ceil_to(n, wq.TILE)
        u = torch.zeros(self.n_pad, k, dtype=torch.uint8)  # padded rows: u = s = m = 0
        u[:n] = (weight.values.to(torch.int16) + int4.OFFSET).to(torch.uint8)
        s = torch.zeros(self.n_pad, weight.n_groups, dtype=torch.float16)
        m = torch.zeros_like(s)
        s[:n], m[:n] = weight.scales.to(torch.float16), weight.mins.to(torch.float16)
        self.register_buffer("wq_codes", wq.pack_codes(u, 4), persistent=False)
        self.register_buffer("wq_sm", wq.pack_scales(s, m), persistent=False)
        for name in ("packed", "scales_zeros", "ct_packed", "ct_scales", "ct_zeros", "ct_mins",
                     "ct_group_index"):
            self.register_buffer(name, None, persistent=False)

    def _wq_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u uint8 [N, K], s fp16 [N, G], m fp16 [N, G]) of a wq-form layer (unpadded)."""
        n, k = self.out_features, self.in_features
        u = wq.unpack_codes(self.wq_codes, self.n_pad, k, 4)[:n]
        s, m = wq.unpack_scales(self.wq_sm)
        return u, s[:n], m[:n]

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_compressed_tensors(
        cls,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_shape: torch.Tensor | Sequence[int],
        weight_zero_point: torch.Tensor | None = None,
        group_size: int | None = None,
        bias: torch.Tensor | None = None,
        weight_g_idx: torch.Tensor | None = None,
    ) -> Int4Linear:
        """From one module's pack-quantized tensors (``<prefix>.weight_packed`` etc.)."""
        w = int4.from_compressed_tensors(weight_packed, weight_scale, weight_shape,
                                         weight_zero_point, group_size, weight_g_idx)
        return cls(w, bias)

    @classmethod
    def from_gptq(
        cls,
        qweight: torch.Tensor,
        qzeros: torch.Tensor | None,
        scales: torch.Tensor,
        g_idx: torch.Tensor | None = None,
        *,
        group_size: int,
        sym: bool = True,
        checkpoint_format: str = "gptq",
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """From one module's GPTQ tensors; ``group_size``/``sym``/``checkpoint_format`` come
        from the checkpoint's quantization_config (``desc_act`` needs nothing: g_idx says it)."""
        w = int4.unpack_gptq(qweight, qzeros, scales, g_idx, group_size=group_size, sym=sym,
                             checkpoint_format=checkpoint_format)
        return cls(w, bias)

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor,
        group_size: int = 128,
        symmetric: bool = True,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """Round-to-nearest quantize a dense [out, in] weight (group_size -1: channel-wise)."""
        return cls(int4.quantize_rtn(weight, group_size, symmetric), bias)

    # ---------------------------------------------------------------- packing

    @staticmethod
    def _op_group(w: Int4Weight) -> int | None:
        if w.n_groups == 1:  # channel-wise: any op group, the scale is the same everywhere
            return next((g for g in _OP_GROUPS if w.in_features >= g), _OP_GROUPS[-1])
        return next((g for g in _OP_GROUPS if w.group_size % g == 0), None)

    @staticmethod
    def _pack_for_op(
        w: Int4Weight, op_group: int, k_pad: int, n_pad: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = w.values.shape
        # unsigned nibbles; padded rows/columns hold 8 (weight 0; x is zero-padded anyway)
        u = torch.full((n_pad, k_pad), int4.OFFSET, dtype=torch.int32)
        u[:n, :k] = w.values.to(torch.int32) + int4.OFFSET
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2)
        # op groups: each original group spans group_size / op_group op groups
        n_op_groups = k_pad // op_group
        rep = 1 if w.n_groups == 1 else w.group_size // op_group
        s = w.scales.float()
        # w = (q - zp) * s = (u - 8) * s + zero  with  zero = -zp * s;  min form: (s, m) as is
        if w.mins is not None:
            z = w.mins.float()
        else:
            z = -w.zeros.float() * s if w.zeros is not None else torch.zeros_like(s)
        s = s.repeat_interleave(rep, 1) if rep > 1 else s
        z = z.repeat_interleave(rep, 1) if rep > 1 else z
        if w.n_groups == 1:
            s, z = s.expand(n, n_op_groups), z.expand(n, n_op_groups)
        assert s.shape == (n, n_op_groups), (s.shape, n_op_groups)
        # padded rows: w = 0. fp16 holds GGUF's fp16 (d, m) exactly; bf16 would round them
        pair_dtype = torch.float16 if w.mins is not None else torch.bfloat16
        sz = torch.zeros(n_op_groups, n_pad, 2, dtype=pair_dtype)
        sz[:, :n, 0] = s.t()
        sz[:, :n, 1] = z.t()
        return packed, sz

    # ---------------------------------------------------------------- compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_terms and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() \
                and x.device.type == "cpu" and self.n_pad == self.out_features \
                and x.shape[1] == self.in_features and self.bias is None:
            lib = wq_cpu.wq_library()  # the decode hot path: one C call, nothing else
            if lib is not None:
                return wq_cpu.wq_linear(lib, x, self.wq_codes, self.wq_sm, self.n_pad,
                                        self.group_size, 4, self.act_terms)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        m = x2.shape[0]
        if m == 0:
            y = x2.new_zeros(0, self.out_features)
        elif self.device_kernel is not None:  # GPU layout (see to_device_layout)
            y = self._forward_device(x2)
        elif self.wq_codes is not None:
            y = self._forward_wq(x2)
        elif self.fast and m <= self.gemv_max_m and _gemv_lib() is not None:
            y = self._forward_gemv(x2)
        elif self.fast and m < self.dequant_min_m and not self.min_form:
            y = self._forward_op(x2)  # bf16 activations: min-form (GGUF) layers keep fp32
        else:
            y = self._forward_dequant(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _forward_wq(self, x2: torch.Tensor) -> torch.Tensor:
        """GGUF min form: int8 activations x integer-dot tiles (kvserve/csrc/wq_gemm.c), or
        the same arithmetic in torch without the C library: [m, K] -> [m, N]."""
        xf = x2.float().contiguous()
        lib = wq_cpu.wq_library() if xf.device.type == "cpu" else None
        if lib is not None:
            y = wq_cpu.wq_linear(lib, xf, self.wq_codes, self.wq_sm, self.n_pad,
                                 self.group_size, 4, self.act_terms)[:, : self.out_features]
        else:
            u, s, m = self._wq_parts()
            y = wq.fake_quant_act(xf, self.act_terms) @ \
                wq.dequantize_ref(u, s, m, self.group_size).t()
        return y.to(x2.dtype)

    def _forward_gemv(self, x2: torch.Tensor) -> torch.Tensor:
        """C/AVX2 skinny GEMM on the op's packed bytes, fp32 activations: [m, K] -> [m, N]."""
        assert self._layout is not None and self.packed.is_contiguous()
        xf = x2.float()
        if self.k_pad != self.in_features:
            xf = F.pad(xf, (0, self.k_pad - self.in_features))
        xf = xf.contiguous()
        g = self.op_group
        sz = self.scales_zeros
        want = torch.float16 if self.min_form else torch.bfloat16
        if sz.dtype != want:  # a module-wide .to(dtype) cast it
            sz = sz.to(want)
        y = int4_cpu.gemv(_gemv_lib(), self.packed, sz, xf, g, self._layout[0], self.min_form)
        if self.n_pad != self.out_features:
            y = y[:, : self.out_features]
        return y.to(x2.dtype)

    def _forward_op(self, x2: torch.Tensor) -> torch.Tensor:
        """tinygemm int4 op in bf16: [m, K] -> [m, N] in x2's dtype."""
        xb = x2.to(torch.bfloat16)
        if self.k_pad != self.in_features:
            xb = F.pad(xb, (0, self.k_pad - self.in_features))
        sz = self.scales_zeros
        if self.min_form:  # the op's form w = (u - 8) s + z: z = m + 8 s, rounded to bf16
            sf = sz.float()
            sz = torch.stack((sf[..., 0], sf[..., 1] + 8.0 * sf[..., 0]), -1)
        if sz.dtype != torch.bfloat16:  # a module-wide .to(dtype) cast it
            sz = sz.bfloat16()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), self.packed,
                                                       self.op_group, sz)
        if self.n_pad != self.out_features:
            y = y[:, : self.out_features]
        return y.to(x2.dtype)

    def _forward_dequant(self, x2: torch.Tensor) -> torch.Tensor:
        """Row-chunked dequantize -> fp32 GEMM: [m, K] -> [m, N] in x2's dtype."""
        xf = x2.float()
        if self.k_pad != self.in_features:
            xf = F.pad(xf, (0, self.k_pad - self.in_features))
        y = torch.empty(x2.shape[0], self.n_pad, dtype=torch.float32)
        for r0, r1 in self._row_chunks():
            y[:, r0:r1] = xf @ self._dequant_rows_t(r0, r1)  # w_t: fp32 [k_pad, r1 - r0]
        if self.n_pad != self.out_features:
            y = y[:, : self.out_features]
        return y.to(x2.dtype)

    def _row_chunks(self) -> list[tuple[int, int]]:
        block = self._layout[0] if self._layout is not None and self.fast else 1
        rows = max(block, (_CHUNK_BYTES // (4 * self.k_pad)) // block * block)
        return [(r, min(r + rows, self.n_pad)) for r in range(0, self.n_pad, rows)]

    def _dequant_rows_t(self, r0: int, r1: int) -> torch.Tensor:
        """fp32 [k_pad, r1 - r0]: W^T for stored rows [r0, r1) (stored = permuted columns)."""
        if not self.fast:
            v = int4.unpack_nibbles(self.ct_packed[r0:r1], self.in_features, 1).float()
            gi = self.ct_group_index
            if self.ct_mins is not None:  # fl(fl(u * s) + m), as int4.dequantize
                return (v * self.ct_scales[r0:r1][:, gi] + self.ct_mins[r0:r1][:, gi]).t()
            v -= int4.OFFSET
            if self.ct_zeros is not None:
                v -= self.ct_zeros[r0:r1].float()[:, gi]
            return (v * self.ct_scales[r0:r1][:, gi]).t()
        assert self._layout is not None
        block_n, mode = self._layout
        rows, g = r1 - r0, self.op_group
        lib = _gemv_lib()
        if lib is not None and self.scales_zeros.dtype == (
                torch.float16 if self.min_form else torch.bfloat16):
            # the C twin of the torch code below, bit for bit (a workspace view: consumed by
            # the caller's GEMM before the next call)
            out = _workspace(self.k_pad * rows).view(self.k_pad, rows)
            return int4_cpu.dequant_t(lib, self.packed, self.scales_zeros, self.k_pad, g,
                                      block_n, self.min_form, r0, r1, out)
        ng = self.k_pad // g
        # nibbles as [k_pad, rows] (uint8): column c is stored row r0 + c
        u = _unpack_blocks(self.packed, self.n_pad, self.k_pad, block_n, mode,
                           r0 // block_n, r1 // block_n, k_major=True)
        sz = self.scales_zeros[:, r0:r1].float()  # [ng, rows, 2]
        s, z = sz[..., 0].unsqueeze(1), sz[..., 1].unsqueeze(1)  # [ng, 1, rows]
        w = torch.mul(u.view(ng, g, rows), s)  # uint8 * fp32 -> fp32, one pass
        w.add_(z if self.min_form else z - int4.OFFSET * s)  # u s + m  or  (u - 8) s + z
        return w.view(self.k_pad, rows)

    # ---------------------------------------------------------------- GPU layouts (CUDA)
    #
    # The CPU layouts above are specific to torch's CPU int4 op. Moving the module to CUDA
    # (``.to("cuda")``, ``.cuda()``; the loader does it for ``--device cuda``) first repacks,
    # once, into a GPU layout (``to_device_layout``) and drops the CPU buffers:
    #
    #   "triton"   (default) kvserve/kernels/triton/int4.py, the compressed-tensors layout:
    #              dev_packed int32 [N, ceil(K/8)] (nibble j of word w = column 8w + j, unsigned)
    #              dev_scales [N, G] fp32, dev_zeros int8 [N, G] unsigned zero points (0..16),
    #              fp32 fractional ones -m / s for the GGUF min form (Q4_0: exactly 8), or
    #              None (symmetric: 8); W[n, k] = (u - zp) * scale, group dev_group.
    #   "tinygemm" torch's CUDA ``_weight_int4pack_mm`` (bf16 activations, sm80+): dev_packed
    #              int32 opaque tiles from ``_convert_weight_to_int4pack`` (made on the device from
    #              dev_u8 uint8 [n_pad, k_pad/2], even column in the high nibble), dev_sz bf16
    #              [k_pad/g, n_pad, 2] (scale, zero) with W = (u - 8) * scale + zero.
    #   "dense"    act-order groups that are not contiguous (no kernel takes them): the dense
    #              weight in fp32 [N, K], computed with a plain matmul.
    #
    # The GPU layout is rebuilt from whichever CPU layout the module holds: the canonical pack
    # exactly; the CPU op's pack exactly in its nibbles, with its bf16 (scale, zero) pairs and
    # op-sized groups (the zero point is recovered as the integer round(8 - zero / scale)).
    # ``to_device_layout`` also works on CPU (tests): forward then runs the Triton kernel under
    # TRITON_INTERPRET=1, else its pure-torch twin (kvserve.kernels.reference.int4_matmul).

    device_kernel: str | None = None  # None: the CPU layouts; else "triton"/"tinygemm"/"dense"

    @torch.no_grad()
    def to_device_layout(self, kernel: str | None = None) -> Int4Linear:
        """Repack for a GPU kernel, in place, on the current device; returns self. ``kernel``:
        "triton", "tinygemm" or None ($KVSERVE_INT4_CUDA_KERNEL, default "triton")."""
        kernel = kernel or default_cuda_kernel()
        if kernel not in CUDA_KERNELS:
            raise ValueError(f"kernel must be one of {CUDA_KERNELS}, got {kernel!r}")
        if self.device_kernel is not None:
            if self.device_kernel != kernel and kernel != "dense":
                raise ValueError(f"already packed for {self.device_kernel!r}; rebuild the "
                                 f"layer from its checkpoint tensors to use {kernel!r}")
            return self
        u, scales, zp, group = self._canonical_for_device()  # u: uint8 [N, K] or None
        if u is None:  # irregular act-order groups
            kernel = "dense"
        elif kernel == "tinygemm" and not self._tinygemm_ok(group):
            kernel = "triton"
        k, n = self.in_features, self.out_features
        bufs: dict[str, torch.Tensor | None] = dict.fromkeys(
            ("dev_packed", "dev_scales", "dev_zeros", "dev_u8", "dev_sz", "dev_dense"))
        if kernel == "dense":
            bufs["dev_dense"] = self.dequantize()  # fp32 [N, K], original column order
            self._drop_perm()
        elif kernel == "triton":
            bufs["dev_packed"] = int4.pack_int4((u.to(torch.int16) - int4.OFFSET).to(torch.int8))
            bufs["dev_scales"] = scales
            bufs["dev_zeros"] = None if zp is None else (
                zp.float() if zp.is_floating_point() else zp.to(torch.int8))
        else:
            k_pad, n_pad = _ceil_to(k, group), _ceil_to(n, 8)  # group: a multiple of 32
            up = torch.full((n_pad, k_pad), int4.OFFSET, dtype=torch.uint8)  # pad: weight 0
            up[:n, :k] = u
            bufs["dev_u8"] = ((up[:, ::2] << 4) | up[:, 1::2]).contiguous()  # [n_pad, k_pad/2]
            zpf = torch.full_like(scales, float(int4.OFFSET)) if zp is None else zp.float()
            sz = torch.zeros(k_pad // group, n_pad, 2, dtype=torch.bfloat16)
            sz[: scales.shape[1], :n, 0] = scales.t()
            sz[: scales.shape[1], :n, 1] = ((int4.OFFSET - zpf) * scales).t()  # zero
            bufs["dev_sz"] = sz
        for name in ("packed", "scales_zeros", "ct_packed", "ct_scales", "ct_zeros", "ct_mins",
                     "ct_group_index", "wq_codes", "wq_sm"):
            self.register_buffer(name, None, persistent=False)
        for name, t in bufs.items():
            self.register_buffer(name, None if t is None else t.contiguous(), persistent=False)
        self.dev_group = group
        self.device_kernel = kernel
        if kernel == "tinygemm" and self.dev_u8.is_cuda:
            self._finish_tinygemm()
        return self

    def _canonical_for_device(
        self,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, int]:
        """(u uint8 [N, K] stored-column nibbles, scales fp32 [N, G], unsigned zero points
        [N, G] int16 or None, group) of the weight as held; u is None for irregular groups."""
        n, k = self.out_features, self.in_features
        if self.wq_codes is not None:
            u, s, m = self._wq_parts()
            return u, s.float(), self._min_form_zero_points(s.float(), m), self.group_size
        if self.fast:
            assert self._layout is not None
            block_n, mode = self._layout
            g = self.op_group
            u = _unpack_blocks(self.packed, self.n_pad, self.k_pad, block_n, mode, 0,
                               self.n_pad // block_n, k_major=True)  # [k_pad, n_pad]
            u = u.t()[:n, :k].contiguous()
            sz = self.scales_zeros.float()[:, :n]  # [k_pad / g, n, 2]
            s, z = sz[..., 0].t().contiguous(), sz[..., 1].t()  # [n, G']
            zp = None
            if self.min_form:  # w = u s + m = (u - zp) s with a fractional zp = -m / s
                return u, s, self._min_form_zero_points(s, z), g
            if not self.symmetric:
                safe = torch.where(s == 0, torch.ones_like(s), s)
                zp = torch.where(s == 0, torch.full_like(s, float(int4.OFFSET)),
                                 (int4.OFFSET - z / safe).round()).to(torch.int16)
            return u, s, zp, g
        gi = self.ct_group_index
        group = self.group_size
        if not torch.equal(gi, torch.arange(k, device=gi.device) // group):
            return None, self.ct_scales, None, group
        u = int4.unpack_nibbles(self.ct_packed, k, 1).to(torch.uint8)  # unsigned nibbles
        if self.ct_mins is not None:
            return u, self.ct_scales.float(), self._min_form_zero_points(
                self.ct_scales.float(), self.ct_mins), group
        zp = None if self.ct_zeros is None else self.ct_zeros.to(torch.int16) + int4.OFFSET
        return u, self.ct_scales.float(), zp, group

    @staticmethod
    def _min_form_zero_points(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """fp32 [N, G] zp with (u - zp) s == u s + m up to fp32 rounding (Q4_0: zp = 8,
        exact). A group with s == 0 and m != 0 has no such zp: refused (not in ggml output
        unless a whole block is one constant)."""
        m = m.float()
        if bool(((s == 0) & (m != 0)).any()):
            raise ValueError("a Q4_1 block with d == 0 and m != 0 has no GPU zero-point form")
        safe = torch.where(s == 0, torch.ones_like(s), s)
        return torch.where(s == 0, torch.full_like(s, float(int4.OFFSET)), -m / safe)

    def _tinygemm_ok(self, group: int) -> bool:
        return (getattr(torch.ops.aten, "_weight_int4pack_mm", None) is not None
                and group in _OP_GROUPS)

    def _drop_perm(self) -> None:
        self.register_buffer("perm", None, persistent=False)

    def _finish_tinygemm(self) -> None:
        """On CUDA: uint8 nibbles -> tinygemm's int32 tiles (the op runs on the device)."""
        k_pad = self.dev_u8.shape[1] * 2
        tiles = next(t for t in (8, 4, 2) if k_pad % (16 * t) == 0)
        packed = torch.ops.aten._convert_weight_to_int4pack(self.dev_u8, tiles)
        self.register_buffer("dev_packed", packed, persistent=False)
        self.register_buffer("dev_u8", None, persistent=False)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        if self.device_kernel is None and _target_device(fn) == "cuda":
            self.to_device_layout()  # repack on the CPU, then move the GPU layout
        out = super()._apply(fn, recurse)
        if self.device_kernel == "tinygemm" and self.dev_u8 is not None and self.dev_u8.is_cuda:
            self._finish_tinygemm()
        return out

    def _forward_device(self, x2: torch.Tensor) -> torch.Tensor:
        """[m, K] (columns already permuted) -> [m, N] in x2's dtype, with the GPU layout."""
        kernel = self.device_kernel
        if kernel == "dense":
            return (x2.float() @ self.dev_dense.t().float()).to(x2.dtype)
        if kernel == "tinygemm":
            k_pad = self.dev_sz.shape[0] * self.dev_group
            xb = x2.to(torch.bfloat16)
            if k_pad != self.in_features:
                xb = F.pad(xb, (0, k_pad - self.in_features))
            y = torch.ops.aten._weight_int4pack_mm(xb.contiguous(), self.dev_packed,
                                                   self.dev_group, self.dev_sz.bfloat16())
            return y[:, : self.out_features].to(x2.dtype)
        from kvserve.kernels import reference as ref

        if x2.is_cuda or interpreting():
            from kvserve.kernels.triton import int4 as triton_int4

            mm = triton_int4.int4_matmul
        else:
            mm = ref.int4_matmul  # the twin: a CPU module holding the GPU layout
        return mm(x2.contiguous(), self.dev_packed, self.dev_scales, self.dev_zeros,
                  self.dev_group)

    @torch.no_grad()
    def _dequantize_device(self) -> torch.Tensor:
        """fp32 [out, in] (original column order) from the GPU layout."""
        if self.device_kernel == "dense":
            return self.dev_dense.float().clone()
        if self.device_kernel == "tinygemm":
            k_pad = self.dev_sz.shape[0] * self.dev_group
            eye = torch.eye(k_pad, dtype=torch.bfloat16, device=self.dev_sz.device)
            w = self._forward_device(eye[:, : self.in_features]).float().t()  # [N, k_pad]
            w = w[:, : self.in_features]  # bf16-rounded products: what the op computes
        else:
            from kvserve.kernels import reference as ref

            w = ref.dequantize_int4(self.dev_packed, self.dev_scales, self.dev_zeros,
                                    self.dev_group, k=self.in_features)
        if self.perm is not None:
            dense = torch.empty_like(w)
            dense[:, self.perm] = w
            return dense
        return w.contiguous()

    # ---------------------------------------------------------------- introspection

    @torch.no_grad()
    def dequantize(self) -> torch.Tensor:
        """The dense fp32 [out, in] weight this layer computes with (original column order)."""
        if self.device_kernel is not None:
            return self._dequantize_device()
        if self.wq_codes is not None:
            u, s, m = self._wq_parts()
            return wq.dequantize_ref(u, s, m, self.group_size)
        w_t = torch.cat([self._dequant_rows_t(r0, r1).clone() for r0, r1 in self._row_chunks()],
                        1)  # clone: the C path returns a reused workspace
        w = w_t.t()[: self.out_features, : self.in_features]
        if self.perm is not None:
            dense = torch.empty_like(w)
            dense[:, self.perm] = w
            return dense
        return w.contiguous()

    def weight_bytes(self) -> int:
        """Bytes of every tensor the layer holds (packed weight, scales/zeros, perm, bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        path = "w4a8" if self.wq_codes is not None else "int4-op" if self.fast else "dequant"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, "
                f"bias={self.bias is not None}, path={path}, act_order={self.perm is not None}")


def int4_experts_from_dense(
    weights: torch.Tensor | Sequence[torch.Tensor],
    group_size: int = 128,
    symmetric: bool = True,
) -> nn.ModuleList:
    """MoE experts: E dense [out, in] weights (or one [E, out, in] tensor) -> ModuleList of E
    Int4Linear, each quantized independently like a plain linear (compressed-tensors and GPTQ
    checkpoints store ``experts.<e>.<proj>`` per expert: build each with the constructors)."""
    return nn.ModuleList(Int4Linear.from_dense(w, group_size, symmetric) for w in weights)


_WORKSPACE = threading.local()


def _wq_form_ok(w: Int4Weight) -> bool:
    """GGUF-style groups the integer-dot layout holds: whole 32-column blocks, fp16 (s, m)."""
    if w.n_groups == 1 or w.group_size % wq.BLOCK or w.in_features % w.group_size:
        return False
    s, m = w.scales.float(), w.mins.float()
    return bool(torch.equal(s.half().float(), s) and torch.equal(m.half().float(), m))


def _workspace(numel: int) -> torch.Tensor:
    """A reusable fp32 buffer per thread for dequantized weight tiles: a fresh 4 MiB tensor
    per call page-faults (~1.5 ms, as much as the dequantize itself)."""
    buf = getattr(_WORKSPACE, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _WORKSPACE.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


@functools.cache
def _gemv_lib() -> ctypes.CDLL | None:
    """The C int4 GEMV, if it builds and this CPU's int4pack layout is one it reads."""
    layout = int4pack_layout()
    if layout is None or layout[1] != "halves" or layout[0] not in (32, 64):
        return None
    return int4_cpu.load()


CUDA_KERNELS = ("triton", "tinygemm", "dense")


def default_cuda_kernel() -> str:
    """$KVSERVE_INT4_CUDA_KERNEL ("triton" or "tinygemm"); default "triton"."""
    kernel = os.environ.get("KVSERVE_INT4_CUDA_KERNEL", "triton")
    if kernel not in ("triton", "tinygemm"):
        raise ValueError(f"KVSERVE_INT4_CUDA_KERNEL must be triton or tinygemm, got {kernel!r}")
    return kernel


def _target_device(fn) -> str | None:  # noqa: ANN001
    """Device type an ``nn.Module._apply`` function sends tensors to (probed on an empty one)."""
    try:
        t = fn(torch.empty(0))
    except Exception:  # noqa: BLE001 - not a tensor-to-tensor function
        return None
    return t.device.type if isinstance(t, torch.Tensor) else None


def _ceil_to(x: int, m: int) -> int:
    return math.ceil(x / m) * m
