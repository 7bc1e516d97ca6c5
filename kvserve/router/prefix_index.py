"""Which replica holds which prompt prefix, and where, rebuilt from the replicas' KV events.

The events name blocks by the engine's hashes (salted with the model fingerprint and any
``cache_salt``, which the router does not know) but carry their token ids, so the index keeps
its own chain over the same function the engine uses (``kvserve.cache.kv_cache_manager
.hash_block``) from a fixed root:

    key_0 = hash_block(ROOT, tokens[0:b])      key_i = hash_block(key_{i-1}, tokens[i*b:(i+1)*b])

and maps each replica's engine hash to its key, so a later ``BlockRemoved`` finds it. A stored
block is held per ``medium``: the pool ("GPU" / "CPU" / none) or a KV tier ("cpu" host memory,
"disk", "remote": ``kv_events.TIER_MEDIA``); a ``BlockRemoved`` drops that medium's copy only.
A store whose parent the index never saw is dropped (it cannot be placed in the chain); a parent
no medium holds any more is still found among the replica's last ``GHOSTS`` removed blocks (a
tier announces a block after the pool's removal of its parent, as its writer thread stores a
request's blocks tail first). ``clear`` (and ``AllBlocksCleared``) forgets a replica.

A prompt's match on a replica runs over the leading keys it holds in any medium; each block
counts ``block_size * weight`` tokens, the weight of the best medium holding it
(``MEDIUM_WEIGHTS``: a pool hit is free, a tier hit costs a restore, still far cheaper than
recomputing). Copies are counted: two tenants' salted copies of the same tokens are two
holdings of one key.

Routed prompts (SGLang's approximate tree, next to the precise events; llm-d keeps both
scorers): ``record`` notes a prompt's keys for the replica that just served it, held for
``routed_ttl`` seconds (0: off). A recorded, unexpired key counts for its replica as a pool
hit (weight 1.0: the prompt just ran there), once, however it is also held by events. This
closes the race of a conversation's next turn reaching the router before the replica's
``BlockStored`` events for the previous one. At most ``ROUTED_KEYS`` (replica, key) entries are
kept, the oldest dropped first; expired ones are dropped lazily (``record`` / ``match``).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from kvserve.cache.kv_cache_manager import hash_block
from kvserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

ROOT = b"kvserve-router"
POOL = "pool"  # the medium class of every medium that is not a tier's
# Tokens a block is worth per medium, relative to a pool hit (docs/replicas.md). llm-d's
# precise prefix-cache scorer counts a CPU-tier hit at 0.8; disk and remote reads cost more.
MEDIUM_WEIGHTS = {POOL: 1.0, "cpu": 0.8, "disk": 0.5, "remote": 0.5}
GHOSTS = 8192  # per replica: engine hash -> key of blocks no medium holds any more
# (replica, key) entries of routed prompts kept in all: 65,536 x ~280 B ~ 18 MiB at most, the
# blocks of ~1,000 recent 1k-token prompts at block size 16; oldest dropped first.
ROUTED_KEYS = 1 << 16


def medium_class(medium: str | None) -> str:
    return medium if medium in MEDIUM_WEIGHTS and medium != POOL else POOL


class PrefixIndex:
    def __init__(self, routed_ttl: float = 0.0, *, clock: Callable[[], float] = time.monotonic,
                 routed_keys: int = ROUTED_KEYS) -> None:
        assert routed_ttl >= 0 and routed_keys >= 1
        # learned from the first store (or the replica's GET /kv_events)
        self.block_size: int | None = None
        # key -> {replica: {medium class: copies}}
        self._holders: dict[bytes, dict[str, Counter[str]]] = {}
        # replica -> {(engine hash, medium class): key}
        self._keys: dict[str, dict[tuple[int, str], bytes]] = {}
        # replica -> {engine hash: (key, media holding it)}: places a child in the chain
        self._chain: dict[str, dict[int, tuple[bytes, int]]] = {}
        self._ghosts: dict[str, OrderedDict[int, bytes]] = {}
        self.dropped = 0  # stores that could not be placed (unknown parent, other block size)
        self.routed_ttl, self.routed_keys, self.clock = routed_ttl, routed_keys, clock
        # (replica, key) -> expiry, in recording order: with one TTL also in expiry order
        self._routed: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        # key -> the replicas it was routed to (a tuple: ~48 B where a set costs ~216 B)
        self._routed_to: dict[bytes, tuple[str, ...]] = {}
        self._routed_n: Counter[str] = Counter()  # replica -> its entries in _routed

    def num_blocks(self, replica: str) -> int:
        """Distinct blocks (engine hashes) the replica holds in any medium."""
        return len(self._chain.get(replica, ()))

    def blocks_by_medium(self, replica: str) -> dict[str, int]:
        return dict(Counter(m for _, m in self._keys.get(replica, {})))

    def keys_of(self, replica: str) -> set[bytes]:
        return set(self._keys.get(replica, {}).values())

    def num_routed(self, replica: str) -> int:
        """Recorded routed-prompt blocks of the replica (expired ones not yet dropped too)."""
        return self._routed_n[replica]

    def clear(self, replica: str) -> None:
        if self._routed_n[replica]:
            for entry in [e for e in self._routed if e[0] == replica]:
                self._unroute(entry)
        self._chain.pop(replica, None)
        self._ghosts.pop(replica, None)
        for (_, m), key in self._keys.pop(replica, {}).items():
            self._drop(replica, key, m)

    def _unroute(self, entry: tuple[str, bytes]) -> None:
        del self._routed[entry]
        replica, key = entry
        to = tuple(r for r in self._routed_to[key] if r != replica)
        if to:
            self._routed_to[key] = to
        else:
            del self._routed_to[key]
        self._routed_n[replica] -= 1
        if not self._routed_n[replica]:
            del self._routed_n[replica]

    def _expire(self, now: float) -> None:
        """Drop expired routed entries; they are in expiry order (one TTL, a monotonic clock),
        so every entry left is live."""
        while self._routed:
            entry, expiry = next(iter(self._routed.items()))
            if expiry > now:
                return
            self._unroute(entry)

    def record(self, replica: str, keys: Sequence[bytes]) -> None:
        """The replica served a prompt with these chain keys (``prompt_keys``): they count as
        held there for ``routed_ttl`` seconds from now (again from now if already recorded)."""
        if self.routed_ttl <= 0 or not keys:
            return
        now = self.clock()
        self._expire(now)
        expiry = now + self.routed_ttl
        # leading block recorded last: the bound drops a prompt's tail first, so what is left
        # of it still matches as a shorter prefix
        for key in reversed(keys):
            entry = (replica, key)
            if entry in self._routed:
                self._routed.move_to_end(entry)
            else:
                self._routed_n[replica] += 1
                self._routed_to[key] = self._routed_to.get(key, ()) + (replica,)
            self._routed[entry] = expiry
        while len(self._routed) > self.routed_keys:
            self._unroute(next(iter(self._routed)))

    def _drop(self, replica: str, key: bytes, medium: str) -> None:
        holders = self._holders.get(key)
        if holders is None or replica not in holders:
            return
        media = holders[replica]
        media[medium] -= 1
        if media[medium] <= 0:
            del media[medium]
            if not media:
                del holders[replica]
                if not holders:
                    del self._holders[key]

    def _remove(self, replica: str, h: int, medium: str) -> None:
        key = self._keys.get(replica, {}).pop((h, medium), None)
        if key is None:
            return
        self._drop(replica, key, medium)
        chain = self._chain[replica]
        k, n = chain[h]
        if n <= 1:
            del chain[h]
            ghosts = self._ghosts.setdefault(replica, OrderedDict())
            ghosts[h] = k
            ghosts.move_to_end(h)
            if len(ghosts) > GHOSTS:
                ghosts.popitem(last=False)
        else:
            chain[h] = (k, n - 1)

    def apply(self, replica: str, event: KVEvent) -> None:
        mine = self._keys.setdefault(replica, {})
        chain = self._chain.setdefault(replica, {})
        if isinstance(event, AllBlocksCleared):
            self.clear(replica)
        elif isinstance(event, BlockRemoved):
            m = medium_class(event.medium)
            for h in event.block_hashes:
                self._remove(replica, h, m)
        elif isinstance(event, BlockStored):
            m = medium_class(event.medium)
            b = event.block_size
            if self.block_size is None:
                self.block_size = b
            n = len(event.block_hashes)
            if b != self.block_size or len(event.token_ids) != n * b:
                self.dropped += n
                return
            if event.parent_block_hash is None:
                parent = ROOT
            elif event.parent_block_hash in chain:
                parent = chain[event.parent_block_hash][0]
            elif event.parent_block_hash in self._ghosts.get(replica, {}):
                parent = self._ghosts[replica][event.parent_block_hash]
            else:
                self.dropped += n
                return
            for i, h in enumerate(event.block_hashes):
                parent = hash_block(parent, tuple(event.token_ids[i * b:(i + 1) * b]))
                if (h, m) in mine:  # a store the index already has (replayed): same key
                    continue
                mine[(h, m)] = parent
                held = chain.get(h)
                chain[h] = (parent, 1 if held is None else held[1] + 1)
                media = self._holders.setdefault(parent, {}).setdefault(replica, Counter())
                media[m] += 1

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
        """Replica -> matched prompt tokens weighted by where each block lives (rounded; only
        replicas with a match > 0)."""
        return self.match_keys(self.prompt_keys(token_ids))

    def match_keys(self, keys: Sequence[bytes]) -> dict[str, int]:
        """``match`` of a prompt's ``prompt_keys``: each leading key a replica holds by events
        (its best medium's weight) or by an unexpired routed prompt (weight 1.0) counts once."""
        if self._routed:
            self._expire(self.clock())
        score: dict[str, float] = {}
        alive: set[str] | None = None
        for key in keys:
            holders = self._holders.get(key, {})
            routed = self._routed_to.get(key, ())
            here = set(holders).union(routed)
            alive = here if alive is None else alive & here
            if not alive:
                break
            for r in alive:
                w = MEDIUM_WEIGHTS[POOL] if r in routed else \
                    max(MEDIUM_WEIGHTS[m] for m in holders[r])
                score[r] = score.get(r, 0.0) + w * self.block_size  # type: ignore[operator]
        return {r: round(s) for r, s in score.items() if round(s) > 0}
