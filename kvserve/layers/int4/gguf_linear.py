"""``GGUFLinear``: a ``Linear`` / ``MergedLinear`` whose GGUF weight stays in the file's blocks.

The loader swaps it in on the meta model (``swap_gguf_modules``) for every linear module whose
shards' ggml types are all packed in ``kvserve.layers.int4.gguf_types.GGML_TYPES``. Each shard's
raw blocks arrive through ``gguf_blocks.weight_loader(param, raw, shard_id)`` (uint8
[out, row bytes], the file's rows after the q/k rope un-permutation); once all are in they are
sliced to this rank (rows, or whole blocks of columns) and consecutive shards of one type are
concatenated along rows into one part, built by that type's ``linear``. Parts' outputs are
concatenated along the output dim (one part: no copy; several, for fused modules whose shards
differ in type: ``kvserve.kernels.cpu.cpu_ops.concat_cols``, recorded in CPU decode graphs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from kvserve.distributed.parallel_state import tp_all_reduce
from kvserve.kernels.cpu import cpu_ops
from kvserve.layers.int4.gguf_types import GGML_TYPES, block_shape
from kvserve.layers.linear import (
    Linear,
    MergedLinear,
    ShardSlice,
    TPPlan,
    checkpoint_names,
    loaded_bias,
    shard_layout,
    tp_geometry,
)

TENSOR = "gguf_blocks"


class GGUFLinear(nn.Module):
    """Packed GGUF stand-in for a ``Linear`` (one shard, id None) or a ``MergedLinear``."""

    def __init__(
        self,
        in_features: int,
        out_sizes: tuple[int, ...],
        shard_ids: tuple[str | None, ...],
        types: dict[str | None, QT],
        shard_names: dict[str | None, str],
        bias: torch.Tensor | None = None,
        act_terms: int = 2,
        *,
        tp_plan: TPPlan | None = None,
        full_in: int | None = None,
        full_out_sizes: tuple[int, ...] | None = None,
        reduce_results: bool = False,
    ) -> None:
        super().__init__()
        assert len(out_sizes) == len(shard_ids) and set(types) == set(shard_ids)
        self.in_features, self.out_sizes, self.shard_ids = in_features, out_sizes, shard_ids
        self.types, self.shard_names, self.act_terms = types, shard_names, act_terms
        self.tp_plan = tp_plan or dict.fromkeys(shard_ids)
        self.full_in = full_in or in_features
        self.full_sizes = dict(zip(shard_ids, full_out_sizes or out_sizes, strict=True))
        self.reduce_results = reduce_results
        self.offsets, self.sizes = shard_layout(out_sizes, shard_ids)
        self._raw: dict[str | None, torch.Tensor] | None = {}
        p = nn.Parameter(torch.empty(0, dtype=torch.uint8, device="meta"), requires_grad=False)
        p.weight_loader = self._load_part  # type: ignore[attr-defined]
        p.keep_dtype = True  # type: ignore[attr-defined]
        self.register_parameter(TENSOR, p)
        self.bias = loaded_bias(bias, self._load_bias)
        self.parts: nn.ModuleList | None = None
        self.part_sizes: tuple[int, ...] = ()

    @classmethod
    def replacing(cls, module: nn.Module, types: dict[str | None, QT],
                  shard_names: dict[str | None, str], act_terms: int) -> GGUFLinear:
        tp = tp_geometry(module)
        if isinstance(module, MergedLinear):
            return cls(module.in_features, module.out_sizes, module.shard_ids, types,
                       shard_names, module.bias, act_terms, **tp)
        if isinstance(module, Linear):
            return cls(module.in_features, (module.out_features,), (None,), types, shard_names,
                       module.bias, act_terms, **tp)
        raise TypeError(f"cannot keep {type(module).__name__} packed")

    # ---------------------------------------------------------------- loading

    def _load_part(self, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: str | None = None) -> None:
        if shard_id not in self.sizes:
            raise ValueError(f"{self._name(shard_id)}: unknown shard {shard_id!r} "
                             f"(expected one of {self.shard_ids})")
        if self._raw is None:
            raise ValueError(f"{self._name(shard_id)} arrived after the module was built")
        self._raw[shard_id] = loaded
        if len(self._raw) == len(self.shard_ids):
            self.finish_loading()

    def _load_bias(self, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: str | None = None) -> None:
        sl = self.tp_plan[shard_id]
        if sl is not None:
            loaded = sl.take(loaded)
        dst = param.data.narrow(0, self.offsets[shard_id], self.sizes[shard_id])
        if dst.shape != loaded.shape:
            raise ValueError(f"{self._name(shard_id)}.bias: expected {tuple(dst.shape)}, got "
                             f"{tuple(loaded.shape)}")
        dst.copy_(loaded)

    def _name(self, shard_id: str | None) -> str:
        return self.shard_names.get(shard_id, "?")

    def _rank_raw(self, shard_id: str | None) -> torch.Tensor:
        """This rank's raw rows of one shard: uint8 [rows, row bytes]."""
        assert self._raw is not None
        qt, name = self.types[shard_id], self._name(shard_id)
        be, bb = block_shape(qt)
        full_n, full_k = self.full_sizes[shard_id], self.full_in
        raw = self._raw[shard_id].reshape(-1)
        if full_k % be or raw.numel() != full_n * full_k // be * bb:
            raise ValueError(f"{name}.weight ({qt.name}): [{full_n}, {full_k}] needs "
                             f"{full_n * (full_k // be) * bb} bytes of whole {be}-weight "
                             f"blocks, got {raw.numel()}")
        raw = raw.view(full_n, full_k // be, bb)
        sl: ShardSlice | None = self.tp_plan[shard_id]
        if sl is not None and sl.dim == 0:
            raw = raw.narrow(0, sl.start, sl.size)
        elif sl is not None:
            if sl.start % be or sl.size % be:
                raise ValueError(f"{name}: tensor_parallel_size splits its {full_k} input "
                                 f"columns into shards of {sl.size}, not whole {qt.name} "
                                 f"blocks of {be}")
            raw = raw.narrow(1, sl.start // be, sl.size // be)
        return raw.reshape(raw.shape[0], -1).contiguous()

    def finish_loading(self) -> None:
        """Slice every shard to this rank and build the parts; idempotent."""
        if self._raw is None:
            return
        missing = [self._name(s) for s in self.shard_ids if s not in self._raw]
        if missing:
            raise ValueError(f"checkpoint is missing tensor(s): "
                             f"{', '.join(n + '.weight' for n in missing)}")
        runs: list[tuple[QT, list[str | None]]] = []
        for s in self.shard_ids:
            if runs and runs[-1][0] == self.types[s]:
                runs[-1][1].append(s)
            else:
                runs.append((self.types[s], [s]))
        parts, sizes = [], []
        for qt, shards in runs:
            raw = torch.cat([self._rank_raw(s) for s in shards]) if len(shards) > 1 \
                else self._rank_raw(shards[0])
            n = sum(self.sizes[s] for s in shards)
            build = GGML_TYPES[qt].linear
            assert build is not None, qt
            try:
                parts.append(build(raw, (n, self.in_features), self.act_terms))
            except ValueError as e:
                names = ", ".join(self._name(s) for s in shards)
                raise ValueError(f"{names} ({qt.name}): {e}") from None
            sizes.append(n)
        self.parts, self.part_sizes = nn.ModuleList(parts), tuple(sizes)
        self._raw = None
        delattr(self, TENSOR)

    # ---------------------------------------------------------------- compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is None:
            raise RuntimeError(f"{self.shard_names}: GGUF weights were never loaded")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if len(self.parts) == 1:
            y = self.parts[0](x2)
        else:
            outs = [p(x2) for p in self.parts]
            y = cpu_ops.concat_cols(outs)
            if y is None:  # not fp32 on CPU, or no C library: the twin
                y = torch.cat(outs, dim=-1)
        if self.reduce_results:
            y = tp_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, sum(self.out_sizes))

    @torch.no_grad()
    def dequantize(self) -> torch.Tensor:
        """The dense fp32 [sum(out_sizes), in] weight this module computes with."""
        if self.parts is None:
            raise RuntimeError(f"{self.shard_names}: GGUF weights were never loaded")
        return torch.cat([p.dequantize() for p in self.parts])

    def weight_bytes(self) -> int:
        n = 0 if self.parts is None else sum(p.weight_bytes() for p in self.parts)
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    @torch.no_grad()
    def to_device(self, kernel: str, device: str) -> None:
        """Off the CPU: INT4 parts repack for the GPU ``kernel``; other parts become their
        dequantized weight (a dense part) on ``device``."""
        assert self.parts is not None
        for i, p in enumerate(self.parts):
            if hasattr(p, "to_device_layout"):
                p.to_device_layout(kernel, device)
            else:
                self.parts[i] = DensePart(p.dequantize().to(device))
        self.to(device)

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{self._name(s)}: {self.types[s].name}" for s in self.shard_ids)
        return f"in_features={self.in_features}, out_sizes={self.out_sizes}, types=({kinds})"


class DensePart(nn.Module):
    """A part held as its dense fp32 weight (GPU devices)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("w", w.float().contiguous(), persistent=False)

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        return (x2.float() @ self.w.t()).to(x2.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.w.clone()

    def weight_bytes(self) -> int:
        return self.w.numel() * self.w.element_size()


def swap_gguf_modules(model: nn.Module, type_of: Callable[[str], QT | None],
                      act_terms: int) -> Counter[str]:
    """Replace the (meta) ``Linear`` / ``MergedLinear`` modules whose every shard's weight type
    (``type_of(checkpoint module name)``) is packed in ``GGML_TYPES`` with ``GGUFLinear``.
    A tied ``lm_head`` and the modules a model reads as a dense matrix
    (``int4_dense_modules``) stay dense. Returns the swapped shards per type name."""
    shard_ckpt: dict[str, dict[str, str]] = {}  # fused module -> shard id -> checkpoint module
    for ckpt, (fused, shard) in model.packed_modules.items():
        shard_ckpt.setdefault(fused, {})[shard] = ckpt
    dense = set(model.int4_dense_modules)
    swapped: Counter[str] = Counter()
    for name, module in list(model.named_modules()):
        if not isinstance(module, (Linear, MergedLinear)):
            continue
        parent_name, _, attr = name.rpartition(".")
        if (model.tie_word_embeddings and name == "lm_head") or attr in dense:
            continue
        names = checkpoint_names(name, module, shard_ckpt)
        types = {s: type_of(n) for s, n in names.items()}
        if not all(t is not None and GGML_TYPES[t].packs(module.full_in)
                   for t in types.values()):
            continue
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, GGUFLinear.replacing(module, types, names, act_terms))
        swapped.update(t.name for t in types.values())
    return swapped
