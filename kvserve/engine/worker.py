"""One rank of the engine: its model shard, its slice of the KV cache, its runner.

Every rank builds from the same ``WorkerConfig``, settled by the builder from the arguments and
the checkpoint's config before any worker starts (every ``auto``, the KV mode, max_model_len):
a rank only measures what needs its memory, the KV block count (``KVBudget``, the minimum over
ranks, agreed with an all-reduce), so block ids mean the same thing everywhere while each rank
stores only its own KV heads:

    rank r's cache  data [L, NB + 1, C, bs, H_r, D]     H_r = this rank's KV heads

``kv_cache_memory`` is a per-rank budget. Rank 0's ``Worker`` lives inside the engine (the
driver); ranks 1.. run ``worker_main`` (kvserve.engine.executor), a loop over the driver's
messages.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import torch

from kvserve.attention import get_backend, kv_writer
from kvserve.cache.block_store import StoreSpec, dtype_str
from kvserve.cache.kv_cache import PagedKVCache, bytes_per_block
from kvserve.cache.kv_connector import KVConnector, KVPeers, load_connector
from kvserve.cache.kv_tiers import KVTiers, TierConfig
from kvserve.cache.kv_transfer import IMPORT_THREADS, KVTransfer, TransferConfig
from kvserve.config import (
    CacheConfig,
    KVMode,
    ModelConfig,
    ModelDtypes,
    SchedulerConfig,
    dtype_name,
)
from kvserve.distributed import parallel_state as ps
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.cpu_graphs import CpuGraphRunner
from kvserve.engine.cuda_graphs import CudaGraphRunner, clear_scratch_block
from kvserve.engine.model_runner import DecodeGraphs, ModelRunner
from kvserve.engine.step_input import StepInput
from kvserve.kernels.cpu import w16_gemm
from kvserve.layers.linear import kv_head_layout
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.lora import check_lora_model, wrap_for_lora
from kvserve.quant.wq import activation_terms

logger = logging.getLogger("kvserve")

# Without kv_cache_memory: kv_cache_memory_fraction of available RAM, capped here (like
# vLLM-CPU's 4 GiB default KV space) so a small model does not zero-fill half the machine.
DEFAULT_MAX_KV_BYTES = 4 * 2**30


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What every rank builds from, settled once by the builder before any worker starts
    (kvserve.engine.builder.settle) from the arguments and the checkpoint's config, no weight
    read: no rank resolves an ``auto`` or rebuilds a config from ``args``."""

    args: EngineArgs  # with attention_backend and cpu_bf16_dot_rows settled
    # path: the checkpoint (None / "demo" resolved); num_kv_heads: rank 0's under TP;
    # bos_token_id: None here (the tokenizer's, filled in by the builder)
    model: ModelConfig
    dtypes: ModelDtypes  # dtype resolved: compute (= model.dtype) and dense weight storage
    cache: CacheConfig
    scheduler: SchedulerConfig  # max_model_len as given; the effective one is model's
    kv_mode: KVMode  # kv_cache_dtype resolved against the checkpoint
    rotation_seed: int | None  # rotated modes: the Hadamard rotation's seed, else None
    context_len: int  # the model's (model.max_model_len <= context_len)
    transfer: TransferConfig | None = None  # disaggregation's KV transfer (None: off)
    lora_dtype: torch.dtype | None = None  # the LoRA slots' weights (None: LoRA off)
    bf16_dot_rows_note: str = ""  # why args.cpu_bf16_dot_rows is what it is (the start-up log)


@dataclass(frozen=True, slots=True)
class KVBudget:
    """What only a worker can measure, reported once: the KV pool's block count (every rank
    holds the same block ids: the minimum over ranks) and how it was chosen."""

    num_blocks: int
    note: str


class Worker:
    def __init__(self, config: WorkerConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.args = args = config.args
        self.path = config.model.path
        assert isinstance(args.cpu_bf16_dot_rows, int), "the builder settles auto"
        w16_gemm.set_bf16_dot_rows(args.cpu_bf16_dot_rows)  # this process's 16-bit GEMMs
        self.loaded: LoadedModel = load_model(self.path, config.dtypes, args.device,
                                              progress=args.progress and rank == 0,
                                              act_terms=activation_terms(args.gguf_activations),
                                              int4_kernel=args.int4_cuda_kernel)
        self.model = self.loaded.model
        self.lora_linears = None  # LoRA: the wrapped linears, by (layer, name)
        if args.enable_lora:
            check_lora_model(self.model, world_size)
            assert config.lora_dtype is not None, "the builder settles lora_dtype"
            self.lora_linears = wrap_for_lora(self.model, args.max_loras, args.max_lora_rank,
                                              config.lora_dtype, args.device)
        self.spec = self.model.kv_spec()  # this rank's heads
        self._check_settled()
        self.budget = self._measure_kv_budget()
        spec = self.spec
        static = self.loaded.kv_scales
        if static is not None:
            static = static.unsqueeze(-1).expand(-1, -1, spec.num_kv_heads)
        mla = spec.components == 1
        split = (spec.kv_lora_rank, spec.head_dim - spec.kv_lora_rank) if mla else None
        self.kv_cache = PagedKVCache(
            spec.num_layers, self.budget.num_blocks, config.cache.block_size,
            spec.num_kv_heads, spec.head_dim, spec.components, config.kv_mode,
            args.device, static_scales=static, rotation_seed=config.rotation_seed,
            rotation_split=split,
            # rank 0 seals from the fused writer's state; other ranks recompute their slice
            checksums=config.cache.kv_integrity != "off" and rank == 0,
            writer=kv_writer(args.attention_backend, spec.components),  # chosen once, here
        )
        if mla and self.kv_cache.rotation is not None:
            # MLA: the latent's rotation is folded into kv_b_proj (W_UK / W_UV) once, here
            self.model.fold_kv_rotation(self.kv_cache.rotation)
        self.fingerprint = self._fingerprint()
        self.replica_key = self._replica_key()

    def init_model_runner(self) -> ModelRunner:
        """The attention backend and this rank's forward runner."""
        spec, args = self.spec, self.args
        backend = get_backend(args.attention_backend, self.kv_cache, spec.num_heads,
                              spec.num_kv_heads, spec.head_dim, spec.scale,
                              self.config.model.max_model_len,
                              layer_windows=spec.layer_windows)
        self.model_runner = ModelRunner(self.model, backend, self.config.cache.block_size,
                                  spec.components, args.device,
                                  graphs=self._decode_graphs(backend))
        return self.model_runner

    def execute(self, step: StepInput) -> list[torch.Tensor | None]:
        rows = self.args.cpu_bf16_dot_rows
        if w16_gemm.engine_bf16_dot_rows() != rows:  # another engine of this process set its own
            w16_gemm.set_bf16_dot_rows(rows)
        return self.model_runner.run(step)

    # ---- what only a worker knows ------------------------------------------------------------
    def _check_settled(self) -> None:
        """What this rank built matches what the builder settled from the same config.json
        (an internal invariant, not a user error)."""
        spec, m, dtypes = self.spec, self.config.model, self.config.dtypes
        built = (self.loaded.architecture, self.loaded.dtype, self.loaded.storage)
        assert built == (m.architecture, dtypes.compute, dtypes.storage), (built, m, dtypes)
        assert (spec.num_layers, spec.head_dim, spec.components, spec.context_len) == (
            m.num_layers, m.head_dim, m.kv_components, self.config.context_len), (spec, m)
        assert self.rank != 0 or spec.num_kv_heads == m.num_kv_heads, (spec, m)

    def _measure_kv_budget(self) -> KVBudget:
        """The KV block count for this rank's memory (the minimum over tensor-parallel ranks),
        measured once; everything else about the cache is settled."""
        cfg, spec = self.config, self.spec
        per_block = bytes_per_block(spec.num_layers, cfg.cache.block_size, spec.num_kv_heads,
                                    spec.head_dim, spec.components, cfg.kv_mode)
        n, note = num_kv_blocks(cfg.cache, per_block,
                                cfg.scheduler.max_num_seqs * cfg.model.max_model_len)
        if ps.get_tp_size() > 1:
            # every rank must hold the same block ids: the smallest pool wins
            agreed = int(ps.cpu_all_reduce_min(torch.tensor([n], dtype=torch.int64),
                                               startup=True)[0])
            if agreed != n:
                note += f"; {agreed} blocks agreed over {ps.get_tp_size()} ranks (min)"
            n = agreed
            note += " (per rank)"
        return KVBudget(n, note)

    def _replica_key(self) -> int | None:
        """Which replicated copy of the KV this rank holds, or None when its slice is its own.

        Tensor parallel ranks hold identical KV bytes in two layouts: MLA (every rank caches
        the same latent row: key 0) and GQA with tp > num_key_value_heads (rank r holds KV
        head ``r // replicas``: the key is that head). Ranks with the same key must agree bit
        for bit (their inputs are the same all-reduced activations and the weights that
        produce them are replicated); ``kvserve.cache.integrity`` compares their checksums
        at seal time. Every rank derives the same answer from the same config, so all of them
        know without a collective whether the comparison runs."""
        if self.world_size == 1:
            return None
        if self.spec.components == 1:
            return 0
        cfg = self.loaded.hf_config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if self.world_size <= kv_heads:
            return None
        return kv_head_layout(kv_heads, self.world_size, self.rank)[1]

    def build_connectors(self, peers: KVPeers | None = None) -> dict[str, KVConnector]:
        """This rank's KV connectors by name (docs/kv-connector.md): the tiers
        (docs/kv-tiers.md), the PD transfer (docs/disaggregation.md), a third-party one
        (``--kv-connector``). Under tensor parallelism every rank keeps its own slice (its
        fingerprint) in each; only rank 0 loads in the background (``peers``: the other
        ranks, on rank 0) and tells the others what to save and load."""
        c, spec, cache = self.config.cache, self.store_spec(), self.kv_cache
        threads = 1 if self.rank == 0 else 0
        out: list[KVConnector] = []
        if c.kv_offload_enabled:
            cfg = TierConfig(c.kv_offload_memory_bytes, c.kv_offload_dir,
                             c.kv_offload_disk_bytes, c.kv_offload_queue_blocks,
                             c.kv_offload_url, c.kv_offload_timeout_s)
            out.append(KVTiers(cfg, spec, cache, peers, threads))
        if self.config.transfer is not None:
            out.append(KVTransfer(self.config.transfer, spec, cache, peers,
                                  IMPORT_THREADS * threads))
        if c.kv_connector is not None:
            out.append(load_connector(c.kv_connector)(spec, cache, peers, threads))
        return {x.name: x for x in out}

    def store_spec(self) -> StoreSpec:
        """The identity and layout of this rank's stored / transferred blocks (block_store)."""
        cache = self.kv_cache
        rot = cache.rotation
        return StoreSpec(
            model=self.model_id().hex(), kv_mode=cache.mode.name,
            rotation="" if rot is None else rot.describe(), fingerprint=self.fingerprint.hex(),
            block_size=cache.block_size, num_layers=cache.num_layers,
            components=cache.components, num_kv_heads=cache.num_kv_heads,
            head_dim=cache.head_dim, dtype=dtype_str(cache.dtype),
            scale_dtype="" if cache.scales is None else dtype_str(cache.scales.dtype),
            rank=self.rank, world_size=self.world_size)

    def model_id(self) -> bytes:
        """The model files' identity: config.json and each weight file's name, size, mtime."""
        h = hashlib.blake2b(digest_size=16)
        with open(os.path.join(self.loaded.folder, "config.json"), "rb") as f:
            h.update(f.read())
        for file in self.loaded.weight_files:
            st = os.stat(file)
            h.update(f"{os.path.basename(file)}:{st.st_size}:{st.st_mtime_ns}".encode())
        return h.digest()

    def _bf16_dot_rows(self) -> int:
        """From how many rows this rank's bf16-table GEMMs use bf16 dot products (0: never)."""
        lib = w16_gemm.w16_library()
        if lib is None or self.loaded.dtype != torch.float32 \
                or self.loaded.storage != torch.bfloat16:
            return 0
        return w16_gemm.bf16_dot_rows(lib)

    def _fingerprint(self) -> bytes:
        """Binds seals and prefix-cache hashes to the model files, dtypes, block size and
        (tensor parallel) the layout: tp size, this rank and its KV head range."""
        h = hashlib.blake2b(self.model_id(), digest_size=16)
        rotation = self.kv_cache.rotation
        rot = "" if rotation is None else f"|rot={rotation.describe()}"
        if self.kv_cache.mode.is_int8:
            rot += "|scale=log8"  # 1-byte 2^(e/8) scale codes (kvserve/quant/int8.py)
        h.update(f"{dtype_name(self.loaded.dtype)}|{dtype_name(self.config.kv_mode.dtype)}|"
                 f"{self.config.cache.block_size}{rot}".encode())
        dots = self._bf16_dot_rows()
        if dots:  # bf16 dot products compute other KV bytes than the exact fp32 path
            h.update(f"|bf16_dot_rows={dots}".encode())
        if self.world_size > 1:
            h.update(f"|tp={self.world_size}|rank={self.rank}|kv_heads="
                     f"{self.spec.num_kv_heads}".encode())
        return h.digest()

    def _decode_graphs(self, backend) -> DecodeGraphs | None:
        """CUDA graphs on a GPU, recorded kernel graphs on CPU (kvserve/engine/cpu_graphs.py):
        none under ``enforce_eager`` or tensor parallelism."""
        if self.args.enforce_eager or self.world_size > 1:
            return None
        if self.kv_cache.data.is_cuda:
            if self.lora_linears is not None:
                logger.info("CUDA graphs off: LoRA steps pick adapter slots per row (eager)")
                return None
            return self._cuda_graphs(backend)
        rows = self.config.scheduler.max_num_seqs
        spec = self.args.speculative_config
        if spec is not None:  # verify steps: 1 + k decode rows per request
            rows = min(rows * (1 + spec.num_speculative_tokens),
                       max(rows, self.config.scheduler.max_num_batched_tokens))
        graphs = CpuGraphRunner(self.model, backend, self.kv_cache, self.kv_cache.block_size,
                                self.spec.components, rows, self.config.model.max_model_len,
                                lora=self.lora_linears is not None)
        return graphs if graphs.capture() else None

    def _cuda_graphs(self, backend) -> CudaGraphRunner | None:
        """Decode CUDA graphs (kvserve/engine/cuda_graphs.py) unless ``enforce_eager``, off
        CUDA, under tensor parallelism (collectives are not captured), or the backend cannot
        be captured; a failed capture logs and runs eagerly."""
        if not backend.cuda_graphs:
            logger.info("CUDA graphs off: attention backend %r is not capturable", backend.name)
            return None
        graphs = CudaGraphRunner(self.model, backend, self.kv_cache, self.kv_cache.block_size,
                                 self.spec.components, self.config.scheduler.max_num_seqs,
                                 self.config.model.max_model_len)
        try:
            graphs.capture()
        except Exception as e:  # noqa: BLE001 - e.g. a model that syncs the host: run eager
            logger.warning("CUDA graph capture failed (%r); decode steps run eagerly", e)
            torch.cuda.synchronize()
            clear_scratch_block(self.kv_cache)
            return None
        return graphs


def num_kv_blocks(cfg, per_block: int, want_tokens: int) -> tuple[int, str]:
    """Blocks for ``kv_cache_memory``, else enough for ``max_num_seqs x max_model_len``
    tokens (``want_tokens``) capped by ``kv_cache_memory_fraction`` of available memory
    and DEFAULT_MAX_KV_BYTES; and a note saying which applied."""
    if cfg.num_blocks_override is not None:
        return cfg.num_blocks_override, f"num_blocks {cfg.num_blocks_override} given"
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
        note = f"kv_cache_memory {budget / 2**20:.0f} MiB given"
    else:
        need = -(-want_tokens // cfg.block_size) * per_block
        avail = int(available_memory() * cfg.kv_cache_memory_fraction)
        budget = min(need, avail, DEFAULT_MAX_KV_BYTES)
        why = ("max_num_seqs x max_model_len" if budget == need else
               f"capped by {cfg.kv_cache_memory_fraction:.0%} of available memory"
               if budget == avail else "capped at 4 GiB (set kv_cache_memory to change)")
        note = (f"KV budget {budget / 2**20:.0f} MiB: {why} "
                f"(wanted {need / 2**20:.0f} MiB for {want_tokens} tokens)")
    n = budget // per_block
    if n < 2:
        raise ValueError(f"kv_cache_memory {budget} B holds fewer than 2 blocks "
                         f"({per_block} B per block)")
    return n, note


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30
