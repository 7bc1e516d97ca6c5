"""One dispatch table for GGML tensor types: how each type a GGUF file holds is loaded.

``GGML_TYPES[qtype] -> GGMLTypePath``; ``path_of(qtype, tensor)`` looks a tensor up (a
ValueError naming the type and the tensor for a type kvserve cannot read). Three kinds:

* ``"float"``: F32 / F16 / BF16, read as stored (then cast to the compute dtype);
* ``"packed"``: a linear layer's weight stays in the file's blocks. ``linear(raw, shape,
  act_terms)`` builds the layer's compute part from the raw blocks: raw uint8 [N, row bytes]
  (whole rows of blocks; the fused shards of one module that share the type are concatenated
  along rows first, so N is the fused module's rows), shape (N, K), act_terms the int8 passes
  per activation (``EngineArgs.gguf_activations``; 0: fp32 activations). The part is an
  ``nn.Module`` with ``forward(x2 [m, K]) -> [m, N]`` in x2's dtype, ``dequantize() -> fp32
  [N, K]`` (the weights it computes with) and ``weight_bytes()``. ``min_k`` is the block the
  kernel needs K to be a multiple of; other shapes are dequantized;
* ``"dequantized"``: ``gguf.quants.dequantize`` (the reference twin of every type) to fp32,
  then the compute dtype: a dense layer; the start-up log says so per type.

Non-linear tensors (norms, embeddings) of any type are dequantized (a Q8_0 token embedding / LM
head is kept 8-bit by ``kvserve.model.sources.keep_q8_tables``). A fused module (q/k/v,
gate/up) whose shards are all packed is packed even when their types differ (one part per type,
outputs concatenated, ``kvserve.layers.int4.gguf_linear``); if any shard's type is not packed,
the whole module is dequantized.

Registering a packed type (as Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K are, ``kq_linear.py``): add an
entry to ``_PACKED`` below -- ``QT.Q4_K: GGMLTypePath("packed", "<kernel>", linear=<builder>,
min_k=256)`` -- with the builder in its own module under
``kvserve/layers/int4/`` (as ``q8_linear.py`` does for Q8_0). Nothing else needs to change:
the loader, the start-up log and the decode graphs read this table. Tests:
tests/model/test_gguf_types.py loads a tiny model of every type and compares it to the
dequantized reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from torch import nn

from kvserve.quant import int4

# (raw uint8 [N, row bytes], (N, K), act_terms) -> the layer's compute part
LinearBuilder = Callable[[torch.Tensor, tuple[int, int], int], nn.Module]


@dataclass(frozen=True, slots=True)
class GGMLTypePath:
    kind: str  # "float", "packed" or "dequantized"
    kernel: str  # what computes with it (the start-up log and docs/quantization.md)
    linear: LinearBuilder | None = None  # packed only
    min_k: int = 32  # packed only: K must be a multiple of this

    def packs(self, k: int) -> bool:
        """Whether a linear of ``k`` input columns stays packed."""
        return self.kind == "packed" and k % self.min_k == 0

    def describe(self) -> str:
        return {"float": "as stored", "packed": f"packed ({self.kernel})",
                "dequantized": f"dequantized ({self.kernel})"}[self.kind]


def _q4(kind: str) -> LinearBuilder:
    def build(raw: torch.Tensor, shape: tuple[int, int], act_terms: int) -> nn.Module:
        from kvserve.layers.int4.linear import Int4Linear

        return Int4Linear(int4.unpack_q4(raw, kind, shape), act_terms=act_terms)

    return build


def _q8(raw: torch.Tensor, shape: tuple[int, int], act_terms: int) -> nn.Module:
    from kvserve.layers.int4.q8_linear import Q8Linear

    return Q8Linear.from_blocks(raw, shape, act_terms)


def _kq(kind: str) -> LinearBuilder:
    def build(raw: torch.Tensor, shape: tuple[int, int], act_terms: int) -> nn.Module:
        from kvserve.layers.int4.kq_linear import KqLinear

        return KqLinear.from_blocks(raw, shape, act_terms, kind)

    return build


_WQ = "wq_gemm.c integer dot (VNNI / AVX2 / C)"
_KQ = "kq_gemm.c integer dot (VNNI / AVX2 / C)"
_PACKED: dict[QT, GGMLTypePath] = {
    QT.Q4_0: GGMLTypePath("packed", _WQ + ", 4-bit tiles", _q4("Q4_0")),
    QT.Q4_1: GGMLTypePath("packed", _WQ + ", 4-bit tiles", _q4("Q4_1")),
    QT.Q8_0: GGMLTypePath("packed", _WQ + ", 8-bit tiles", _q8),
    QT.Q5_0: GGMLTypePath("packed", _KQ + ", 5-bit tiles", _kq("Q5_0")),
    QT.Q5_1: GGMLTypePath("packed", _KQ + ", 5-bit tiles", _kq("Q5_1")),
    QT.Q4_K: GGMLTypePath("packed", _KQ + ", 4-bit tiles", _kq("Q4_K"), min_k=256),
    QT.Q5_K: GGMLTypePath("packed", _KQ + ", 5-bit tiles", _kq("Q5_K"), min_k=256),
    QT.Q6_K: GGMLTypePath("packed", _KQ + ", 6-bit tiles", _kq("Q6_K"), min_k=256),
}
_FLOAT = (QT.F32, QT.F16, QT.BF16)
_DEQUANT = "gguf.quants.dequantize -> dense; no packed kernel yet"


def _table() -> dict[QT, GGMLTypePath]:
    from gguf.quants import _type_traits  # the types gguf can dequantize

    out: dict[QT, GGMLTypePath] = {t: GGMLTypePath("float", "as stored") for t in _FLOAT}
    for t in _type_traits:
        if t not in out:
            out[t] = GGMLTypePath("dequantized", _DEQUANT)
    out.update(_PACKED)
    return out


GGML_TYPES: dict[QT, GGMLTypePath] = _table()


def path_of(qtype: QT | int, tensor: str) -> GGMLTypePath:
    """The path of ``tensor``'s type; ValueError naming both when kvserve cannot read it."""
    try:
        qt = QT(int(qtype))
    except ValueError:
        raise ValueError(f"GGUF tensor {tensor!r} has ggml type id {int(qtype)}, which the "
                         "installed gguf library does not know (a newer llama.cpp type?); "
                         "kvserve cannot read it") from None
    path = GGML_TYPES.get(qt)
    if path is None:
        raise ValueError(f"GGUF tensor {tensor!r} has ggml type {qt.name}, which kvserve "
                         f"cannot read (the gguf library has no dequantizer for it); readable: "
                         f"{', '.join(t.name for t in GGML_TYPES)}")
    return path


def block_shape(qtype: QT) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type."""
    return GGML_QUANT_SIZES[qtype]
