"""Test, drill and benchmark hooks, kept off the engine's own API: ``engine.debug``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.integrity import IntegrityChecker
from kvserve.engine.executor import Executor, MultiprocExecutor, kv_bytes
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.scheduler import SchedulerOutput


class EngineDebug:
    def __init__(self, executor: Executor, pool: BlockPool, integrity: IntegrityChecker | None,
                 fingerprint: bytes, output_processor: OutputProcessor) -> None:
        self._executor, self._pool, self._integrity = executor, pool, integrity
        self._fingerprint, self._outputs = fingerprint, output_processor
        # Benchmarks: called with each non-empty schedule and the running count, before the
        # forward (kvserve.bench.common.StepRecorder).
        self.on_schedule: Callable[[SchedulerOutput, int], None] | None = None

    def inject_kv_fault(self, block_id: int, layer: int = 0, kind: str = "bitflip",
                        rank: int = 0, **kw) -> None:
        """Corrupt one KV block on purpose (drills, tests); see IntegrityChecker.inject.
        ``rank``: the tensor-parallel rank whose slice of the block is corrupted."""
        if rank != 0:
            if not isinstance(self._executor, MultiprocExecutor):
                raise ValueError(f"rank {rank}: this engine is not tensor parallel")
            self._executor.inject(rank, block_id, layer, kind, **kw)
            return
        checker = self._integrity or IntegrityChecker(self._executor.driver.kv_cache,
                                                      self._pool, self._fingerprint, "on")
        checker.inject(block_id, layer, kind, **kw)

    def check_no_leaks(self) -> None:
        """All blocks back in the pool (none in use) once no request is unfinished."""
        pool = self._pool
        pool.check_invariants()
        assert not self._outputs.parents, f"unfinished requests: {list(self._outputs.parents)}"
        assert pool.num_used_blocks == 0, f"{pool.num_used_blocks} blocks in use"

    def gather_kv(self) -> list[torch.Tensor]:
        """Every rank's KV bytes (data, then scales) as flat uint8, rank order."""
        ex = self._executor
        if isinstance(ex, MultiprocExecutor):
            return ex.gather_kv()
        return [kv_bytes(ex.driver)]
