"""Block pool: refcounts, an LRU free list, and the prefix-cache index.

Invariants (checked by tests/cache/test_block_pool.py, including a Hypothesis state machine):
  * every block is exactly one of: in use (ref_cnt > 0), free (ref_cnt == 0, in ``_free``),
    or quarantined (failed an integrity check; never handed out again);
  * ``_free`` is ordered least-recently-freed first: allocation takes from the front, so a
    cached block that was freed long ago is evicted before one freed recently;
  * a block is in the prefix-cache index only after it was fully written and registered
    (``register``), and leaves the index when it is reallocated or quarantined;
  * ``generation`` changes every time a block is handed out, so stale holders are detectable.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvserve.request import AdapterRef


# A cached block as ``on_evict`` reports it: (block id, chain hash, token ids, parent hash).
Cached = tuple[int, bytes, tuple[int, ...], bytes | None]


class NoFreeBlocksError(RuntimeError):
    pass


class DoubleFreeError(RuntimeError):
    pass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    generation: int = 0
    block_hash: bytes | None = None
    # Token ids the block holds when registered: a hit compares them, not only the hash.
    token_ids: tuple[int, ...] | None = None
    parent_hash: bytes | None = None  # the chain block before it (the tiers' KV events)
    quarantined: bool = False


class EventSink(Protocol):
    """Told what the prefix-cache index gains and loses (``kvserve.cache.kv_events``)."""

    def stored(self, block_hash: bytes, parent_hash: bytes | None,
               token_ids: tuple[int, ...], lora: AdapterRef | None = None) -> None: ...
    def removed(self, block_hash: bytes) -> None: ...
    def cleared(self) -> None: ...


class BlockPool:
    def __init__(self, num_blocks: int, event_sink: EventSink | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_quarantined = 0
        self.num_evictions = 0
        # Called with the cached blocks an ``allocate`` takes for reuse, as (block id, hash,
        # token ids, parent hash), while their bytes are still intact (the KV tiers copy them).
        self.on_evict: Callable[[list[Cached]], None] | None = None
        self.event_sink = event_sink

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - self.num_quarantined

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (first = next to be allocated)."""
        return list(self._free)

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        ids = []
        evicted = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0 and not block.quarantined
            if block.block_hash is not None:
                if self.on_evict is not None:
                    assert block.token_ids is not None
                    evicted.append((block_id, block.block_hash, block.token_ids,
                                    block.parent_hash))
                self._uncache(block)
                self.num_evictions += 1
            block.generation += 1
            block.ref_cnt = 1
            ids.append(block_id)
        if evicted:
            self.on_evict(evicted)  # type: ignore[misc]
        return ids

    def cached_free_blocks(self) -> list[Cached]:
        """Cached blocks in the free list, as ``on_evict`` reports them (shutdown write-down)."""
        out = []
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None and block.token_ids is not None:
                out.append((block_id, block.block_hash, block.token_ids, block.parent_hash))
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (prefix hits); revives them from the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert not block.quarantined, f"touching quarantined block {block_id}"
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; blocks reaching zero go to the free list's tail.

        Callers pass a request's blocks tail-first so a prompt's last blocks are evicted before
        its first ones (shared prefixes stay cached longest).
        """
        for block_id, count in Counter(block_ids).items():
            if count > self.blocks[block_id].ref_cnt:
                raise DoubleFreeError(f"block {block_id} freed more often than referenced")
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.quarantined:
                self._free[block_id] = None

    # ---- prefix cache --------------------------------------------------------------------
    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self.blocks[block_id].token_ids != token_ids:
            return None  # hash collision: the content check refuses it
        return block_id

    def register(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...],
                 parent_hash: bytes | None = None, lora: AdapterRef | None = None) -> bool:
        """Make a fully written block hittable. Returns False if another block holds the hash.
        ``parent_hash``: the chain hash of the block before it (None: the first block);
        ``lora``: the adapter its KV was computed with (KV events report it)."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, "only a block in use can be registered"
        if block.block_hash is not None or block.quarantined:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_hash = parent_hash
        self._cached[block_hash] = block_id
        if self.event_sink is not None:
            if lora is None:
                self.event_sink.stored(block_hash, parent_hash, token_ids)
            else:
                self.event_sink.stored(block_hash, parent_hash, token_ids, lora)
        return True

    def _uncache(self, block: Block, report: bool = True) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            if report and self.event_sink is not None:
                self.event_sink.removed(block.block_hash)
        block.block_hash = None
        block.token_ids = None
        block.parent_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.block_hash is not None:
                self._uncache(block, report=False)
        if self.event_sink is not None:
            self.event_sink.cleared()

    # ---- integrity -----------------------------------------------------------------------
    def quarantine(self, block_id: int) -> None:
        """Retire a block whose content failed verification: never hittable or allocatable."""
        block = self.blocks[block_id]
        if block.quarantined:
            return
        if block.block_hash is not None:
            self._uncache(block)
        block.quarantined = True
        self.num_quarantined += 1
        self._free.pop(block_id, None)

    def check_invariants(self) -> None:
        in_free = set(self._free)
        assert len(in_free) == len(self._free)
        for block in self.blocks:
            assert block.ref_cnt >= 0
            if block.block_id in in_free:
                assert block.ref_cnt == 0 and not block.quarantined
            elif not block.quarantined:
                assert block.ref_cnt > 0, f"block {block.block_id} leaked"
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == h
        assert len(self._free) + self.num_used_blocks + self.num_quarantined == self.num_blocks
