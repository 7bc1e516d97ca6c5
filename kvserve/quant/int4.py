"""INT4 weight-only formats, the one home of the format: the canonical form, pure-torch
pack/unpack of every checkpoint format kvserve reads (compressed-tensors ``pack-quantized``,
GPTQ, GGUF Q4_0 / Q4_1 blocks), the per-module checkpoint scheme (``Int4Scheme``: which
tensors, and how they unpack), round-to-nearest quantization and the AWQ search.

Everything here is the reference ("twin") side: plain torch ops, fp32 math, no layout tricks.
The INT4 layer (``kvserve.layers.int4``) repacks an :class:`Int4Weight` for the kernels.

Canonical in-memory form (:class:`Int4Weight`), the compressed-tensors convention::

    values  int8  [out, in]       signed, in [-8, 7]
    scales  float [out, n_groups] n_groups = ceil(in / group_size); the last group may be partial
    zeros   int8  [out, n_groups] signed zero points, or None (symmetric: zero point 0)
    g_idx   int64 [in] or None    group of each input column (GPTQ act-order); None: k // group
    mins    float [out, n_groups] or None: the "min" form of GGUF Q4_0 / Q4_1 (zeros is None)
    dequantized w[o, k] = (values[o, k] - zeros[o, g(k)]) * scales[o, g(k)]
             or, with mins, fl(fl((values + 8) * scales) + mins)   (fp32, no fused multiply-add)

GGUF Q4_1 (w = d * q + m, q the unsigned nibble) is exactly the min form with scales = d,
mins = m; Q4_0 (w = d * (q - 8)) is scales = d, mins = -8 d (exact: d * q and d * (q - 8) need
at most 15 significant bits). See the GGUF section below (``unpack_q4``).

compressed-tensors ``pack-quantized`` (checked against compressed_tensors 0.20.1,
``compressors/pack_quantized/{base,helpers}.py`` and ``quantization/lifecycle/forward.py``)::

    weight_packed      int32 [out, ceil(in / 8)]  nibble j of word w (bits 4j..4j+3, low nibble
                                                  first) = values[o, 8w + j] + 8; tail nibbles 0
    weight_scale       float [out, n_groups]      (the model dtype; [out, 1] for channel-wise)
    weight_zero_point  int32 [ceil(out / 8), n_groups]  asymmetric only: zeros + 8 packed the
                                                  same way but along dim 0 (8 output rows/word)
    weight_shape       int64 [2]                  (out, in)
    weight_g_idx       int32 [in]                 only with actorder="group" (optional)

compressed-tensors 0.20 itself refuses ``in % group_size != 0`` for the group strategy; the
format code here handles a partial last group, but the quantizer keeps such layers dense.

GPTQ (auto-gptq / GPTQ-for-LLaMa checkpoint layout; zero-point convention as in vLLM's
``gptq`` kernels and GPTQModel's ``checkpoint_format``)::

    qweight  int32 [in / 8, out]          nibble j of qweight[r, o] = unsigned q[8r + j, o]
    qzeros   int32 [n_groups, out / 8]    nibble j of qzeros[g, c]  = stored zero of output 8c + j
    scales   float [n_groups, out]
    g_idx    int32 [in]                   group per input channel (arbitrary order: desc_act)
    w[o, k] = (q[k, o] - zero[g(k), o]) * scales[g(k), o]
    checkpoint_format "gptq" (v1): zero = stored + 1  (auto-gptq's historical off-by-one)
    checkpoint_format "gptq_v2":   zero = stored
    sym=True: zero = 8 for every group whatever qzeros holds (what vLLM's Marlin path assumes)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

INT4_MIN, INT4_MAX = -8, 7
OFFSET = 8  # signed value v is stored as the unsigned nibble v + 8
VALUES_PER_WORD = 8  # int4 values per int32
_SHIFTS = tuple(range(0, 32, 4))  # bit offset of nibble j in a word: low nibble first
GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A quantized [out, in] weight in the canonical signed form (see module docstring)."""

    values: torch.Tensor  # int8 [out, in] in [-8, 7]
    scales: torch.Tensor  # float [out, n_groups]
    zeros: torch.Tensor | None  # int8 [out, n_groups] in [-8, 8], None => symmetric
    group_size: int  # columns per group (== in_features for channel-wise)
    g_idx: torch.Tensor | None = None  # int64 [in] group per column, None => k // group_size
    mins: torch.Tensor | None = None  # float [out, n_groups]: w = (values + 8) * scales + mins

    def __post_init__(self) -> None:
        if self.values.dim() != 2 or self.values.dtype != torch.int8:
            raise ValueError(f"values must be int8 [out, in], got {self.values.dtype} "
                             f"{tuple(self.values.shape)}")
        out, k = self.values.shape
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.scales.dim() != 2 or self.scales.shape[0] != out:
            raise ValueError(f"scales must be [out={out}, n_groups], got "
                             f"{tuple(self.scales.shape)}")
        ng = self.scales.shape[1]
        if self.g_idx is None and ng != math.ceil(k / self.group_size):
            raise ValueError(f"scales {tuple(self.scales.shape)} do not match in={k}, "
                             f"group_size={self.group_size}")
        if not self.scales.is_floating_point():
            raise ValueError(f"scales must be floating point, got {self.scales.dtype}")
        if self.zeros is not None and (self.zeros.shape != self.scales.shape
                                       or self.zeros.dtype != torch.int8):
            raise ValueError(f"zeros must be int8 {tuple(self.scales.shape)}, got "
                             f"{self.zeros.dtype} {tuple(self.zeros.shape)}")
        if self.mins is not None:
            if self.zeros is not None:
                raise ValueError("mins (the GGUF min form) and zeros are exclusive")
            if self.mins.shape != self.scales.shape or not self.mins.is_floating_point():
                raise ValueError(f"mins must be float {tuple(self.scales.shape)}, got "
                                 f"{self.mins.dtype} {tuple(self.mins.shape)}")
        if self.g_idx is not None:
            if self.g_idx.shape != (k,):
                raise ValueError(f"g_idx must be [in={k}], got {tuple(self.g_idx.shape)}")
            if k and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= ng):
                raise ValueError(f"g_idx values must lie in [0, {ng})")

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1]

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None and self.mins is None

    def group_index(self) -> torch.Tensor:
        """int64 [in]: the group of each input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features) // self.group_size


def dequantize(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference twin: [out, in] dense weight, computed in fp32 then cast to ``dtype``."""
    gi = w.group_index()
    v = w.values.float()
    if w.mins is not None:
        u = v + OFFSET
        return (u * w.scales.float()[:, gi] + w.mins.float()[:, gi]).to(dtype)
    if w.zeros is not None:
        v = v - w.zeros.float()[:, gi]
    return (v * w.scales.float()[:, gi]).to(dtype)


# ---------------------------------------------------------------------------------------------
# Nibble packing (shared by compressed-tensors and GPTQ layouts)
# ---------------------------------------------------------------------------------------------


def pack_int4(values: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """int8 [R, C] signed in [-8, 7] -> int32, 8 values per word along ``dim`` (0 or 1).

    Value i along ``dim`` goes to word i // 8, bits 4*(i % 8) .. +3 as the nibble value + 8; a
    partial last word is zero-filled (compressed-tensors ``pack_to_int32`` semantics).
    """
    if values.dim() != 2 or values.dtype != torch.int8:
        raise ValueError(f"values must be int8 [R, C], got {values.dtype} {tuple(values.shape)}")
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 or 1, got {dim}")
    if values.numel() and (int(values.min()) < INT4_MIN or int(values.max()) > INT4_MAX):
        raise ValueError("values must lie in [-8, 7] to be packed as int4")
    u = values.to(torch.int64) + OFFSET
    if dim == 0:
        u = u.t()
    rows, cols = u.shape
    words = math.ceil(cols / VALUES_PER_WORD)
    u = torch.nn.functional.pad(u, (0, words * VALUES_PER_WORD - cols))  # zero nibbles
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=u.device)
    packed = (u.view(rows, words, VALUES_PER_WORD) << shifts).sum(-1)  # [rows, words] < 2**32
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return (packed.t() if dim == 0 else packed).contiguous()


def unpack_int4(packed: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 words -> int8 signed [.., size along dim, ..]."""
    return (unpack_nibbles(packed, size, dim) - OFFSET).to(torch.int8)


def unpack_nibbles(packed: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """int32 words -> int16 raw nibbles in [0, 15]; ``size`` entries along ``dim`` (0 or 1)."""
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(f"packed must be int32 2-D, got {packed.dtype} {tuple(packed.shape)}")
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 or 1, got {dim}")
    p = packed.t() if dim == 0 else packed
    rows, words = p.shape
    if size > words * VALUES_PER_WORD or size <= (words - 1) * VALUES_PER_WORD:
        raise ValueError(f"size={size} does not fit {words} packed words along dim {dim}")
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=p.device)
    # arithmetic >> on negative words still leaves the right nibble in the low 4 bits
    nib = (p.unsqueeze(-1) >> shifts) & 0xF  # [rows, words, 8]
    out = nib.reshape(rows, words * VALUES_PER_WORD)[:, :size].to(torch.int16)
    return (out.t() if dim == 0 else out).contiguous()


# ---------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized
# ---------------------------------------------------------------------------------------------


def to_compressed_tensors(w: Int4Weight) -> dict[str, torch.Tensor]:
    """Int4Weight -> {weight_packed, weight_scale, weight_shape[, weight_zero_point]}.

    Scales keep their dtype (quantize with ``scale_dtype`` = the model dtype so the stored
    scale is exactly the one used to round). Act-order weights are not written (no g_idx).
    """
    if w.g_idx is not None:
        raise ValueError("g_idx (act-order) weights cannot be written as pack-quantized here")
    out = {
        "weight_packed": pack_int4(w.values, dim=1),
        "weight_scale": w.scales.contiguous(),
        "weight_shape": torch.tensor([w.out_features, w.in_features], dtype=torch.int64),
    }
    if w.zeros is not None:
        out["weight_zero_point"] = pack_int4(w.zeros, dim=0)
    return out


def from_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | Sequence[int],
    weight_zero_point: torch.Tensor | None = None,
    group_size: int | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> Int4Weight:
    """compressed-tensors pack-quantized tensors (one module, prefix stripped) -> Int4Weight.

    ``group_size`` comes from the config (``config_groups.*.weights.group_size``; None or -1 for
    the channel strategy). If None it is inferred as in / n_groups, which requires in to be a
    multiple of n_groups (always true for checkpoints compressed-tensors itself can load).
    """
    shape = [int(s) for s in (weight_shape.tolist() if isinstance(weight_shape, torch.Tensor)
                              else weight_shape)]
    if len(shape) != 2:
        raise ValueError(f"weight_shape must have 2 entries, got {shape}")
    out, k = shape
    if weight_scale.dim() == 1:
        weight_scale = weight_scale.unsqueeze(1)
    if weight_scale.dim() != 2 or weight_scale.shape[0] != out:
        raise ValueError(f"weight_scale must be [out={out}, n_groups], got "
                         f"{tuple(weight_scale.shape)}")
    if weight_packed.shape != (out, math.ceil(k / VALUES_PER_WORD)):
        raise ValueError(f"weight_packed must be [{out}, {math.ceil(k / 8)}], got "
                         f"{tuple(weight_packed.shape)}")
    ng = weight_scale.shape[1]
    if group_size is None or group_size == -1:
        if ng == 1:
            group_size = k
        elif k % ng == 0:
            group_size = k // ng
        else:
            raise ValueError(f"group_size is required: in={k} is not a multiple of "
                             f"n_groups={ng}")
    g_idx = weight_g_idx.long() if weight_g_idx is not None else None
    if g_idx is None and math.ceil(k / group_size) != ng:
        raise ValueError(f"group_size={group_size} gives {math.ceil(k / group_size)} groups "
                         f"for in={k}, weight_scale has {ng}")
    zeros = None
    if weight_zero_point is not None:
        zeros = unpack_int4(weight_zero_point, out, dim=0)
        if zeros.shape != (out, ng):
            raise ValueError(f"weight_zero_point unpacks to {tuple(zeros.shape)}, expected "
                             f"{(out, ng)}")
    values = unpack_int4(weight_packed, k, dim=1)
    return Int4Weight(values, weight_scale, zeros, group_size, g_idx)


# ---------------------------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------------------------


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    group_size: int,
    sym: bool,
    checkpoint_format: str = "gptq",
) -> Int4Weight:
    """GPTQ 4-bit tensors (one module) -> Int4Weight (see module docstring for conventions).

    ``group_size`` is the config value (-1: one group per row). A trivial ``g_idx``
    (== k // group_size) is dropped; any other order is kept as act-order.
    """
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {GPTQ_FORMATS}, got "
                         f"{checkpoint_format!r}")
    if qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError("qweight and scales must be 2-D")
    ng, out = scales.shape
    k = qweight.shape[0] * VALUES_PER_WORD
    if qweight.shape[1] != out:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not match scales "
                         f"{tuple(scales.shape)} (out={out})")
    if g_idx is not None and g_idx.shape != (k,):
        raise ValueError(f"g_idx must be [in={k}], got {tuple(g_idx.shape)}")
    if group_size == -1:
        group_size = k
    if group_size < 1:
        raise ValueError(f"group_size must be -1 or >= 1, got {group_size}")
    # nibbles along the input dim: [in, out] unsigned -> signed [out, in]
    values = (unpack_nibbles(qweight, k, dim=0) - OFFSET).t().to(torch.int8).contiguous()
    zeros = None
    if not sym:
        if qzeros is None:
            raise ValueError("qzeros is required when sym=False")
        if qzeros.shape != (ng, math.ceil(out / VALUES_PER_WORD)):
            raise ValueError(f"qzeros must be [{ng}, {math.ceil(out / 8)}], got "
                             f"{tuple(qzeros.shape)}")
        z = unpack_nibbles(qzeros, out, dim=1)  # [ng, out] stored zeros in [0, 15]
        if checkpoint_format == "gptq":
            z = z + 1
        zeros = (z - OFFSET).t().to(torch.int8).contiguous()  # signed, in [-8, 8]
    gi = None
    if g_idx is not None:
        gi = g_idx.long()
        if torch.equal(gi, torch.arange(k) // group_size) and ng == math.ceil(k / group_size):
            gi = None
    elif ng != math.ceil(k / group_size):
        raise ValueError(f"group_size={group_size} gives {math.ceil(k / group_size)} groups "
                         f"for in={k}, scales has {ng}")
    return Int4Weight(values, scales.t().contiguous(), zeros, group_size, gi)


# ---------------------------------------------------------------------------------------------
# GGUF Q4_0 / Q4_1 blocks
# ---------------------------------------------------------------------------------------------
# ggml's block layouts (``ggml-common.h``; ``gguf.quants`` is the reference these are tested
# against, bit for bit), 32 weights of one row per block, rows stored one after another::
#
#     Q4_0  18 B:  d fp16 | qs[16]           w = d * (q - 8)
#     Q4_1  20 B:  d fp16 | m fp16 | qs[16]  w = d * q + m
#     qs[j] low nibble = q of weight j, high nibble = q of weight j + 16   (j = 0 .. 15)
#
# Both become the min form, group 32 (``Int4Weight.mins``), without requantizing::
#
#     values = q - 8 (int8),  scales = d (fp16),  mins = m (Q4_1)  or  -8 d (Q4_0, exact in fp16)
#     w = fl(fl((values + 8) * d) + mins)  ==  gguf.quants.dequantize  bit for bit:
#       Q4_1: gguf computes fl(fl(d * q) + m) in fp32: the same two roundings;
#       Q4_0: gguf computes fl(d * (q - 8)); d * q and 8 d are exact in fp32 (<= 15 significant
#             bits) and d * (q - 8) is representable, so the one rounding of the sum is exact.
#
# ``Int4Linear`` keeps exactly these nibbles and (d, min) pairs in fp16 (no bf16 rounding).

Q4_GROUP = 32  # weights per block (QK4_0 == QK4_1 == 32)
Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def unpack_q4(data: np.ndarray | torch.Tensor, kind: str, shape: tuple[int, int]
              ) -> Int4Weight:
    """Raw block bytes (uint8, ``rows * blocks * Q4_BLOCK_BYTES`` in any shape) of an [out, in]
    tensor -> Int4Weight (values int8 [out, in], scales / mins fp16 [out, in / 32])."""
    if kind not in Q4_BLOCK_BYTES:
        raise ValueError(f"kind must be one of {sorted(Q4_BLOCK_BYTES)}, got {kind!r}")
    out, k = shape
    if k % Q4_GROUP:
        raise ValueError(f"{kind} rows hold whole blocks of {Q4_GROUP}; in_features {k} is not")
    raw = _as_bytes(data)
    nb, bb = k // Q4_GROUP, Q4_BLOCK_BYTES[kind]
    if raw.numel() != out * nb * bb:
        raise ValueError(f"{kind} [{out}, {k}] needs {out * nb * bb} bytes, got {raw.numel()}")
    blocks = raw.view(out, nb, bb)
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(out, nb)
    qs = blocks[..., bb - 16:]  # [out, nb, 16]
    q = torch.cat((qs & 15, qs >> 4), -1).reshape(out, k)  # weight j | j + 16 of each block
    values = (q.to(torch.int16) - OFFSET).to(torch.int8)
    if kind == "Q4_1":
        mins = blocks[..., 2:4].contiguous().view(torch.float16).view(out, nb)
    else:
        mins = d * -8.0  # fp16: exact unless |d| > 8188 (then inf, refused below)
        if not torch.isfinite(mins).all():
            raise ValueError("Q4_0 scale too large for fp16 min form (|d| > 8188)")
    return Int4Weight(values, d.clone(), None, Q4_GROUP, None, mins.clone())


def _as_bytes(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 view of a tensor, or of a (possibly read-only, memory-mapped) array's copy."""
    if isinstance(data, torch.Tensor):
        return data.contiguous().view(torch.uint8).reshape(-1)
    return torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1))


# ---------------------------------------------------------------------------------------------
# Checkpoint schemes: how one module's INT4 weight is stored, and its tensors -> Int4Weight
# ---------------------------------------------------------------------------------------------

# Tensors a quantized module owns in the checkpoint, per format.
CT_TENSORS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
              "weight_g_idx")
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
GGUF_TENSORS = ("gguf_blocks",)  # uint8 [out, blocks * bytes]: raw Q4_0 / Q4_1 blocks


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    """How one module's INT4 weight is stored in a checkpoint (format, group size, symmetry,
    act order) and which tensors it owns. Read from ``quantization_config`` by
    ``kvserve.model.quant_config`` (or from a GGUF file's tensor types by ``kvserve.model.gguf``);
    consumed by the INT4 layer (``kvserve.layers.int4``)."""

    format: str  # "pack-quantized", "gptq" or "gguf" (raw Q4_0 / Q4_1 blocks)
    group_size: int  # -1: channel-wise (one group per row)
    symmetric: bool
    act_order: bool = False  # a g_idx tensor is required
    checkpoint_format: str = "gptq"  # GPTQ only: "gptq" (v1) or "gptq_v2"
    gguf_type: str | None = None  # GGUF only: "Q4_0" or "Q4_1"
    # GGUF only: int8 terms per activation on CPU (kvserve.quant.wq); 0: fp32 activations
    act_terms: int = 0

    @property
    def tensor_names(self) -> tuple[str, ...]:
        if self.format == "gguf":
            return GGUF_TENSORS
        return CT_TENSORS if self.format == "pack-quantized" else GPTQ_TENSORS

    def required_tensors(self) -> tuple[str, ...]:
        """Tensor names (``<module>.<name>``) a checkpoint must hold for this module."""
        if self.format == "gguf":
            return GGUF_TENSORS
        if self.format == "pack-quantized":
            names = ["weight_packed", "weight_scale", "weight_shape"]
            if not self.symmetric:
                names.append("weight_zero_point")
            if self.act_order:
                names.append("weight_g_idx")
        else:
            names = ["qweight", "scales"]
            if not self.symmetric:
                names.append("qzeros")
            if self.act_order:
                names.append("g_idx")
        return tuple(names)

    def eager_tensors(self) -> tuple[str, ...]:
        """Tensors a module waits for before building itself as soon as they are in (GPTQ
        writers always store qzeros and g_idx); the loader builds the rest at the end."""
        if self.format == "gptq":
            return self.tensor_names
        return self.required_tensors()

    def ignorable_tensors(self) -> tuple[str, ...]:
        """Tensors the scheme does not use (a symmetric checkpoint's zero points)."""
        if not self.symmetric:
            return ()
        return ("weight_zero_point",) if self.format == "pack-quantized" else ("qzeros",)

    def unpack(self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
               ) -> Int4Weight:
        """One module's checkpoint tensors (by name, ``required_tensors`` all present) -> its
        Int4Weight [out, in]; ``shape`` (the checkpoint's [out, in]) is read by the GGUF format
        only, the others store it. A pack-quantized trivial g_idx (== k // group) is dropped."""
        t = tensors
        if self.format == "gguf":
            return unpack_q4(t["gguf_blocks"], self.gguf_type, shape)  # type: ignore[arg-type]
        if self.format == "pack-quantized":
            w = from_compressed_tensors(
                t["weight_packed"], t["weight_scale"], t["weight_shape"],
                None if self.symmetric else t["weight_zero_point"],
                None if self.group_size == -1 else self.group_size, t.get("weight_g_idx"))
            if w.g_idx is not None and torch.equal(
                    w.g_idx, torch.arange(w.in_features) // w.group_size):
                w = Int4Weight(w.values, w.scales, w.zeros, w.group_size)
            return w
        return unpack_gptq(t["qweight"], t.get("qzeros"), t["scales"], t.get("g_idx"),
                           group_size=self.group_size, sym=self.symmetric,
                           checkpoint_format=self.checkpoint_format)

    def describe(self) -> str:
        if self.format == "gguf":
            return f"int4 gguf {self.gguf_type} group {self.group_size} (min form)"
        group = "channel" if self.group_size == -1 else f"group {self.group_size}"
        sym = "sym" if self.symmetric else "asym"
        fmt = self.format if self.format != "gptq" else self.checkpoint_format
        return f"int4 {fmt} {group} {sym}" + (" act-order" if self.act_order else "")


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------

_CLIP_GRID = 20  # shrink factors 1.0 .. 0.6 tried by clip_search


def quantize_rtn(
    weight: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    *,
    scale_dtype: torch.dtype | None = None,
    clip_search: bool = False,
) -> Int4Weight:
    """Round-to-nearest INT4 quantization of ``weight`` [out, in] (the compressed-tensors
    min-max observer): symmetric scale = absmax / 7.5 (values clamp to [-8, 7]); asymmetric
    scale = (max - min) / 15 over a range widened to include 0, zero = round(-8 - min / scale).

    ``group_size`` -1 means one group per row (channel-wise). The last group may be partial.
    Scales are rounded to ``scale_dtype`` (default: the weight's dtype) *before* rounding the
    values, so storing them in that dtype is exact. ``clip_search`` additionally tries
    shrinking each group's range (MSE observer): ~17% lower weight MSE on Gaussian weights.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [out, in] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    out, k = weight.shape
    if group_size == -1:
        group_size = k
    if group_size < 1:
        raise ValueError(f"group_size must be -1 or >= 1, got {group_size}")
    if scale_dtype is None:
        scale_dtype = weight.dtype
    ng = math.ceil(k / group_size)
    w = weight.detach().float()
    # zero padding never changes absmax / a range that must contain 0 anyway
    wg = torch.nn.functional.pad(w, (0, ng * group_size - k)).view(out, ng, group_size)
    wmin = wg.amin(-1).clamp(max=0.0)  # [out, ng]
    wmax = wg.amax(-1).clamp(min=0.0)
    best: tuple[torch.Tensor, torch.Tensor | None] | None = None
    best_err: torch.Tensor | None = None
    shrinks = torch.linspace(1.0, 0.6, _CLIP_GRID + 1).tolist() if clip_search else [1.0]
    for shrink in shrinks:
        scales, zeros = _qparams(wmin * shrink, wmax * shrink, symmetric, scale_dtype)
        if len(shrinks) == 1:
            best = (scales, zeros)
            break
        q = _round(wg, scales, zeros)
        deq = (q - (zeros.unsqueeze(-1) if zeros is not None else 0.0)) * scales.float()[..., None]
        err = (deq - wg).square().sum(-1)  # [out, ng]
        if best is None or best_err is None:
            best, best_err = (scales, zeros), err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        s = torch.where(better, scales, best[0])
        z = torch.where(better, zeros, best[1]) if zeros is not None and best[1] is not None \
            else None
        best = (s, z)
    assert best is not None
    scales, zeros = best
    values = _round(wg, scales, zeros).view(out, ng * group_size)[:, :k].to(torch.int8)
    zeros_i8 = zeros.to(torch.int8) if zeros is not None else None
    return Int4Weight(values.contiguous(), scales, zeros_i8, group_size)


def _qparams(
    wmin: torch.Tensor, wmax: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group (scale [out, ng] in scale_dtype, float zero [out, ng] or None)."""
    eps = torch.finfo(scale_dtype).eps
    if symmetric:
        scales = torch.maximum(-wmin, wmax) / ((INT4_MAX - INT4_MIN) / 2)
        zeros = None
    else:
        scales = (wmax - wmin) / (INT4_MAX - INT4_MIN)
    scales = scales.to(scale_dtype)
    scales = torch.where(scales == 0, torch.tensor(eps, dtype=scale_dtype), scales)
    if not symmetric:
        zeros = (INT4_MIN - wmin / scales.float()).round().clamp(INT4_MIN, INT4_MAX)
    return scales, zeros


def _round(wg: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """wg [out, ng, G] fp32 -> rounded float values in [-8, 7] (same shape)."""
    q = wg / scales.float().unsqueeze(-1)
    if zeros is not None:
        q = q + zeros.unsqueeze(-1)
    return q.round().clamp(INT4_MIN, INT4_MAX)


def concat_out(weights: Sequence[Int4Weight]) -> Int4Weight:
    """Stack several weights along the output dim (fused q/k/v or gate/up projections).

    All parts must share in_features, group_size, symmetry and g_idx.
    """
    if not weights:
        raise ValueError("weights must not be empty")
    first = weights[0]
    for w in weights[1:]:
        if (w.in_features != first.in_features or w.group_size != first.group_size
                or w.symmetric != first.symmetric or w.n_groups != first.n_groups):
            raise ValueError("weights differ in in_features/group_size/symmetry")
        if (w.g_idx is None) != (first.g_idx is None) or (
                w.g_idx is not None and not torch.equal(w.g_idx, first.g_idx)):
            raise ValueError("weights differ in g_idx")
        if (w.mins is None) != (first.mins is None):
            raise ValueError("weights differ in form (GGUF min form vs zero points)")
    dtype = first.scales.dtype
    zeros = None if first.zeros is None else torch.cat([w.zeros for w in weights])  # type: ignore
    mins = None if first.mins is None else torch.cat([w.mins.to(dtype) for w in weights])
    return Int4Weight(torch.cat([w.values for w in weights]),
                      torch.cat([w.scales.to(dtype) for w in weights]), zeros,
                      first.group_size, first.g_idx, mins)


# ---------------------------------------------------------------------------------------------
# AWQ: activation-aware per-input-channel scaling
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AwqResult:
    scales: torch.Tensor  # fp32 [in]: multiply weight columns by it, divide the input by it
    alpha: float  # chosen exponent (0.0 == plain RTN)
    error: float  # sum ||X W^T - X Wq^T||^2 over the weights with these scales
    rtn_error: float  # the same without scaling (alpha = 0)


def awq_search_scales(
    weights: Sequence[torch.Tensor],
    x: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    n_grid: int = 20,
) -> AwqResult:
    """AWQ scale search for linears sharing one input ``x`` [n, in] (e.g. q/k/v).

    For alpha in {0, 1/n_grid, .., (n_grid-1)/n_grid}: s = mean|x|^alpha (normalized so
    sqrt(max * min) == 1), quantize W * s (columns), and score
    sum_w ||x W^T - (x / s) Q(W * s)^T||^2. alpha = 0 is plain RTN, so the result is never
    worse than RTN on ``x``. Fold the returned scales by multiplying W's columns and dividing
    the producer of ``x`` (a norm weight, or the previous linear's output rows) by them.
    """
    if n_grid < 1:
        raise ValueError(f"n_grid must be >= 1, got {n_grid}")
    if x.dim() != 2:
        raise ValueError(f"x must be [n, in], got {tuple(x.shape)}")
    k = x.shape[1]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"every weight must be [out, in={k}], got {tuple(w.shape)}")
    xf = x.detach().float()
    ws = [w.detach().float() for w in weights]
    refs = [xf @ w.t() for w in ws]
    x_mean = xf.abs().mean(0).clamp(min=1e-4)  # [in]
    best: tuple[float, float, torch.Tensor] | None = None
    rtn_err = math.inf
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = 0.0
        for w, ref in zip(ws, refs, strict=True):
            q = quantize_rtn(w * s, group_size, symmetric, scale_dtype=torch.float32)
            wq = dequantize(q) / s
            err += float((ref - xf @ wq.t()).square().sum())
        if i == 0:
            rtn_err = err
        if best is None or err < best[0]:
            best = (err, alpha, s)
    assert best is not None
    return AwqResult(scales=best[2], alpha=best[1], error=best[0], rtn_error=rtn_err)
