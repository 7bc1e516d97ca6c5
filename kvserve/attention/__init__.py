"""Attention backends: the Protocol (``base.py``) plus a registry. Heavy backends import
lazily."""

from __future__ import annotations

import importlib

from kvserve.attention.base import AttentionBackend
from kvserve.cache.kv_cache import PagedKVCache

__all__ = ["AttentionBackend", "available_backends", "get_backend", "kv_writer",
           "resolve_backend_name"]

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


def _resolve(name: str, components: int) -> str:
    name = _ALIASES.get(name, name)
    if components == 1:
        name = _MLA_FAMILY.get(name, name)
    return name


def resolve_backend_name(name: str, kv_cache: PagedKVCache) -> str:
    """For an MLA cache (components == 1) ``cpu`` / ``triton`` -> ``mla_torch`` /
    ``mla_triton``; old names -> their new ones. ``auto`` is settled before this
    (``config.resolve_attention_backend``, by the builder)."""
    return _resolve(name, kv_cache.components)


def _backend_class(name: str) -> type[AttentionBackend]:
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {available_backends()} (or "
                         f"{', '.join(_ALIASES)}), got {name!r}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def kv_writer(name: str, components: int) -> str:
    """The KV writer (``kvserve.cache.kv_cache.KV_WRITERS``) to build the cache with for
    backend ``name`` over a cache of ``components`` (2: K/V, 1: MLA latent): ``triton`` for
    the Triton family, ``c`` otherwise. Asked before the cache exists; the cache keeps it."""
    return _backend_class(_resolve(name, components)).kv_writer


def get_backend(
    name: str, kv_cache: PagedKVCache, num_heads: int, num_kv_heads: int, head_dim: int,
    scale: float, max_model_len: int, layer_windows: tuple[int, ...] = (),
) -> AttentionBackend:
    """``layer_windows``: per layer, 0 (full causal attention) or its sliding window
    (``KVSpec.layer_windows``; empty: every layer full)."""
    backend_cls = _backend_class(resolve_backend_name(name, kv_cache))
    if any(layer_windows):
        if not backend_cls.windowed:
            raise ValueError(f"attention_backend {name!r} has no sliding-window layers")
        return backend_cls(kv_cache, num_heads, num_kv_heads, head_dim, scale, max_model_len,
                           layer_windows=tuple(layer_windows))
    return backend_cls(kv_cache, num_heads, num_kv_heads, head_dim, scale, max_model_len)
