"""Which replica holds which prompt prefix, rebuilt from the replicas' KV events.

The events name blocks by the engine's hashes (salted with the model fingerprint and any
``cache_salt``, which the router does not know) but carry their token ids, so the index keeps
its own chain over the same function the engine uses (``kvserve.cache.kv_cache_manager
.hash_block``) from a fixed root:

    key_0 = hash_block(ROOT, tokens[0:b])      key_i = hash_block(key_{i-1}, tokens[i*b:(i+1)*b])

and maps each replica's engine hash to its key, so a later ``BlockRemoved`` finds it. A
prompt's match on a replica is the number of leading keys that replica holds (counted: two
tenants' salted copies of the same tokens are two holdings of one key). A store whose parent the
index never saw is dropped (it cannot be placed in the chain); ``clear`` forgets a replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.cache.kv_cache_manager import hash_block
from kvserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

ROOT = b"kvserve-router"


class PrefixIndex:
    def __init__(self) -> None:
        self.block_size: int | None = None  # learned from the first store
        self._holders: dict[bytes, dict[str, int]] = {}  # key -> {replica: copies}
        self._keys: dict[str, dict[int, bytes]] = {}  # replica -> {engine hash: key}
        self.dropped = 0  # stores that could not be placed (unknown parent, other block size)

    def num_blocks(self, replica: str) -> int:
        return len(self._keys.get(replica, ()))

    def keys_of(self, replica: str) -> set[bytes]:
        return set(self._keys.get(replica, {}).values())

    def clear(self, replica: str) -> None:
        for key in self._keys.pop(replica, {}).values():
            self._drop(replica, key)

    def _drop(self, replica: str, key: bytes) -> None:
        holders = self._holders.get(key)
        if holders is None:
            return
        holders[replica] -= 1
        if holders[replica] <= 0:
            del holders[replica]
            if not holders:
                del self._holders[key]

    def apply(self, replica: str, event: KVEvent) -> None:
        mine = self._keys.setdefault(replica, {})
        if isinstance(event, AllBlocksCleared):
            self.clear(replica)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                key = mine.pop(h, None)
                if key is not None:
                    self._drop(replica, key)
        elif isinstance(event, BlockStored):
            b = event.block_size
            if self.block_size is None:
                self.block_size = b
            n = len(event.block_hashes)
            if b != self.block_size or len(event.token_ids) != n * b:
                self.dropped += n
                return
            if event.parent_block_hash is None:
                parent = ROOT
            elif event.parent_block_hash in mine:
                parent = mine[event.parent_block_hash]
            else:
                self.dropped += n
                return
            for i, h in enumerate(event.block_hashes):
                parent = hash_block(parent, tuple(event.token_ids[i * b:(i + 1) * b]))
                if h in mine:  # a store the index already has (replayed): same key
                    continue
                mine[h] = parent
                holders = self._holders.setdefault(parent, {})
                holders[replica] = holders.get(replica, 0) + 1

    def prompt_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chain keys of a prompt's blocks that an engine could hit (it always computes at
        least the last prompt token, so ``(len - 1) // block_size`` blocks)."""
        b = self.block_size
        if b is None:
            return []
        keys, parent = [], ROOT
        for i in range((len(token_ids) - 1) // b):
            parent = hash_block(parent, tuple(token_ids[i * b:(i + 1) * b]))
            keys.append(parent)
        return keys

    def match(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Replica -> matched prompt tokens (only replicas with a match > 0)."""
        keys = self.prompt_keys(token_ids)
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for i, key in enumerate(keys):
            holders = set(self._holders.get(key, ()))
            alive = holders if alive is None else alive & holders
            if not alive:
                break
            for r in alive:
                out[r] = (i + 1) * self.block_size  # type: ignore[operator]
        return out
