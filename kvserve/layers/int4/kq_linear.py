"""A GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K linear kept packed (``kvserve.layers.int4.gguf_types``:
those types' entries build it from the file's blocks).

The blocks are read into their parts and packed once into the tile layout of
kvserve/csrc/kq_gemm.c (``kvserve.quant.kq``: within 3% of the file's bytes; the raw blocks are
not kept). ``forward`` quantizes the activations per 32 columns to ``act_terms`` int8 passes
(1: llama.cpp's Q8 blocks; 2: ~15-bit, the default) and runs the integer-dot kernel (AVX-512
VNNI / AVX2 / portable C builds, one C call, recorded in CPU decode graphs); without the C
library, its twin (``kernels.reference.kq_matmul``'s arithmetic). ``act_terms`` 0 (fp32
activations) has no integer kernel: the weight is dequantized per call in row chunks (C
``kvs_kq_dequant``, exact) and multiplied in fp32 (for checks, not serving).

``dequantize()`` equals ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import reference
from kvserve.kernels.cpu import kq_gemm as kq_cpu
from kvserve.quant import kq

_CHUNK_ROWS = 1024  # rows dequantized at a time on the fp32-activation path


class KqLinear(nn.Module):
    """y = x W^T for a packed GGUF weight [N, K] of a ``kvserve.quant.kq`` type."""

    def __init__(self, parts: kq.KqParts, act_terms: int = 2) -> None:
        super().__init__()
        if act_terms not in (0, 1, 2):
            raise ValueError(f"act_terms must be 0 (fp32), 1 or 2, got {act_terms}")
        n, k = parts.shape
        kq.check_shape(parts.qtype, k)
        self.qtype, self.out_features, self.in_features = parts.qtype, n, k
        self.act_terms = act_terms
        self.register_buffer("packed", kq.pack(parts), persistent=False)
        # the kernel's shard table: (type, rows, pointer into ``packed``)
        self.register_buffer("table", kq_cpu.shard_table([(self.qtype, n, self.packed)]),
                             persistent=False)
        self._ptr = self.packed.data_ptr()

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, shape: tuple[int, int], act_terms: int,
                    qtype: int | str) -> KqLinear:
        """From a GGUF tensor's raw blocks (uint8 [N, row bytes]) of ``qtype``."""
        return cls(kq.from_blocks(qtype, raw, shape), act_terms)

    @property
    def type_name(self) -> str:
        return kq.TYPES[self.qtype][0]

    def parts(self) -> kq.KqParts:
        return kq.unpack(self.qtype, self.packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got {tuple(x.shape)}")
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features)
        return self._matmul(x2).reshape(*lead, self.out_features)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.packed.data_ptr() != self._ptr:
            raise ValueError("KqLinear was moved or copied: its kernel table points at the old "
                             "bytes; rebuild it from the checkpoint")
        xf = x2.float().contiguous()
        if self.act_terms:
            lib = kq_cpu.kq_library() if xf.device.type == "cpu" else None
            if lib is not None:
                return kq_cpu.kq_linear(lib, xf, self.table, self.out_features,
                                        self.act_terms).to(x2.dtype)
            xf = reference.wq_fake_quant_act(xf, self.act_terms)  # the kernel's arithmetic
        y = torch.cat([xf @ self._rows(r, min(r + _CHUNK_ROWS, self.out_features)).t()
                       for r in range(0, self.out_features, _CHUNK_ROWS)], -1)
        return y.to(x2.dtype)

    def _rows(self, r0: int, r1: int) -> torch.Tensor:
        """fp32 [r1 - r0, K]: rows of the exact weight (C, else the twin)."""
        lib = kq_cpu.kq_library() if self.packed.device.type == "cpu" else None
        if lib is not None:
            return kq_cpu.kq_dequant(lib, self.qtype, self.packed, self.out_features,
                                     self.in_features, r0, r1)
        return reference.kq_dequantize(kq.slice_rows(self.parts(), r0, r1 - r0))

    def dequantize(self) -> torch.Tensor:
        return self._rows(0, self.out_features)

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={self.type_name}, act_terms={self.act_terms}")
