"""Start-up: ``EngineArgs`` + checkpoint -> the frozen ``EngineConfig`` and the wired parts of
an engine (executor and model, tokenizer, block pool, integrity checker, KV manager,
scheduler, runner). Every ``auto`` and every cross-check is decided here, once, from the
checkpoint's config before any worker starts (``settle``); the workers load the weights and
report the one thing they measure, the KV block count. The engine itself only drives the
parts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvserve import cbuild
from kvserve.cache.block_pool import BlockPool
from kvserve.cache.integrity import IntegrityChecker
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_connector import load_connector
from kvserve.cache.kv_events import KVEventPublisher
from kvserve.cbuild import cpu_kind, kernel_build
from kvserve.config import (
    EngineConfig,
    ModelConfig,
    dtype_name,
    resolve_attention_backend,
    resolve_bf16_dot_rows,
    resolve_checkpoint_kv_mode,
    resolve_max_model_len,
)
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.executor import Executor, MultiprocExecutor, make_executor
from kvserve.engine.lora_manager import LoRAManager
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.step_runner import StepRunner
from kvserve.engine.worker import WorkerConfig
from kvserve.kernels.cpu import kq_gemm, w16_gemm, wq_gemm
from kvserve.model import registry
from kvserve.model.default_model import resolve_model
from kvserve.model.loader import (
    checkpoint_dtype,
    checkpoint_dtypes,
    describe_weight_bytes,
    eos_token_ids,
    load_tokenizer,
)
from kvserve.model.parallel_check import validate_parallel
from kvserve.model.sources import load_hf_config, model_source

logger = logging.getLogger("kvserve")


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What ``LLMEngine`` drives. The executor owns the model: in this process (tp=1) or over
    tp ranks, rank 0 (the driver) here."""

    args: EngineArgs
    config: EngineConfig
    executor: Executor
    tokenizer: Any  # a transformers tokenizer
    pool: BlockPool
    integrity: IntegrityChecker | None
    kv_manager: KVCacheManager
    scheduler: Scheduler
    runner: StepRunner
    kv_events: KVEventPublisher | None = None  # the pool's event sink (--kv-events-endpoint)


_EXTRA_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # named in the CPU path's log line


def describe_cpu_path(compute: torch.dtype, storage: torch.dtype) -> str:
    """The start-up log's 'CPU path: <kind> (+flags); activations <dtype>, dense weights
    <dtype>; <what computes them>' (kinds: kvserve.cbuild.CPU_KINDS)."""
    flags = cbuild.cpu_flags()
    extras = [f for f in _EXTRA_FLAGS if f in flags]
    head = f"CPU path: {cpu_kind(flags)}" + (f" (+{', '.join(extras)})" if extras else "")
    dtypes = f"activations {dtype_name(compute)}, dense weights {dtype_name(storage)}"
    lib = w16_gemm.w16_library()
    if lib is None:
        return f"{head}; {dtypes}; C kernels off (no C compiler, or KVSERVE_CPU_KERNEL=0)"
    if compute != torch.float32:
        return (f"{head}; {dtypes}; torch computes the dense layers in {dtype_name(compute)} "
                "(asked for: no C GEMM, no decode graph)")
    if storage in w16_gemm.KINDS:
        rows = w16_gemm.bf16_dot_rows(lib) if storage == torch.bfloat16 else 0
        unit = "AMX tiles" if w16_gemm.has_amx(lib) else "vdpbf16ps"
        dot = ("fp32 dot products" if not rows
               else f"bf16 dot products ({unit}) for every row (batch-invariant)" if rows == 1
               else f"bf16 dot products ({unit}) for GEMMs of >= {rows} rows, fp32 below")
        if not rows and storage == torch.bfloat16 and w16_gemm.has_bf16_dot(lib):
            dot += " (bf16 dot products available: --cpu-bf16-dot-rows 1, docs/cpu.md)"
        dense = f"16-bit GEMM with {dot}"
    else:
        dense = "torch's fp32 GEMM for the fp32 weights"
    build = kernel_build()
    built = "-march=native" if build == "native" else f"KVSERVE_CPU_BUILD={build}"
    gguf = "integer-dot GGUF GEMM" + gguf_amx_note()
    return (f"{head}; {dtypes}; C kernels ({built}): {dense}, {gguf}, "
            "fused small ops, paged attention")


def gguf_amx_note() -> str:
    """The start-up log's note on the GGUF GEMMs' AMX-INT8 tiles: from how many rows Q4 / Q8
    (wq_gemm) and the K-quants (kq_gemm) take them; "" where neither does."""
    libs = (("", wq_gemm.wq_library()), ("K-quants ", kq_gemm.kq_library()))
    rows = [(name, wq_gemm.amx_rows(lib)) for name, lib in libs if lib is not None]
    parts = [f"{name}from {r} rows" for name, r in rows if r]
    return f" (AMX-INT8 tiles {', '.join(parts)})" if parts else ""


def settle(args: EngineArgs) -> WorkerConfig:
    """Every ``auto`` and every setting that needs no weights, settled once from the arguments
    and the checkpoint's config (no weight read), before any worker starts: every rank, a
    headless node's too, then builds from the same values. User errors (a ValueError naming
    the parameter) surface here."""
    cache_cfg, sched_cfg = args.cache_config(), args.scheduler_config()
    args = dataclasses.replace(args, attention_backend=resolve_attention_backend(
        args.attention_backend, args.device))
    path = resolve_model(args.model)
    # tensor parallelism: heads, intermediate size, INT4 groups (clear errors, no process yet)
    validate_parallel(path, args.tensor_parallel_size, args.enable_expert_parallel)
    transfer = args.transfer_config()
    if cache_cfg.kv_connector is not None:
        load_connector(cache_cfg.kv_connector)  # ValueError naming kv_connector
    if transfer is not None and transfer.transport != "dir" and args.tensor_parallel_size > 1:
        raise ValueError(f"kv_transfer {transfer.transport} is not supported with "
                         "tensor_parallel_size > 1: use kv_transfer dir (each rank writes and "
                         "reads its own slice; docs/disaggregation.md)")
    folder, ggml = model_source(path)  # a GGUF's converted metadata: config.json, tokenizer
    hf_config, arch = load_hf_config(folder)
    dtypes = checkpoint_dtypes(folder, ggml, hf_config, args.dtype, args.device)
    lib = w16_gemm.w16_library()
    rows, rows_note = resolve_bf16_dot_rows(
        args.cpu_bf16_dot_rows, dtypes, args.device, cpu_kind(),
        built=lib is not None and bool(getattr(lib, "bf16_dot_built", False)),
        env=os.environ.get("KVSERVE_CPU_BF16_ROWS"))
    args = dataclasses.replace(args, cpu_bf16_dot_rows=rows)  # every rank runs the same dots
    kv_mode = resolve_checkpoint_kv_mode(args.kv_cache_dtype, args.dtype,
                                         checkpoint_dtype(hf_config), args.device)
    # rank 0's heads under tensor parallelism; the rest of the spec is the same on every rank
    spec = registry.resolve(arch).spec_for(hf_config, args.tensor_parallel_size, 0)
    if kv_mode.rotate and spec.components != 2 and spec.kv_lora_rank is None:
        raise ValueError(f"kv_cache_dtype {cache_cfg.kv_cache_dtype!r} (rotated) needs a "
                         "model that folds the rotation into its latent up-projection")
    model = ModelConfig(
        path=path, architecture=arch, dtype=dtypes.compute, vocab_size=hf_config.vocab_size,
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        kv_components=spec.components,
        max_model_len=resolve_max_model_len(sched_cfg.max_model_len, spec.context_len),
        eos_token_ids=eos_token_ids(folder),
    )
    lora_dtype = None  # LoRA off
    if args.enable_lora:
        lora_dtype = resolve_lora_dtype(args.lora_dtype, dtypes.compute, args.device)
    return WorkerConfig(args, model, dtypes, cache_cfg, sched_cfg, kv_mode,
                        cache_cfg.kv_rotation_seed if kv_mode.rotate else None,
                        spec.context_len, transfer, lora_dtype, rows_note)


def resolve_lora_dtype(lora_dtype: str, compute: torch.dtype, device: str) -> torch.dtype:
    """The adapter slots' dtype. ``auto``: bfloat16 on CPU (the C kernel widens it to fp32
    exactly as it reads it, and a mixed decode step streams half the bytes; greedy tokens and
    logprobs against fp32 adapters in docs/server.md), the compute dtype elsewhere (vLLM's
    auto: the model's)."""
    if lora_dtype != "auto":
        return getattr(torch, lora_dtype)
    return torch.bfloat16 if torch.device(device).type == "cpu" else compute


def build_engine(args: EngineArgs) -> EngineParts:
    settled = settle(args)
    args, cache_cfg, sched_cfg = settled.args, settled.cache, settled.scheduler
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    executor = make_executor(settled)
    worker = executor.driver
    budget = worker.budget  # the one value the workers measure (the min over TP ranks)
    block_size = cache_cfg.block_size
    # config.json + tokenizer live in loaded.folder (a GGUF's converted metadata)
    tokenizer = load_tokenizer(args.tokenizer or worker.loaded.folder)
    model_config = dataclasses.replace(settled.model, bos_token_id=tokenizer.bos_token_id)
    kv_cache = worker.kv_cache  # rank 0's slice (its KV heads) under TP
    config = EngineConfig(model=model_config, cache=cache_cfg, scheduler=sched_cfg,
                          kv_mode=settled.kv_mode, num_blocks=budget.num_blocks,
                          fingerprint=worker.fingerprint,
                          tensor_parallel_size=args.tensor_parallel_size)
    kv_events = None
    if args.kv_events_endpoint:
        kv_events = KVEventPublisher(
            args.kv_events_endpoint, block_size=block_size,
            medium="GPU" if kv_cache.data.is_cuda else "CPU",
            replay_endpoint=args.kv_events_replay_endpoint, topic=args.kv_events_topic,
            fmt=args.kv_events_format)
        logger.info("publishing KV events on %s", kv_events.endpoint)
    pool = BlockPool(budget.num_blocks, event_sink=kv_events)
    integrity = None
    if cache_cfg.kv_integrity != "off":
        peers = executor if isinstance(executor, MultiprocExecutor) else None
        integrity = IntegrityChecker(kv_cache, pool, config.fingerprint, cache_cfg.kv_integrity,
                                     cache_cfg.scrub_blocks_per_step, peers=peers)
    # each rank builds its own (executor.worker_main); rank 0 announces what they hold
    connectors = worker.build_connectors(
        executor if isinstance(executor, MultiprocExecutor) else None)
    for c in connectors.values():
        c.events = kv_events
    kv_manager = KVCacheManager(pool, block_size, cache_cfg.enable_prefix_caching,
                        config.fingerprint, integrity, list(connectors.values()))
    lora = None
    if worker.lora_linears is not None:
        lora = LoRAManager(worker.lora_linears, worker.model.config, args.max_loras,
                           args.max_lora_rank)
        for name, path in args.lora_module_paths().items():
            lora.add(name, path, param=f"lora_modules {name}")
    scheduler = Scheduler(sched_cfg, kv_manager, args.max_loras if lora is not None else 0)
    worker.init_model_runner()
    runner = StepRunner(executor, block_size, model_config.kv_components,
                         model_config.vocab_size, model_config.eos_token_ids, lora)
    tp = args.tensor_parallel_size
    logger.info("model %s (%s, %s): %s%s", model_config.path, model_config.architecture,
                dtype_name(model_config.dtype), describe_weight_bytes(worker.model),
                f" on rank 0 of {tp} (tensor parallel)" if tp > 1 else "")
    if torch.device(args.device).type == "cpu":
        logger.info("%s", describe_cpu_path(model_config.dtype, settled.dtypes.storage))
        logger.info("cpu_bf16_dot_rows %d (%s)", args.cpu_bf16_dot_rows,
                    settled.bf16_dot_rows_note)
    logger.info("%s; max_model_len %d; %d B/token of KV; %s", kv_cache.describe(),
                model_config.max_model_len, kv_cache.bytes_per_token, budget.note)
    for c in connectors.values():
        logger.info("%s", c.describe())
    logger.info("ready in %.1f s", time.perf_counter() - t0)
    return EngineParts(args, config, executor, tokenizer, pool, integrity, kv_manager, scheduler,
                       runner, kv_events)
