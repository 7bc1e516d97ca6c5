"""``EngineStats``: a frozen picture of an engine's queues, block pool and counters, taken by
``LLMEngine.stats()`` (the server's metrics read the latest one the engine thread took);
``BucketCounts``, the one histogram accumulator the engine and the server's metrics share;
``SpecDecodeCounters``, where speculative decoding records its drafts."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

# Tokens scheduled per engine step (vLLM's vllm:iteration_tokens_total buckets).
ITERATION_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class BucketCounts:
    """Observations counted per bucket: ``counts[i]`` is how many fell in (bounds[i-1],
    bounds[i]], the last entry those above every bound (+Inf); not cumulative. Any histogram
    whose bounds are a subset of ``bounds`` reads exactly from it (``cumulative``), so one
    accumulator can be exposed under several names with different buckets."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        assert list(self.bounds) == sorted(set(self.bounds)), "bounds: sorted and distinct"
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self, bounds: tuple[float, ...] | None = None) -> list[tuple[float, int]]:
        """[(le, observations <= le)] for each of ``bounds`` (a subset of ``self.bounds``;
        default all) then +Inf."""
        want = self.bounds if bounds is None else bounds
        out, cum, j = [], 0, 0
        for le in want:
            while j < len(self.bounds) and self.bounds[j] <= le:
                cum += self.counts[j]
                j += 1
            assert self.bounds[j - 1] == le, f"bucket {le} is not one of the recorded bounds"
            out.append((le, cum))
        out.append((float("inf"), self.count))
        return out

    def copy(self) -> BucketCounts:
        return BucketCounts(self.bounds, list(self.counts), self.sum)


@dataclass(slots=True)
class SpecDecodeCounters:
    """Speculative decoding's counters (vLLM's vllm:spec_decode_*): an engine that speculates
    sets ``LLMEngine.spec_decode`` to one and calls ``record`` once per verified draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepting pos k

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_draft_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for k in range(num_accepted):
            self.accepted_per_pos[k] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos)}


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    # requests whose prompt is not fully computed yet (waiting, or running a prefill chunk)
    num_prefilling: int = 0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    block_size: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_unfinished_requests: int = 0
    # prompt_tokens, generation_tokens, steps, finished, aborted, prefix_cache_queries,
    # prefix_cache_hits (tokens; totals since start)
    counters: dict[str, int] = field(default_factory=dict)
    # tokens scheduled per step (ITERATION_TOKEN_BOUNDS); None before the first step
    iteration_tokens: BucketCounts | None = None
    # the cache's settings as strings (block_size, num_gpu_blocks, cache_dtype, ...)
    cache_config: dict[str, str] = field(default_factory=dict)
    integrity: dict[str, Any] | None = None  # IntegrityChecker.stats(); None when off
    kv_tiers: dict[str, Any] | None = None  # KVTiers.stats(); None when no tier is on
    kv_transfer: dict[str, Any] | None = None  # KVTransfer.stats(); None when off
    spec_decode: dict[str, Any] | None = None  # SpecDecodeCounters.as_dict(); None when off
    # LoRA: {"max_lora": int, "running": [adapter names], "waiting": [...]}; None when off
    lora: dict[str, Any] | None = None
    timestamp: float = 0.0  # time.monotonic() when taken
