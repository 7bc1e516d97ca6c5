"""``EngineStats``: a frozen picture of an engine's queues, block pool and counters, taken by
``LLMEngine.stats()`` (the server's metrics read the latest one the engine thread took)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    # requests whose prompt is not fully computed yet (waiting, or running a prefill chunk)
    num_prefilling: int = 0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_unfinished_requests: int = 0
    # prompt_tokens, generation_tokens, steps, finished, aborted (totals since start)
    counters: dict[str, int] = field(default_factory=dict)
    integrity: dict[str, Any] | None = None  # IntegrityChecker.stats(); None when off
    kv_tiers: dict[str, Any] | None = None  # KVTiers.stats(); None when no tier is on
    kv_transfer: dict[str, Any] | None = None  # KVTransfer.stats(); None when off
    # speculative decoding: SpecCounters.as_dict() (drafts, draft / accepted tokens, accepted
    # per position, mean accepted length); None when off
    spec_decode: dict[str, Any] | None = None
    timestamp: float = 0.0  # time.monotonic() when taken
