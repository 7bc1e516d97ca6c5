"""``Int4MergedLinear``: the INT4 (W4A16) stand-in the loader swaps in for a ``Linear`` or a
``MergedLinear`` (``kvserve.layers.linear``) when the checkpoint quantizes the module
(``kvserve.layers.int4.loading.swap_int4_modules``). It collects each shard's checkpoint
tensors through the same ``weight_loader(param, tensor, shard_id)`` protocol, unpacks them with
the module's ``Int4Scheme`` (``kvserve.quant.int4``: the format), slices them to this rank
(``tp_plan``, as the dense module would) and packs one ``Int4Linear`` (one INT4 GEMM for the
fused module) once all shards are in.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvserve.distributed.parallel_state import tp_all_reduce
from kvserve.layers.int4.linear import Int4Linear
from kvserve.layers.linear import (
    Linear,
    MergedLinear,
    ShardSlice,
    TPPlan,
    loaded_bias,
    shard_layout,
    tp_geometry,
)
from kvserve.quant import int4
from kvserve.quant.int4 import Int4Scheme


class Int4MergedLinear(nn.Module):
    """INT4 (W4A16) stand-in for a ``Linear`` (one shard, id None) or a ``MergedLinear``.

    The loader swaps it in on the meta model when ``quantization_config`` says the module is
    quantized. Each checkpoint tensor name of the scheme (``weight_packed``, ``weight_scale``,
    ``weight_shape``, ``weight_zero_point``, ``weight_g_idx`` / ``qweight``, ``qzeros``,
    ``scales``, ``g_idx``) is an empty placeholder parameter whose ``weight_loader`` keeps the
    tensor of its shard as is (no dtype cast). Once every shard's tensors are in, the module
    unpacks each shard, concatenates them along the output dim (``concat_out``) and packs one
    :class:`~kvserve.layers.int4.linear.Int4Linear`: one INT4 GEMM per fused module, packed
    once. Placeholders and the raw tensors are dropped then. Shards whose act-order ``g_idx``
    differ cannot share a GEMM and get one Int4Linear each (outputs concatenated).

    ``shard_names`` maps shard id -> checkpoint module name (for error messages).
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: tuple[int, ...],
        shard_ids: tuple[str | None, ...],
        scheme: Int4Scheme,
        shard_names: dict[str | None, str],
        bias: torch.Tensor | None = None,
        *,
        tp_plan: TPPlan | None = None,
        full_in: int | None = None,
        full_out_sizes: tuple[int, ...] | None = None,
        reduce_results: bool = False,
    ) -> None:
        super().__init__()
        assert len(out_sizes) == len(shard_ids)
        self.in_features = in_features
        self.out_sizes = out_sizes
        self.shard_ids = shard_ids
        self.scheme = scheme
        # Tensor parallelism: each shard is unpacked at its checkpoint shape [full_out, full_in]
        # and then sliced (rows, or whole groups of columns) to this rank's [out, in].
        self.tp_plan = tp_plan or dict.fromkeys(shard_ids)
        self.full_in = full_in or in_features
        self.full_sizes = dict(zip(shard_ids, full_out_sizes or out_sizes, strict=True))
        self.reduce_results = reduce_results
        self.shard_names = shard_names
        self.offsets, self.sizes = shard_layout(out_sizes, shard_ids)
        required = scheme.required_tensors()
        self._eager = set(scheme.eager_tensors())
        # shard id -> tensor name -> checkpoint tensor, until built (then None)
        self._parts: dict[str | None, dict[str, torch.Tensor]] | None = {}
        for s in shard_ids:
            self._parts[s] = {}
        for tname in scheme.tensor_names:
            p = nn.Parameter(torch.empty(0, dtype=torch.int32, device="meta"),
                             requires_grad=False)
            p.weight_loader = functools.partial(self._load_part, tname)  # type: ignore[attr-defined]
            p.keep_dtype = True  # type: ignore[attr-defined]
            p.skip_expected = tname not in required  # type: ignore[attr-defined]
            self.register_parameter(tname, p)
        self.bias = loaded_bias(bias, self._load_bias)
        self.int4: nn.Module | None = None

    @classmethod
    def replacing(cls, module: nn.Module, scheme: Int4Scheme,
                  shard_names: dict[str | None, str]) -> Int4MergedLinear:
        """The INT4 module for a (meta) ``Linear`` or ``MergedLinear``."""
        tp = tp_geometry(module)
        if isinstance(module, MergedLinear):
            return cls(module.in_features, module.out_sizes, module.shard_ids, scheme,
                       shard_names, module.bias, **tp)
        if isinstance(module, Linear):
            return cls(module.in_features, (module.out_features,), (None,), scheme, shard_names,
                       module.bias, **tp)
        raise TypeError(f"cannot quantize {type(module).__name__}")

    # ---------------------------------------------------------------- loading

    def _load_part(self, tname: str, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: str | None = None) -> None:
        if shard_id not in self.sizes:
            raise ValueError(f"{self._ckpt(shard_id, tname)}: unknown shard {shard_id!r} "
                             f"(expected one of {self.shard_ids})")
        if self._parts is None:  # built already: only ignorable extras may still arrive
            if tname in self.scheme.ignorable_tensors():
                return
            raise ValueError(f"{self._ckpt(shard_id, tname)} arrived after the module was built")
        self._parts[shard_id][tname] = loaded
        if all(self._eager <= parts.keys() for parts in self._parts.values()):
            self.finish_loading()

    def _load_bias(self, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: str | None = None) -> None:
        sl = self.tp_plan[shard_id]
        if sl is not None:
            loaded = sl.take(loaded)  # column parallel: this rank's rows; row parallel: all
        off, size = self.offsets[shard_id], self.sizes[shard_id]
        dst = param.data.narrow(0, off, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"{self._ckpt(shard_id, 'bias')}: expected {tuple(dst.shape)}, "
                             f"got {tuple(loaded.shape)}")
        dst.copy_(loaded)

    def _ckpt(self, shard_id: str | None, tname: str) -> str:
        return f"{self.shard_names.get(shard_id, '?')}.{tname}"

    def finish_loading(self) -> None:
        """Unpack every shard and pack the Int4Linear(s); idempotent. The loader calls it after
        its missing-tensor check, for modules that were not complete earlier."""
        if self._parts is None:
            return
        weights = [self._unpack(s) for s in self.shard_ids]
        g_idx = [w.g_idx for w in weights]
        same = all((g is None) == (g_idx[0] is None) and (g is None or torch.equal(g, g_idx[0]))
                   for g in g_idx)
        terms = self.scheme.act_terms
        if same:
            self.int4 = Int4Linear(int4.concat_out(weights) if len(weights) > 1 else weights[0],
                                   act_terms=terms)
        else:
            self.int4 = nn.ModuleList(Int4Linear(w, act_terms=terms) for w in weights)
        self._parts = None
        for tname in self.scheme.tensor_names:
            delattr(self, tname)

    def _unpack(self, shard_id: str | None) -> int4.Int4Weight:
        assert self._parts is not None
        t = self._parts[shard_id]
        s = self.scheme
        missing = [n for n in s.required_tensors() if n not in t]
        if missing:
            raise ValueError(f"checkpoint is missing tensor(s): "
                             f"{', '.join(self._ckpt(shard_id, n) for n in missing)}")
        name = self.shard_names.get(shard_id, "?")
        try:
            w = s.unpack(t, (self.full_sizes[shard_id], self.full_in))
        except ValueError as e:
            raise ValueError(f"{name} ({s.describe()}): {e}") from None
        if self.tp_plan[shard_id] is not None:
            w = slice_int4(w, self.tp_plan[shard_id], name)
        want = (self.sizes[shard_id], self.in_features)
        if (w.out_features, w.in_features) != want:
            raise ValueError(f"{name}: INT4 weight is [{w.out_features}, {w.in_features}], the "
                             f"model expects {list(want)}")
        return w

    # ---------------------------------------------------------------- compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is None:
            raise RuntimeError(f"{self.shard_names}: INT4 weights were never loaded")
        if isinstance(self.int4, nn.ModuleList):
            y = torch.cat([m(x) for m in self.int4], dim=-1)
        else:
            y = self.int4(x)
        if self.reduce_results:
            y = tp_all_reduce(y)  # row parallel: partial sums; the bias below is added once
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @torch.no_grad()
    def dequantize(self) -> torch.Tensor:
        """The dense fp32 [sum(out_sizes), in] weight this module computes with."""
        if self.int4 is None:
            raise RuntimeError(f"{self.shard_names}: INT4 weights were never loaded")
        mods = list(self.int4) if isinstance(self.int4, nn.ModuleList) else [self.int4]
        return torch.cat([m.dequantize() for m in mods])

    def weight_bytes(self) -> int:
        """Bytes held for the weight (packed nibbles, scales/zeros, permutation) and bias."""
        mods = [] if self.int4 is None else (
            list(self.int4) if isinstance(self.int4, nn.ModuleList) else [self.int4])
        n = sum(m.weight_bytes() for m in mods)
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_sizes={self.out_sizes}, "
                f"shards={self.shard_ids}, scheme={self.scheme.describe()!r}")


def slice_int4(w: int4.Int4Weight, sl: ShardSlice, name: str) -> int4.Int4Weight:
    """This rank's part of an unpacked INT4 weight: rows (column parallel) or whole quant groups
    of columns (row parallel; a group never straddles two ranks)."""
    if sl.dim == 0:
        rows = slice(sl.start, sl.start + sl.size)
        return int4.Int4Weight(
            w.values[rows].contiguous(), w.scales[rows].contiguous(),
            None if w.zeros is None else w.zeros[rows].contiguous(), w.group_size, w.g_idx,
            None if w.mins is None else w.mins[rows].contiguous())
    gs = w.group_size
    if w.g_idx is not None and torch.equal(w.g_idx, torch.arange(w.in_features) // gs):
        w = int4.Int4Weight(w.values, w.scales, w.zeros, gs, None, w.mins)  # trivial g_idx
    cols = slice(sl.start, sl.start + sl.size)
    if w.scales.shape[1] == 1 and w.g_idx is None:  # channel-wise: every column shares it
        return int4.Int4Weight(w.values[:, cols].contiguous(), w.scales, w.zeros, sl.size,
                               None, w.mins)
    if w.g_idx is not None:
        raise ValueError(f"{name}: an act-order (g_idx) INT4 weight cannot be split by input "
                         "columns; use tensor_parallel_size=1")
    if sl.start % gs or sl.size % gs:
        raise ValueError(f"{name}: tensor_parallel_size splits its {w.in_features} input "
                         f"columns into shards of {sl.size}, not a multiple of the INT4 group "
                         f"size {gs}")
    g = slice(sl.start // gs, (sl.start + sl.size) // gs)
    return int4.Int4Weight(
        w.values[:, cols].contiguous(), w.scales[:, g].contiguous(),
        None if w.zeros is None else w.zeros[:, g].contiguous(), gs, None,
        None if w.mins is None else w.mins[:, g].contiguous())
