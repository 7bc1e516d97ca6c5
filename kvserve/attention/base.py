"""The attention-backend Protocol (what models, the runner and CUDA graphs may call) and
``BackendBase``, the defaults a backend overrides. Capabilities are declared, not probed:
``latent`` (serves an MLA latent cache through ``forward_mla``), ``cuda_graphs``
(``graph_plan`` can describe a decode step over static tensors) and ``windowed`` (takes
``layer_windows``: sliding-window layers read only their window); so is the KV writer a backend's
cache is built with (``kv_writer``, one of ``kvserve.cache.kv_cache.KV_WRITERS``: whoever builds
the cache asks the registry, ``kvserve.attention.kv_writer``).

Per-step planning: a backend turns the step's ``AttentionMetadata`` into a typed plan once
(the first layer) and keeps it in ``meta.cache[name]`` for the other layers."""

from __future__ import annotations

from typing import ClassVar, Generic, Protocol, TypeVar

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.kv_cache import PagedKVCache


class AttentionBackend(Protocol):
    name: ClassVar[str]
    latent: ClassVar[bool]
    cuda_graphs: ClassVar[bool]
    kv_writer: ClassVar[str]
    windowed: ClassVar[bool]  # takes ``layer_windows`` (sliding-window layers)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write k, v [T, Hkv, D] into the cache, attend q [T, Hq, D]; returns [T, Hq, D]."""
        ...

    def forward_mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                    latent: torch.Tensor, meta: AttentionMetadata,
                    kv_b_weight: torch.Tensor) -> torch.Tensor:
        """MLA: write ``latent`` [T, R + dr], attend; returns fp32 [T, H, dv]."""
        ...

    def graph_plan(self, meta: AttentionMetadata, tables: torch.Tensor, seq_lens: torch.Tensor,
                   slots: torch.Tensor, max_seq_len: int) -> None:
        """CUDA graphs: plan a decode step over static device tensors (tables int32 [B, MB],
        seq_lens int32 [B], slots int64 [B]) into ``meta``; refilled by the caller, never
        rebuilt."""
        ...


P = TypeVar("P")  # a backend's typed plan


class BackendBase(Generic[P]):
    """Defaults: a K/V backend (no ``forward_mla``) that cannot be graph-captured."""

    name: ClassVar[str] = "base"
    latent: ClassVar[bool] = False
    cuda_graphs: ClassVar[bool] = False
    windowed: ClassVar[bool] = False
    kv_writer: ClassVar[str] = "c"  # the C writer where it takes the rows, else its twin

    @classmethod
    def _check_writer(cls, kv_cache: PagedKVCache) -> None:
        """The cache was built with the writer this backend declares (a cache's writer is
        chosen when it is built, never swapped): the Triton backends check it, since the
        integrity checker seals from the fused writer's checksum state."""
        if kv_cache.writer != cls.kv_writer:
            raise ValueError(f"kv_cache: the {cls.name} backend needs a cache built with "
                             f"writer={cls.kv_writer!r}, got writer={kv_cache.writer!r}")

    def _plan(self, meta: AttentionMetadata) -> P:
        """This step's plan: built by the first layer that asks, kept in ``meta.cache``."""
        plan = meta.cache.get(self.name)
        if plan is None:
            plan = meta.cache[self.name] = self._build_plan(meta)
        return plan

    def _build_plan(self, meta: AttentionMetadata) -> P:
        raise NotImplementedError

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} serves MLA layers only: call forward_mla")

    def forward_mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                    latent: torch.Tensor, meta: AttentionMetadata,
                    kv_b_weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} serves K/V caches, not an MLA latent cache")

    def graph_plan(self, meta: AttentionMetadata, tables: torch.Tensor, seq_lens: torch.Tensor,
                   slots: torch.Tensor, max_seq_len: int) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be graph-captured")
