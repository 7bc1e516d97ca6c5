"""The routed experts of an INT4 checkpoint (``Int4FusedMoE``): per-expert modules in place of
``FusedMoE``'s stacked dense weights, so the loader swaps each expert's projections for
``Int4MergedLinear`` like any other linear (``loading.swap_int4_modules``). Routing and dispatch
are ``kvserve.layers.moe``'s."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.distributed.parallel_state import (
    expert_parallel,
    get_tp_rank,
    get_tp_size,
    tp_all_reduce,
)
from kvserve.layers.int4.merged import Int4MergedLinear
from kvserve.layers.moe import ExpertMLP, FusedMoE, RemoteExpert, dispatch_experts


class Int4FusedMoE(nn.ModuleList):
    """Routed experts of an INT4 checkpoint: E ``ExpertMLP`` children named ``0`` .. ``E-1``,
    so parameter names are the checkpoint's (``mlp.experts.<e>.gate_up_proj.weight_packed`` <-
    ``mlp.experts.<e>.{gate,up}_proj.weight_packed`` through ``packed_modules``, like a dense
    MLP's gate/up). Same interface and routing arithmetic as ``FusedMoE`` (``forward(x,
    weights, ids)``, ``dispatch_experts``): only experts that received tokens run, each on its
    contiguous rows. Modules the config keeps dense (``ignore``) stay ``MergedLinear`` /
    ``Linear``; everything else is an ``Int4MergedLinear`` holding one ``Int4Linear`` per
    expert for gate+up (``concat_out``; two only if GPTQ act-order gave gate and up different
    ``g_idx``) and one for down.

    Built by ``replacing`` a meta ``FusedMoE`` (``kvserve.layers.int4.loading.swap_int4_modules``).

    Tensor parallel, as ``FusedMoE``: ``split`` experts (``ExpertMLP(split=True)``: rows and
    whole-group columns per rank) or expert parallel (rank r holds experts [lo, lo + n) as
    ``ExpertMLP``, the rest are ``RemoteExpert``); either way one all-reduce sums the ranks'
    partial outputs.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        """``intermediate``: the checkpoint's (full) moe_intermediate_size."""
        tp, r = get_tp_size(), get_tp_rank()
        ep = tp > 1 and expert_parallel()
        split = tp > 1 and not ep
        local = num_experts // tp if ep else num_experts
        lo = r * local if ep else 0
        super().__init__(ExpertMLP(hidden, intermediate, split) if lo <= e < lo + local
                         else RemoteExpert() for e in range(num_experts))
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.ep, self.expert_lo, self.num_local = ep, lo, local
        self.reduce_results = tp > 1

    @classmethod
    def replacing(cls, moe: FusedMoE) -> Int4FusedMoE:
        """Per-expert stand-in for ``moe`` on the meta device, in ``moe``'s dtype."""
        prev = torch.get_default_dtype()
        torch.set_default_dtype(moe.w13.dtype)
        try:
            with torch.device("meta"):
                return cls(moe.num_experts, moe.hidden, moe.full_intermediate)
        finally:
            torch.set_default_dtype(prev)

    def forward(self, x: torch.Tensor, weights: torch.Tensor,  # type: ignore[override]
                ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights [T, k] fp32, ids [T, k] -> [T, hidden] in x's dtype."""
        lo = self.expert_lo
        out = dispatch_experts(x, weights, ids, self.num_experts, lambda e, xe: self[e](xe),
                               local=(lo, lo + self.num_local) if self.ep else None)
        return tp_all_reduce(out) if self.reduce_results else out  # sum of the ranks' parts

    def weight_bytes(self) -> int:
        """Bytes of the expert weights held (INT4 packs, scales/zeros, dense leftovers)."""
        n = 0
        for expert in self:
            if not isinstance(expert, ExpertMLP):
                continue  # another rank's expert
            for mod in (expert.gate_up_proj, expert.down_proj):
                if isinstance(mod, Int4MergedLinear):
                    n += mod.weight_bytes()
                else:
                    n += sum(p.numel() * p.element_size() for p in mod.parameters())
        return n
