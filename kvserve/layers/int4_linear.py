"""INT4 weight-only linear layer (W4A16) for CPU.

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

Compute paths (benchmarks/int4_kernels.py; Zen3 AVX2, 1 thread, K = N = 4096, median ms, on
a quiet host; under heavy host load everything is 2-4x slower and the dequant path suffers most)::

    M     dense bf16  dense fp32  int4 op (bf16)  int4 dequant->fp32 GEMM
    1     3.3         3.0         2.4             ~20
    64    196         37          50              47
    256   -           105         198             120

* M < ``dequant_min_m`` (default 96, the crossover: ~64 on a quiet host, ~128 on a loaded one):
  ``aten._weight_int4pack_mm_for_cpu`` (tinygemm). It computes w = (u - 8) * scale + zero with
  u the unsigned nibble and (scale, zero) in x's dtype; bf16 is its only fast dtype here (fp32
  runs a scalar loop, ~14x slower), so fp16 / fp32 activations are cast to bf16 for it and the
  result cast back. Its constraints: N % 16 == 0, K % group == 0, group in {32, 64, 128, 256}:
  N is padded to the op's row block (extra rows sliced off), K to a whole number of groups (x is
  zero-padded at runtime), larger groups that are multiples of 32 (and channel-wise) are split
  into op groups with repeated scales. (scale, zero) are held in bf16: fp16/fp32 checkpoint
  scales lose <0.4% relative precision, far below the int4 rounding error.
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

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.quant import int4
from kvserve.quant.int4 import Int4Weight

DEQUANT_MIN_M = 96  # rows of x from which dequant -> fp32 GEMM beats the int4 op (measured)
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
    ) -> None:
        super().__init__()
        n, k = weight.out_features, weight.in_features
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias must be [out={n}], got {tuple(bias.shape)}")
        if dequant_min_m < 1:
            raise ValueError(f"dequant_min_m must be >= 1, got {dequant_min_m}")
        self.in_features, self.out_features = k, n
        self.group_size = weight.group_size
        self.symmetric = weight.symmetric
        self.dequant_min_m = dequant_min_m
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
                                    weight.zeros, weight.group_size)
            else:
                perm = None  # irregular groups: canonical path with g_idx
        self.register_buffer("perm", perm, persistent=False)

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
            self.register_buffer("scales_zeros", sz, persistent=False)  # bf16 [k_pad/G', n_pad, 2]
            for name in ("ct_packed", "ct_scales", "ct_zeros", "ct_group_index"):
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
            self.register_buffer("ct_group_index", weight.group_index(), persistent=False)

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
        # w = (q - zp) * s = (u - 8) * s + zero  with  zero = -zp * s
        z = -w.zeros.float() * s if w.zeros is not None else torch.zeros_like(s)
        s = s.repeat_interleave(rep, 1) if rep > 1 else s
        z = z.repeat_interleave(rep, 1) if rep > 1 else z
        if w.n_groups == 1:
            s, z = s.expand(n, n_op_groups), z.expand(n, n_op_groups)
        assert s.shape == (n, n_op_groups), (s.shape, n_op_groups)
        sz = torch.zeros(n_op_groups, n_pad, 2, dtype=torch.bfloat16)  # padded rows: w = 0
        sz[:, :n, 0] = s.t()
        sz[:, :n, 1] = z.t()
        return packed, sz

    # ---------------------------------------------------------------- compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        m = x2.shape[0]
        if m == 0:
            y = x2.new_zeros(0, self.out_features)
        elif self.fast and m < self.dequant_min_m:
            y = self._forward_op(x2)
        else:
            y = self._forward_dequant(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _forward_op(self, x2: torch.Tensor) -> torch.Tensor:
        """tinygemm int4 op in bf16: [m, K] -> [m, N] in x2's dtype."""
        xb = x2.to(torch.bfloat16)
        if self.k_pad != self.in_features:
            xb = F.pad(xb, (0, self.k_pad - self.in_features))
        sz = self.scales_zeros
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
            v = int4.unpack_nibbles(self.ct_packed[r0:r1], self.in_features, 1).float() \
                - int4.OFFSET
            gi = self.ct_group_index
            if self.ct_zeros is not None:
                v -= self.ct_zeros[r0:r1].float()[:, gi]
            return (v * self.ct_scales[r0:r1][:, gi]).t()
        assert self._layout is not None
        block_n, mode = self._layout
        rows, g = r1 - r0, self.op_group
        ng = self.k_pad // g
        # nibbles as [k_pad, rows] (uint8): column c is stored row r0 + c
        u = _unpack_blocks(self.packed, self.n_pad, self.k_pad, block_n, mode,
                           r0 // block_n, r1 // block_n, k_major=True)
        sz = self.scales_zeros[:, r0:r1].float()  # [ng, rows, 2]
        s, z = sz[..., 0].unsqueeze(1), sz[..., 1].unsqueeze(1)  # [ng, 1, rows]
        w = torch.mul(u.view(ng, g, rows), s)  # uint8 * fp32 -> fp32, one pass
        w.add_(z - int4.OFFSET * s)  # (u - 8) * s + z
        return w.view(self.k_pad, rows)

    # ---------------------------------------------------------------- introspection

    @torch.no_grad()
    def dequantize(self) -> torch.Tensor:
        """The dense fp32 [out, in] weight this layer computes with (original column order)."""
        w_t = torch.cat([self._dequant_rows_t(r0, r1) for r0, r1 in self._row_chunks()], 1)
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
        path = "int4-op" if self.fast else "dequant"
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


def _ceil_to(x: int, m: int) -> int:
    return math.ceil(x / m) * m
