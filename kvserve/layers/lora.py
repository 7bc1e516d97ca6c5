"""Multi-LoRA linears: a base linear (dense, merged, INT4, GGUF integer-dot: whatever the
loader built) with per-slot adapters on top, applied by the grouped LoRA GEMM.

A model serving LoRA has its target linears wrapped (kvserve.model.lora.wrap_for_lora) in
``LoRALinear``; each holds ``max_loras`` slots. A fused linear of several checkpoint
projections (q/k/v, gate/up) keeps one rank block per shard, so one kernel call serves all::

    a [S, n_shards * R, K]     rows [i*R, i*R + r)              <- shard i's lora_A [r, K]
    bt [S, n_shards * R, N]    rows [i*R, i*R + r), cols off_i.. <- shard i's lora_B^T [r, n_i]
    scale [S]                  the slot's alpha / r (or alpha / sqrt(r), rsLoRA)
    noff [n_shards + 1]        the shards' output offsets (off_i), int64

(zeros elsewhere: a smaller rank, a shard or a module the adapter does not target; the kernels
read only each shard's own block of ``bt``). The step says which slot each token row uses
through ``LoRAStep``, passed explicitly down the forward (``ForwardBatch.lora``); nothing is
kept in module state between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import lora_gemm as cpu_lora


@dataclass(frozen=True, slots=True)
class LoRAStep:
    """One step's adapters: ``idx`` int64 [T] on the model's device, each token row's slot
    (-1: the base model alone); ``slots`` the slots the step uses, or None while a decode graph
    records: every wrapped linear then runs the kernel whatever its slots hold now (adapters
    loaded later are read by the replays; ``idx`` is the graph's input buffer)."""

    idx: torch.Tensor
    slots: frozenset[int] | None


def lora_gemm_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               idx: torch.Tensor, scale: torch.Tensor, noff: torch.Tensor) -> torch.Tensor:
    """``y += lora_delta(x, a, bt, idx, scale, noff)``: the C kernel on CPU (fp32), the Triton
    kernel on CUDA, else the twin."""
    if y.is_cuda:
        from kvserve.kernels.triton.lora import lora_gemm_ as triton_lora

        return triton_lora(y, x, a, bt, idx, scale, noff)
    lib = cpu_lora.load()
    if lib is not None and cpu_lora.applies(y, x, a):
        return cpu_lora.lora_gemm_(lib, y, x, a, bt, idx, scale, noff)
    y += ref.lora_delta(x, a, bt, idx, scale, noff).to(y.dtype)
    return y


class LoRALinear(nn.Module):
    """``base(x)`` plus each row's adapter delta (see the module docstring for the layout)."""

    def __init__(self, base: nn.Module, in_features: int, out_sizes: tuple[int, ...],
                 max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_sizes, self.max_rank = in_features, out_sizes, max_rank
        self.offsets = tuple(sum(out_sizes[:i]) for i in range(len(out_sizes)))
        r = len(out_sizes) * max_rank
        n = sum(out_sizes)
        self.register_buffer("lora_a", torch.zeros(max_loras, r, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, r, n, dtype=dtype, device=device),
                             persistent=False)  # lora_B transposed: [S, R, N]
        self.register_buffer("lora_scale", torch.zeros(max_loras, dtype=torch.float32,
                                                       device=device), persistent=False)
        self.register_buffer("lora_noff", torch.tensor((*self.offsets, n), dtype=torch.int64,
                                                       device=device), persistent=False)
        self.active = [False] * max_loras  # slot holds an adapter that targets this linear

    def set_slot(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 scale: float) -> None:
        """Load one adapter into ``slot``: ``shards`` maps a shard index to its (lora_A [r, K],
        lora_B [n_i, r]); shards it lacks stay zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        R = self.max_rank
        for i, (a, b) in shards.items():
            r = a.shape[0]
            assert a.shape == (r, self.in_features) and b.shape == (self.out_sizes[i], r)
            assert r <= R
            self.lora_a[slot, i * R : i * R + r].copy_(a)
            off = self.offsets[i]
            self.lora_b[slot, i * R : i * R + r, off : off + self.out_sizes[i]].copy_(b.t())
        self.lora_scale[slot] = scale
        self.active[slot] = bool(shards)

    def clear_slot(self, slot: int) -> None:
        self.set_slot(slot, {}, 0.0)

    def forward(self, x: torch.Tensor, lora: LoRAStep | None = None) -> torch.Tensor:
        y = self.base(x)
        if lora is None or (lora.slots is not None
                            and not any(self.active[s] for s in lora.slots)):
            return y
        return lora_gemm_(y, x, self.lora_a, self.lora_b, lora.idx, self.lora_scale,
                          self.lora_noff)


def with_lora(module: nn.Module, x: torch.Tensor, lora: LoRAStep | None) -> torch.Tensor:
    """``module(x)``, passing the step's adapters to a LoRA-wrapped linear."""
    return module(x) if lora is None else module(x, lora)
