"""Attention backends: the Protocol (``base.py``) plus a registry. Heavy backends import
lazily."""

from __future__ import annotations

import importlib

from kvserve.attention.base import AttentionBackend
from kvserve.cache.kv_cache import PagedKVCache

__all__ = ["AttentionBackend", "available_backends", "get_backend", "resolve_backend_name"]

_REGISTRY: dict[str, str] = {
    "cpu": "kvserve.attention.cpu_backend:CpuAttentionBackend",
    "triton": "kvserve.attention.triton_backend:TritonAttentionBackend",
    "mla_torch": "kvserve.attention.mla_torch:MlaTorchAttentionBackend",
    "mla_triton": "kvserve.attention.mla_triton:MlaTritonAttentionBackend",
}
# Old names still accepted: "torch" was the CPU backend (it runs the C kernel).
_ALIASES: dict[str, str] = {"torch": "cpu"}
# An MLA (latent) cache, components == 1, is served by the MLA member of a backend family.
_MLA_FAMILY: dict[str, str] = {"cpu": "mla_torch", "triton": "mla_triton"}


def available_backends() -> list[str]:
    return list(_REGISTRY)


def resolve_backend_name(name: str, kv_cache: PagedKVCache) -> str:
    """For an MLA cache (components == 1) ``cpu`` / ``triton`` -> ``mla_torch`` /
    ``mla_triton``; old names -> their new ones. ``auto`` is settled before this
    (``config.resolve_attention_backend``, by the builder)."""
    name = _ALIASES.get(name, name)
    if kv_cache.components == 1:
        name = _MLA_FAMILY.get(name, name)
    return name


def get_backend(
    name: str, kv_cache: PagedKVCache, num_heads: int, num_kv_heads: int, head_dim: int,
    scale: float, max_model_len: int,
) -> AttentionBackend:
    name = resolve_backend_name(name, kv_cache)
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {available_backends()} (or "
                         f"{', '.join(_ALIASES)}), got {name!r}")
    module, cls = _REGISTRY[name].split(":")
    backend_cls = getattr(importlib.import_module(module), cls)
    return backend_cls(kv_cache, num_heads, num_kv_heads, head_dim, scale, max_model_len)
