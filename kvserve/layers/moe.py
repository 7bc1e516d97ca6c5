"""Mixture-of-experts MLP: router + stacked experts + optional shared experts.

Routing (``TopKRouter``), as transformers computes it (fp32 scores):

* ``softmax`` (Qwen3-MoE): p = softmax(x W_g^T); ids = topk(p, k); w = p[ids]
  (renormalized to sum 1 when ``norm_topk_prob``).
* ``sigmoid`` (DeepSeek-V3 / Kimi K2 / GLM-4.5): s = sigmoid(x W_g^T) in fp32;
  choice = s + e_score_correction_bias (the bias steers *selection* only);
  grouped top-k: experts form ``n_group`` equal groups, a group scores the sum of its top-2
  ``choice`` values, only the best ``topk_group`` groups stay eligible; ids = topk(choice, k)
  over eligible experts; w = s[ids] (bias-free), / (sum + 1e-20) when ``norm_topk_prob``,
  then * ``routed_scaling_factor``.

Experts (``FusedMoE``) are stacked so each parameter is one tensor::

    w13 [E, 2*I, hidden]   rows [0, I) = gate_proj of expert e, rows [I, 2I) = up_proj
    w2  [E, hidden, I]     down_proj
    expert(x) = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x))

Checkpoints store them either per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what
transformers 5.x ``save_pretrained`` writes and what released checkpoints ship) or fused
(``mlp.experts.gate_up_proj`` [E, 2I, hidden] / ``mlp.experts.down_proj`` [E, hidden, I], the
in-memory layout of transformers 5.x). Both load through the parameters' weight loaders; see
``load_expert_tensor`` (called from a model's ``load_extra`` hook).

Evaluation on CPU: the T*k (token, slot) pairs are sorted by expert once; each active expert
runs one GEMM pair over its contiguous token group; results are scaled by the routing weights
and ``index_add_``-ed back. No Python loop over tokens.

INT4 checkpoints: ``Int4FusedMoE`` (kvserve/layers/int4/moe.py: per-expert ``ExpertMLP``
children whose gate_up_proj / down_proj the loader swaps for ``Int4MergedLinear``, i.e. one
``Int4Linear`` for gate+up and one for down per expert) replaces ``FusedMoE`` when
``quantization_config`` quantizes the experts; routing and dispatch (``dispatch_experts``) are
shared. Under tensor parallelism it splits like ``FusedMoE``: each expert's gate/up rows and
down columns (whole INT4 groups, checked up front) per rank, or, with expert parallelism, whole
experts per rank (``RemoteExpert`` placeholders stand for the others and their checkpoint
tensors are skipped unread).

INT4 hook (in-memory quantization): ``FusedMoE.use_expert_modules(w13_modules, w2_modules)``
swaps the dense stacked weights for per-expert modules (``nn.ModuleList`` of E modules each
mapping [..., in] -> [..., out], e.g. ``int4_experts_from_dense(moe.w13)`` from
``kvserve.layers.int4.linear``, likewise for ``w2``); the dense tensors are released and
dispatch calls ``modules[e](x_group)`` instead of ``F.linear(x_group, w[e])``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import (
    expert_parallel,
    get_tp_rank,
    get_tp_size,
    tp_all_reduce,
)
from kvserve.layers.linear import (
    Linear,
    MergedColumnParallelLinear,
    MergedLinear,
    RowParallelLinear,
    default_weight_loader,
)

logger = logging.getLogger(__name__)


class TopKRouter(nn.Module):
    """Gate linear [E, hidden] + top-k selection; ``forward(x [T, hidden])`` returns
    (weights [T, k] fp32, ids [T, k] int64)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        scoring: str = "softmax",
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        n_group: int | None = None,
        topk_group: int | None = None,
        correction_bias: bool = False,
        fp32_weight: bool = False,
    ) -> None:
        super().__init__()
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE scoring function {scoring!r}")
        n_group = n_group or 1
        topk_group = topk_group or n_group
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"bad expert grouping: {num_experts} experts, n_group {n_group}, "
                             f"topk_group {topk_group}")
        if top_k > num_experts // n_group * topk_group:
            raise ValueError(f"top_k {top_k} exceeds the experts in {topk_group} group(s)")
        self.num_experts, self.top_k, self.scoring = num_experts, top_k, scoring
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group
        # HF keeps sigmoid routers (gate.weight, e_score_correction_bias) in fp32 whatever the
        # model dtype (``_keep_in_fp32_modules_strict``); softmax routers use the model dtype.
        wdtype = torch.float32 if fp32_weight else None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=wdtype),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.e_score_correction_bias = None
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            self.e_score_correction_bias.weight_loader = (  # type: ignore[attr-defined]
                default_weight_loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scoring == "softmax":
            logits = F.linear(x, self.weight)  # [T, E] model dtype, as HF
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(logits.dtype).float(), ids
        logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
        scores = logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else (
            scores + self.e_score_correction_bias)
        ids = grouped_topk(choice, self.top_k, self.n_group, self.topk_group)
        weights = scores.gather(1, ids)  # bias-free scores of the chosen experts
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


def grouped_topk(choice: torch.Tensor, top_k: int, n_group: int, topk_group: int
                 ) -> torch.Tensor:
    """choice [T, E] -> ids [T, top_k] of the best experts inside the best ``topk_group`` of
    ``n_group`` equal groups (a group scores the sum of its top-2 members)."""
    t, e = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(t, n_group, e // n_group)  # [T, G, E/G]
        group_scores = grouped.topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)  # [T, G]
        keep = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.unsqueeze(-1).expand_as(grouped).reshape(t, e),
                                    float("-inf"))
    return torch.topk(choice, top_k, dim=-1, sorted=False)[1]


class FusedMoE(nn.Module):
    """Stacked experts ``w13 [E, 2I, hidden]``, ``w2 [E, hidden, I]`` (SiLU-gated MLPs).

    Tensor parallel (tp > 1), two layouts; the router runs replicated on every rank and every
    rank already holds every token (the attention's row-parallel all-reduce replicated them:
    the "all-gather tokens" step of EP is the identity here), so each rank computes a partial
    output and one all-reduce sums them:

    * split (default): every expert on every rank, its MLP split like a dense one:
      w13 [E, 2 I/tp, hidden] (rank r's gate rows and up rows), w2 [E, hidden, I/tp].
    * expert parallel (``enable_expert_parallel``): rank r holds experts
      [r E/tp, (r + 1) E/tp) whole, w13 [E/tp, 2I, hidden]; pairs routed to other ranks'
      experts contribute zero here. (No all-to-all: gloo has none on CPU.)
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        tp, r = get_tp_size(), get_tp_rank()
        self.ep = tp > 1 and expert_parallel()
        self.split = tp > 1 and not self.ep
        self.reduce_results = tp > 1
        self.full_intermediate = intermediate
        local = num_experts // tp if self.ep else num_experts
        self.expert_lo, self.num_local = (r * local if self.ep else 0), local
        if self.split:
            intermediate //= tp
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate, hidden),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden, intermediate),
                               requires_grad=False)
        self.w13.weight_loader = self._load  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load  # type: ignore[attr-defined]
        # (expert, kind) shards copied in so far per parameter, for the completeness check.
        self.loaded_shards: dict[str, set[tuple[int, str]]] = {"w13": set(), "w2": set()}
        # Optional per-expert modules replacing the dense weights (INT4 hook, module docstring).
        self.w13_modules: nn.ModuleList | None = None
        self.w2_modules: nn.ModuleList | None = None

    # ---- loading ----------------------------------------------------------------------------
    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        """shard_id: (expert, "gate" | "up" | "down") for a per-expert [out, in] tensor, or
        (None, "gate_up" | "down") for a fused [E, out, in] tensor."""
        expert, kind = shard_id
        i = self.intermediate
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (num_experts {self.num_experts})")
        lo, hi = self.expert_lo, self.expert_lo + self.num_local
        if expert is not None and not lo <= expert < hi:
            self.loaded_shards["w2" if kind == "down" else "w13"].add((expert, kind))
            return  # expert parallel: another rank's expert
        loaded = self._tp_slice(loaded, expert, kind)
        if expert is None:
            dst = param.data
        elif kind == "gate":
            dst = param.data[expert - lo, :i]
        elif kind == "up":
            dst = param.data[expert - lo, i:]
        else:
            dst = param.data[expert - lo]
        if dst.shape != loaded.shape:
            raise ValueError(f"expert tensor {shard_id}: expected {tuple(dst.shape)}, got "
                             f"{tuple(loaded.shape)}")
        dst.copy_(loaded)
        seen = self.loaded_shards["w2" if kind == "down" else "w13"]
        if expert is None:
            kinds = ("gate", "up") if kind == "gate_up" else ("down",)
            seen.update((e, k) for e in range(self.num_experts) for k in kinds)
        else:
            seen.add((expert, kind))

    def _tp_slice(self, t: torch.Tensor, expert: int | None, kind: str) -> torch.Tensor:
        """This rank's part of a checkpoint expert tensor (per expert [out, in] or fused
        [E, out, in]): its experts (expert parallel) or its rows / columns (split)."""
        if expert is None and self.ep:
            t = t[self.expert_lo : self.expert_lo + self.num_local]
        if not self.split:
            return t
        i, full = self.intermediate, self.full_intermediate
        start = get_tp_rank() * i
        d = 0 if expert is not None else 1  # the out dim
        if kind == "down":  # [.., hidden, I]: this rank's input columns
            return t.narrow(d + 1, start, i)
        if kind == "gate_up":  # fused [E, 2I, hidden]: rank's gate rows, then its up rows
            return torch.cat((t.narrow(1, start, i), t.narrow(1, full + start, i)), dim=1)
        return t.narrow(d, start, i)  # gate or up [I, hidden]

    def fully_loaded(self, which: str) -> bool:
        """Every expert's shards of ``which`` ("w13" or "w2") have been loaded."""
        return len(self.loaded_shards[which]) == self.num_experts * (1 if which == "w2" else 2)

    def use_expert_modules(self, w13_modules: nn.ModuleList, w2_modules: nn.ModuleList) -> None:
        """INT4 hook: compute expert e as ``w2_modules[e](act(w13_modules[e](x)))``; the dense
        stacked weights are released (each module maps [..., in] -> [..., out])."""
        if len(w13_modules) != self.num_experts or len(w2_modules) != self.num_experts:
            raise ValueError(f"need {self.num_experts} modules for w13 and for w2")
        self.w13_modules, self.w2_modules = w13_modules, w2_modules
        dev = self.w13.device
        self.w13 = nn.Parameter(torch.empty(0, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, device=dev), requires_grad=False)

    # ---- compute ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights [T, k] fp32, ids [T, k] -> [T, hidden] in x's dtype."""
        lo = self.expert_lo
        out = dispatch_experts(x, weights, ids, self.num_experts,
                               lambda e, xe: self._run_expert(e - lo, xe),
                               local=(lo, lo + self.num_local) if self.ep else None)
        return tp_all_reduce(out) if self.reduce_results else out  # sum of the ranks' parts

    def _run_expert(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        """Expert e on its routed rows: xe [n, hidden] -> [n, hidden]."""
        i = self.intermediate
        w13 = self.w13_modules
        h = w13[e](xe) if w13 is not None else F.linear(xe, self.w13[e])  # [n, 2I]
        h = F.silu(h[:, :i]) * h[:, i:]
        return self.w2_modules[e](h) if self.w2_modules is not None else F.linear(h, self.w2[e])


def dispatch_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     num_experts: int, run_expert: Callable[[int, torch.Tensor], torch.Tensor],
                     local: tuple[int, int] | None = None) -> torch.Tensor:
    """Routed MoE evaluation shared by the dense and the INT4 expert layers.

    x [T, hidden], weights [T, k] fp32, ids [T, k] int64 -> [T, hidden] in x's dtype.
    ``run_expert(e, xe [n, hidden]) -> [n, hidden]`` is called once per expert that received
    n > 0 (token, slot) pairs, on those rows only (contiguous after one stable sort).
    ``local`` = [lo, hi): only those experts run (expert parallel); other pairs add zero.
    """
    t, k = ids.shape
    out = torch.zeros_like(x)
    if t == 0:
        return out
    flat = ids.reshape(-1)  # [T*k] expert of each (token, slot) pair
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    token = order // k  # [T*k] token of each sorted pair
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs = x.index_select(0, token)  # [T*k, hidden], grouped by expert
    ys = torch.empty_like(xs) if local is None else torch.zeros_like(xs)
    lo, hi = local if local is not None else (0, num_experts)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        if lo <= e < hi:
            ys[start : start + n] = run_expert(e, xs[start : start + n])
        start += n
    w = weights.reshape(-1)[order].unsqueeze(1)  # [T*k, 1] fp32 routing weight per pair
    out.index_add_(0, token, (ys.float() * w).to(x.dtype))
    return out


class ExpertMLP(nn.Module):
    """One routed expert as its own modules, named like the checkpoint's per-expert tensors:
    ``gate_up_proj`` [2I, hidden] (rows [0, I) gate_proj, [I, 2I) up_proj: one GEMM, the w13
    slice of ``FusedMoE``) and ``down_proj`` [hidden, I] (w2). The loader swaps each for an
    ``Int4MergedLinear`` (one ``Int4Linear``) when ``quantization_config`` quantizes it.

    ``split`` (tensor parallel without expert parallelism): this rank's I/tp gate rows and up
    rows (column parallel) and I/tp down columns (row parallel, whole INT4 groups), the down
    output a partial sum that the MoE layer all-reduces once for all its experts."""

    def __init__(self, hidden: int, intermediate: int, split: bool = False) -> None:
        super().__init__()
        self.gate_up_proj: nn.Module
        self.down_proj: nn.Module
        if split:
            self.gate_up_proj = MergedColumnParallelLinear(
                hidden, (intermediate, intermediate), ("gate", "up"))
            self.down_proj = RowParallelLinear(intermediate, hidden, reduce_results=False)
            intermediate //= get_tp_size()
        else:
            self.gate_up_proj = MergedLinear(hidden, (intermediate, intermediate),
                                             ("gate", "up"))
            self.down_proj = Linear(intermediate, hidden)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden] in x's dtype."""
        h = self.gate_up_proj(x)  # [n, 2I]
        i = self.intermediate
        return self.down_proj(F.silu(h[:, :i]) * h[:, i:])


class RemoteExpert(nn.Module):
    """Expert parallel: stands in (no parameters) for an expert another rank holds, so the
    local experts keep their checkpoint names (``experts.<e>``)."""


class SparseMoeBlock(nn.Module):
    """``gate`` (router) + ``experts`` (``FusedMoE``, or the loader's ``Int4FusedMoE`` for an
    INT4 checkpoint: ``forward(x, weights, ids)`` either way) + optional ``shared_experts`` (a
    dense MLP on every token, added to the routed output). Module names follow HF
    checkpoints."""

    def __init__(self, router: TopKRouter, experts: nn.Module,
                 shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = router
        self.experts = experts
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def deepseek_style_moe(config, shared_mlp: Callable[[int, int], nn.Module]) -> SparseMoeBlock:
    """Sigmoid router with correction bias + grouped top-k, stacked experts, shared experts
    (the block of DeepSeek-V3, Kimi K2 and GLM-4.5). ``shared_mlp(hidden, intermediate)``
    builds the model's dense MLP for the shared experts."""
    n_experts = config.n_routed_experts
    router = TopKRouter(
        config.hidden_size, n_experts, config.num_experts_per_tok, scoring="sigmoid",
        norm_topk_prob=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor),
        n_group=config.n_group, topk_group=config.topk_group, correction_bias=True,
        fp32_weight=True,
    )
    experts = FusedMoE(n_experts, config.hidden_size, config.moe_intermediate_size)
    shared = None
    if getattr(config, "n_shared_experts", 0):
        shared = shared_mlp(config.hidden_size,
                            config.moe_intermediate_size * config.n_shared_experts)
    return SparseMoeBlock(router, experts, shared)


def check_activation(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} for MoE experts (silu only)")


# ---- checkpoint plumbing shared by the MoE models -------------------------------------------
_PER_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<kind>gate|up|down)_proj"
                         r"\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<kind>gate_up_proj|down_proj)(\.weight)?$")
_ANY_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(gate|up|down)_proj\.\w+$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def load_expert_tensor(model: nn.Module, name: str, handle, loaded: set) -> bool:
    """``load_extra`` body for MoE models: route expert tensors to ``experts.w13`` / ``w2``.

    Also swallows tensors of layers past ``num_hidden_layers`` (the multi-token-prediction
    layers DeepSeek-V3 / Kimi K2 / GLM-4.5 checkpoints ship; we do not run them).

    Completeness: the stacked parameter (e.g. ``...experts.w13``) is added to the loader's
    ``loaded`` set only once every expert's shards are in, so a checkpoint that misses one
    expert fails the loader's missing-tensor check naming the stacked parameter.
    """
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= model.config.num_hidden_layers:
        logger.debug("skipping %s (layer beyond num_hidden_layers: MTP)", name)
        return True
    if (m := _ANY_EXPERT.match(name)) is not None:
        try:
            expert = model.get_submodule(f"{m['prefix']}.experts.{m['e']}")
        except AttributeError:
            expert = None  # stacked experts (FusedMoE) have no per-expert modules
        if isinstance(expert, RemoteExpert):
            return True  # expert parallel: another rank holds this expert (not read here)
    if (m := _PER_EXPERT.match(name)) is not None:
        e, kind = int(m["e"]), m["kind"]
        pname = f"{m['prefix']}.experts.{'w2' if kind == 'down' else 'w13'}"
        shard: tuple[int | None, str] = (e, kind)
    elif (m := _FUSED.match(name)) is not None:
        kind = "gate_up" if m["kind"] == "gate_up_proj" else "down"
        pname = f"{m['prefix']}.experts.{'w2' if kind == 'down' else 'w13'}"
        shard = (None, kind)
    else:
        return False
    try:
        experts = model.get_submodule(pname.rsplit(".", 1)[0])
    except AttributeError:
        return False
    if not isinstance(experts, FusedMoE):  # per-expert modules: the loader's Int4FusedMoE
        raise ValueError(f"checkpoint tensor {name} is a dense expert weight, but "
                         f"quantization_config quantizes the experts of {m['prefix']} (INT4 "
                         "checkpoints store experts.<e>.<proj>.weight_packed / qweight; list "
                         "dense experts in 'ignore')")
    try:
        param = model.get_parameter(pname)
    except AttributeError:
        return False
    tensor = handle.get_tensor(name).to(param.dtype)
    param.weight_loader(param, tensor, shard)
    if experts.fully_loaded(pname.rsplit(".", 1)[1]):
        loaded.add((pname, None))
    return True
