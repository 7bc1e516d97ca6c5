"""A GGUF Q8_0 linear kept 8-bit (``kvserve.layers.int4.gguf_types``: the Q8_0 entry).

Layouts, chosen once:

* ``act_terms`` 1 or 2: integer-dot tiles (``kvserve.quant.wq``, 8-bit codes u = q + 128,
  s = d, m = -128 d: the same weights exactly, as ``Q8Embedding`` holds them); activations are
  quantized per 32 columns to int8 terms and the products run in kvserve/csrc/wq_gemm.c
  (AVX-512 VNNI / AVX2 / portable C builds), recorded in CPU decode graphs. Twin:
  ``kernels.reference.wq_fake_quant_act`` + the dequantized weight;
* 0 (or a scale whose -128 d overflows fp16): int8 q [N, K] + fp16 d [N, K/32] with fp32
  activations (kvserve/csrc/q8_gemv.c for up to ``GEMV_MAX_M`` rows, else dequantize + GEMM).

``dequantize()`` equals ``gguf.quants.dequantize`` bit for bit (d * q is exact in fp32).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import reference
from kvserve.kernels.cpu import q8_gemv as q8_cpu
from kvserve.kernels.cpu import wq_gemm as wq_cpu
from kvserve.quant import wq
from kvserve.quant.gguf_q8 import GROUP, dequantize_q8, unpack_q8_0

GEMV_MAX_M = 16
_FP16_MAX = 65504.0


class Q8Linear(nn.Module):
    """y = x W^T for a Q8_0 weight [N, K] (K a multiple of 32)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, act_terms: int = 2) -> None:
        super().__init__()
        n, k = q.shape
        if q.dtype != torch.int8 or d.dtype != torch.float16 or d.shape != (n, k // GROUP) \
                or k % GROUP:
            raise ValueError(f"q must be int8 [N, K] (K % 32 == 0) and d fp16 [N, K/32], got "
                             f"{q.dtype} {tuple(q.shape)}, {d.dtype} {tuple(d.shape)}")
        if act_terms not in (0, 1, 2):
            raise ValueError(f"act_terms must be 0 (fp32), 1 or 2, got {act_terms}")
        if act_terms and bool((d.float().abs() * 128 > _FP16_MAX).any()):
            act_terms = 0  # -128 d has no fp16 form: fp32 activations on q, d
        self.out_features, self.in_features, self.act_terms = n, k, act_terms
        if act_terms:
            self.n_pad = -(-n // wq.TILE) * wq.TILE
            u = torch.zeros(self.n_pad, k, dtype=torch.uint8)  # padded rows: s = m = 0
            u[:n] = (q.to(torch.int16) + 128).to(torch.uint8)
            s = torch.zeros(self.n_pad, k // GROUP, dtype=torch.float16)
            s[:n] = d
            self.register_buffer("codes", wq.pack_codes(u, 8), persistent=False)
            self.register_buffer("sm", wq.pack_scales(s, -128 * s), persistent=False)  # exact
            self.q = self.d = None
        else:
            self.n_pad = n
            self.register_buffer("q", q.contiguous(), persistent=False)
            self.register_buffer("d", d.contiguous(), persistent=False)
            self.codes = self.sm = None

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, shape: tuple[int, int], act_terms: int
                    ) -> Q8Linear:
        """From raw Q8_0 blocks (uint8 [N, K / 32 * 34])."""
        q, d = unpack_q8_0(raw, shape)
        return cls(q, d, act_terms)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], d fp16 [N, K/32])."""
        if self.q is not None:
            return self.q, self.d
        n, k = self.out_features, self.in_features
        u = wq.unpack_codes(self.codes, self.n_pad, k, 8)[:n]
        s, _ = wq.unpack_scales(self.sm)
        return (u.to(torch.int16) - 128).to(torch.int8), s[:n]

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        xf = x2.float().contiguous()
        cpu = xf.device.type == "cpu"
        if self.act_terms:
            lib = wq_cpu.wq_library() if cpu else None
            if lib is not None:
                y = wq_cpu.wq_linear(lib, xf, self.codes, self.sm, self.n_pad, GROUP, 8,
                                     self.act_terms)
                return (y if self.n_pad == n else y[:, :n]).to(x2.dtype)
            xf = reference.wq_fake_quant_act(xf, self.act_terms)  # the kernel's arithmetic
            return (xf @ self.dequantize().t()).to(x2.dtype)
        lib = q8_cpu.load() if cpu else None
        if lib is not None and xf.shape[0] <= GEMV_MAX_M:
            return q8_cpu.gemv(lib, self.q, self.d, xf).to(x2.dtype)
        return (xf @ self.dequantize().t()).to(x2.dtype)

    def dequantize(self) -> torch.Tensor:
        return dequantize_q8(*self.parts())

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"act_terms={self.act_terms}")
