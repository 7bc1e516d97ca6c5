"""A GGUF Q8_0 token embedding kept 8-bit, and the LM head that reads it (tied or its own).

SmolLM2's tied embedding is 49,152 x 576: 113 MB in fp32, read whole by the LM head every
decode step (~35% of a batch-1 step). Held as Q8_0 (int8 + one fp16 scale per 32) it is 30 MB
and the same weights exactly (``kvserve.quant.gguf_q8``):

* ``Q8Embedding(ids)``: rows dequantized on the fly, in ``dtype``;
* ``Q8LMHead(hidden)`` -> fp32 logits [M, V]: the C GEMV (kvserve/csrc/q8_gemv.c) for up to
  ``GEMV_MAX_M`` rows (memory-bound), else row chunks dequantized to fp32 and one GEMM each.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import reference
from kvserve.kernels.cpu import cpu_ops
from kvserve.kernels.cpu import q8_gemv as q8_cpu
from kvserve.kernels.cpu import wq_gemm as wq_cpu
from kvserve.quant import wq
from kvserve.quant.gguf_q8 import dequantize_q8

GEMV_MAX_M = 16
_CHUNK_ROWS = 2048  # vocab rows dequantized per GEMM in the large-M path (4.5 MiB at K=576)


class Q8Embedding(nn.Module):
    """Held in one of two layouts, chosen once:

    * ``act_terms`` 1 or 2 (default 2): integer-dot tiles (kvserve.quant.wq, 8-bit codes
      u = q + 128, s = d, m = -128 d -- the same weights exactly); the head quantizes its input
      to int8 terms per 32 columns (1: as llama.cpp does for Q8_0; kvserve/csrc/wq_gemm.c);
    * otherwise row-major int8 q [N, K] + fp16 d [N, K/32] with fp32 activations
      (kvserve/csrc/q8_gemv.c).
    """

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype,
                 act_terms: int = 2) -> None:
        super().__init__()
        if q.dtype != torch.int8 or d.dtype != torch.float16 or d.shape != (
                q.shape[0], q.shape[1] // 32):
            raise ValueError(f"q must be int8 [N, K] and d fp16 [N, K/32], got {q.dtype} "
                             f"{tuple(q.shape)}, {d.dtype} {tuple(d.shape)}")
        self.num_embeddings, self.embedding_dim = n, k = q.shape
        self.dtype = dtype
        if act_terms not in (0, 1, 2):
            raise ValueError(f"act_terms must be 0 (fp32), 1 or 2, got {act_terms}")
        self.act_terms = act_terms
        if act_terms:
            self.n_pad = -(-n // wq.TILE) * wq.TILE
            u = torch.zeros(self.n_pad, k, dtype=torch.uint8)  # padded rows: s = m = 0
            u[:n] = (q.to(torch.int16) + 128).to(torch.uint8)
            s = torch.zeros(self.n_pad, k // 32, dtype=torch.float16)
            s[:n] = d
            self.codes = nn.Parameter(wq.pack_codes(u, 8), requires_grad=False)
            self.sm = nn.Parameter(wq.pack_scales(s, -128 * s), requires_grad=False)  # exact
            self.q = self.d = None
        else:
            self.q = nn.Parameter(q.contiguous(), requires_grad=False)
            self.d = nn.Parameter(d.contiguous(), requires_grad=False)
            self.codes = self.sm = None

    def rows(self, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [len(ids), K], d fp16 [len(ids), K/32]) of the given rows (all if None)."""
        if self.q is not None:
            return (self.q, self.d) if ids is None else (self.q[ids], self.d[ids])
        if ids is None:
            ids = torch.arange(self.num_embeddings)
        ids = ids.reshape(-1)
        k = self.embedding_dim
        tile, r = ids // wq.TILE, ids % wq.TILE
        u = self.codes.view(-1, k // 4, wq.TILE, 4)[tile, :, r, :].reshape(-1, k)
        d = self.sm.view(-1, k // 32, 2, wq.TILE)[tile, :, 0, r]
        return (u.to(torch.int16) - 128).to(torch.int8), d

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32 and ids.dim() == 1 and ids.device.type == "cpu":
            tiled = self.q is None
            out = cpu_ops.gather_q8(self.codes if tiled else self.q, self.sm if tiled else self.d,
                                    tiled, self.num_embeddings, self.embedding_dim, ids)
            if out is not None:  # one C call (the torch below is its twin)
                return out
        q, d = self.rows(ids)
        return dequantize_q8(q, d).view(*ids.shape, self.embedding_dim).to(self.dtype)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def dense_numel(self) -> int:
        return self.num_embeddings * self.embedding_dim


class Q8LMHead(nn.Module):
    """Logits from a Q8Embedding's weights (the same tensors when tied)."""

    def __init__(self, table: Q8Embedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.table
        x2 = x.reshape(-1, t.embedding_dim).float().contiguous()
        m, n = x2.shape[0], t.num_embeddings
        if t.act_terms:
            lib = wq_cpu.wq_library() if x2.device.type == "cpu" else None
            if lib is not None:
                y = wq_cpu.wq_linear(lib, x2, t.codes, t.sm, t.n_pad, 32, 8, t.act_terms)
                return y[:, :n].reshape(*x.shape[:-1], n)
            x2 = reference.wq_fake_quant_act(x2, t.act_terms)  # the kernel's arithmetic, in torch
        lib = q8_cpu.load() if not t.act_terms else None
        if lib is not None and m <= GEMV_MAX_M:
            y = q8_cpu.gemv(lib, t.q, t.d, x2)
        else:
            y = torch.empty(m, n, dtype=torch.float32)
            for r0 in range(0, n, _CHUNK_ROWS):
                r1 = min(n, r0 + _CHUNK_ROWS)
                y[:, r0:r1] = x2 @ dequantize_q8(*t.rows(torch.arange(r0, r1))).t()
        return y.reshape(*x.shape[:-1], n)

