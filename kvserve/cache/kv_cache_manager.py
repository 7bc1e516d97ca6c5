"""Per-request block tables over the block pool, prefix-cache hits, and block commits.

The scheduler talks to this class only in block ids and token counts (``KVCacheBlocks``); it
never sees ``Block`` objects. Block hashes form a chain so a block's hash covers every token
before it (and hence its positions):

    h_0 = H(salt || tokens[0:b])      h_i = H(h_{i-1} || tokens[i*b:(i+1)*b])

``salt`` binds the model/dtype fingerprint, the request's ``cache_salt`` and its LoRA
adapter's content digest, so different models, KV dtypes, tenants or adapters never share
blocks (and, since tier entries, transfers and integrity seals are keyed by these hashes, never
restore or verify each other's either). A hit additionally compares the stored token
ids, so even a forced hash collision cannot return another prompt's KV.

With KV tiers (``kvserve.cache.kv_tiers``) the manager also writes blocks the pool evicts down
to host memory / disk, and continues a prefix lookup past the pool's hits into the tiers: the
request waits (``KVCacheBlocks.restoring``) while a background thread reads and verifies the
blocks, then they are installed into fresh pool blocks (sealed and registered like computed
ones) and counted as hits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvserve.cache.block_pool import BlockPool, Cached
from kvserve.cache.kv_tiers import Evicted, KVTiers, TierPeers
from kvserve.cache.kv_transfer import Expected, KVTransfer, TransferHandle
from kvserve.outputs import KVMove
from kvserve.request import AdapterRef, Request


def hash_block(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


# Tests replace this to force collisions (tests/cache/test_prefix_cache.py).
BLOCK_HASH_FN = hash_block


class BlockIntegrity(Protocol):
    """What the manager needs from the integrity checker (kvserve.cache.integrity). The
    checker never sees requests: ``verify`` returns bad block ids, and the scheduler rolls
    back whoever holds them."""

    def on_allocate(self, block_ids: list[int]) -> None: ...
    def seal(self, block_ids: list[int], token_hashes: list[bytes]) -> None: ...
    def verify(self, block_ids: list[int], reason: str) -> list[int]: ...
    def sealed_sums(self, block_id: int) -> np.ndarray | None: ...


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    block_ids: tuple[int, ...]
    num_tokens: int  # tokens covered (a multiple of block_size for hits)
    # The request's next blocks are being restored from a KV tier: schedule it later.
    restoring: bool = False


EMPTY = KVCacheBlocks((), 0)
RESTORING = KVCacheBlocks((), 0, restoring=True)
# Restore jobs one request may start (a pool that changed under a job can waste one).
MAX_RESTORES_PER_REQUEST = 4


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool,
        salt: bytes,
        integrity: BlockIntegrity | None = None,
        tiers: KVTiers | None = None,
        tier_peers: TierPeers | None = None,
        transfer: KVTransfer | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.integrity = integrity
        self.req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        self._req_committed: dict[str, int] = {}  # full blocks already queued for commit
        # (block, hash, tokens, parent hash) queued for sealing / registration
        self._pending: list[tuple[int, bytes, tuple[int, ...], bytes | None,
                                  AdapterRef | None]] = []
        # Prefix-cache statistics (queried tokens / hit tokens).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.tiers = tiers
        self.tier_peers = tier_peers  # tensor parallel: the other ranks' tiers
        self.num_restored_tokens = 0  # hit tokens that came from a tier
        self._restore_from: dict[str, list[int]] = {}  # request -> chain index of each job
        self._probed: dict[str, int] = {}  # request -> chain index the tiers lacked last time
        if tiers is not None:
            pool.on_evict = self._write_down
        self.transfer = transfer  # disaggregation: export / import of a prompt's KV

    # ---- hashing -------------------------------------------------------------------------
    def _salt_for(self, req: Request) -> bytes:
        salt = self.salt
        if req.cache_salt is not None:
            salt = hashlib.blake2b(salt + req.cache_salt.encode(), digest_size=16).digest()
        if req.lora is not None:
            salt = hashlib.blake2b(salt + b"lora:" + req.lora.digest, digest_size=16).digest()
        return salt

    def block_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the request's full blocks (computed incrementally, cached)."""
        hashes = self._req_hashes.setdefault(req.request_id, [])
        b = self.block_size
        n_full = req.num_tokens // b
        if len(hashes) < n_full:
            tokens = req.all_token_ids
            parent = hashes[-1] if hashes else self._salt_for(req)
            for i in range(len(hashes), n_full):
                parent = BLOCK_HASH_FN(parent, tuple(tokens[i * b : (i + 1) * b]))
                hashes.append(parent)
        return hashes

    # ---- scheduling API ------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> KVCacheBlocks:
        """Longest verified prefix-cache hit; at least one prompt token is left to compute."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return EMPTY
        b = self.block_size
        max_blocks = (req.num_tokens - 1) // b
        hits = self._pool_hits(req, 0, max_blocks)
        if hits and self.integrity is not None:
            bad = self.integrity.verify(hits, reason="prefix_hit")
            if bad:
                first_bad = min(hits.index(x) for x in bad)
                hits = hits[:first_bad]
        if self.tiers is not None and len(hits) < max_blocks:
            more = self._restore(req, hits, max_blocks)
            if more is None:
                return RESTORING  # not counted as a query yet: it is asked again
            hits += more
        self.num_queried_tokens += req.num_tokens
        self.num_hit_tokens += len(hits) * b
        return KVCacheBlocks(tuple(hits), len(hits) * b)

    def _pool_hits(self, req: Request, start: int, stop: int) -> list[int]:
        """Pool blocks holding the request's chain blocks start, start+1, ... (< stop)."""
        b = self.block_size
        hashes, tokens = self.block_hashes(req), req.all_token_ids
        hits: list[int] = []
        for i in range(start, stop):
            block_id = self.pool.lookup(hashes[i], tuple(tokens[i * b: (i + 1) * b]))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ---- KV tiers ------------------------------------------------------------------------
    def _write_down(self, evicted: list[Cached]) -> None:
        """BlockPool.on_evict: hand the evicted blocks (bytes still intact) to the tiers."""
        self._write_down_blocks(evicted, block=False)

    def _write_down_blocks(self, blocks: list[Cached], block: bool) -> None:
        assert self.tiers is not None
        sums = [None if self.integrity is None else self.integrity.sealed_sums(e[0])
                for e in blocks]
        evicted = [Evicted(*e) for e in blocks]
        self.tiers.write_down(evicted, sums, block=block)
        if self.tier_peers is not None:  # before any rank's next step overwrites them
            self.tier_peers.tier_write_down(evicted, block)

    def _restore(self, req: Request, hits: list[int], max_blocks: int) -> list[int] | None:
        """Pool blocks for the chain blocks after ``hits`` restored from a tier: [] when the
        tiers have none, None while a restore job runs (the request waits)."""
        assert self.tiers is not None
        rid, start, b = req.request_id, len(hits), self.block_size
        job = self.tiers.take_restore_job(rid)
        blocks = None if job is None else job.blocks
        if job is not None:
            if req.metrics.kv_restores is None:
                req.metrics.kv_restores = []
            req.metrics.kv_restores.append(KVMove(
                job.start_monotonic, job.seconds, blocks=len(job.blocks), by_tier=job.by_tier))
        if blocks is None:
            if self.tiers.restoring(rid):
                return None
            starts = self._restore_from.setdefault(rid, [])
            if (start in starts or len(starts) >= MAX_RESTORES_PER_REQUEST
                    or self._probed.get(rid) == start):
                return []
            hashes, tokens = self.block_hashes(req), req.all_token_ids
            items = [(hashes[i], tuple(tokens[i * b: (i + 1) * b]))
                     for i in range(start, max_blocks)]
            n = self.tiers.available(items)
            if n == 0:
                # a request waiting for room asks every step: look again only once its
                # pool hits change
                self._probed[rid] = start
                return []
            starts.append(start)
            self.tiers.start_restore(rid, items[:n])
            return None
        first = self._restore_from[rid][-1]
        if start < first:
            return []  # the pool lost blocks before the restored ones meanwhile
        todo = blocks[start - first:]
        if not todo:
            return []
        # Install into fresh blocks, sealed and registered, then freed as cached blocks: the
        # hits are pinned meanwhile so the allocation cannot evict them.
        self.pool.touch(hits)
        try:
            n = min(len(todo), self.pool.num_free_blocks)
            ids = self.pool.allocate(n)
            if self.integrity is not None:
                self.integrity.on_allocate(ids)
            todo = todo[:n]
            if ids:
                self.tiers.install(ids, todo)
                if self.tier_peers is not None:
                    # every rank installs its slice; a block missing or refused on any rank
                    # ends the restored run there (the rest is freed unregistered)
                    bad = self.tier_peers.tier_restore(
                        ids, [(t.chain_hash, t.token_ids) for t in todo])
                    n = bad.index(True) if True in bad else len(ids)
                    self.pool.free(ids[n:][::-1])
                    ids, todo = ids[:n], todo[:n]
                if self.integrity is not None:
                    self.integrity.seal(ids, [t.chain_hash for t in todo])
                parent = self.block_hashes(req)[start - 1] if start else None
                for block_id, t in zip(ids, todo, strict=True):
                    if not self.pool.blocks[block_id].quarantined:
                        self.pool.register(block_id, t.chain_hash, t.token_ids, parent,
                                           req.lora)
                    parent = t.chain_hash
                self.pool.free(ids[::-1])
        finally:
            self.pool.free(hits[::-1])
        more = self._pool_hits(req, start, max_blocks)
        self.num_restored_tokens += min(len(more), n) * b
        return more

    def wait_for_restores(self, timeout: float = 0.005) -> None:
        """An empty step while requests wait for restores or imports sleeps here instead of
        spinning."""
        if self.tiers is not None:
            self.tiers.wait_any(timeout)
        if self.transfer is not None:
            self.transfer.wait_any(timeout)

    # ---- disaggregation (kvserve/cache/kv_transfer.py) ----------------------------------
    def _prompt_blocks(self, req: Request) -> list[Expected]:
        """The identity of the prompt's blocks: full ones by the chain hash, then the partly
        filled last one (hashed the same way over its fewer tokens)."""
        b, p = self.block_size, req.num_prompt_tokens
        hashes, tokens = self.block_hashes(req), req.prompt_token_ids
        n_full = p // b
        out = [Expected(hashes[i], tuple(tokens[i * b: (i + 1) * b])) for i in range(n_full)]
        if p % b:
            parent = hashes[n_full - 1] if n_full else self._salt_for(req)
            rest = tuple(tokens[n_full * b: p])
            out.append(Expected(BLOCK_HASH_FN(parent, rest), rest))
        return out

    def export(self, req: Request) -> TransferHandle:
        """Prefill role: offer the request's prompt KV (it was computed: the request sampled
        a token after it). The pool blocks stay the request's until ``free``."""
        assert self.transfer is not None
        assert req.num_computed_tokens >= req.num_prompt_tokens
        expected = self._prompt_blocks(req)
        ids = self.req_blocks[req.request_id][: len(expected)]
        sealed = [self.integrity.sealed_sums(x) if self.integrity is not None
                  and len(e.token_ids) == self.block_size else None
                  for x, e in zip(ids, expected, strict=True)]
        return self.transfer.export(ids, expected, sealed)

    def take_import(self, req: Request) -> int | None:
        """Decode role, for a waiting request with ``kv_import``: start the fetch (None), wait
        for it (None), then install the verified blocks into the request's own fresh blocks
        and return the prompt tokens they hold (0 after a fallback). None also while the pool
        has no room for them."""
        assert self.transfer is not None and req.kv_import is not None
        rid = req.request_id
        if not self.transfer.importing(rid):
            handle = TransferHandle.from_dict(req.kv_import)
            self.transfer.start_import(rid, handle, self._prompt_blocks(req))
            return None
        job = self.transfer.finished(rid)
        if job is None:
            return None
        blocks = job.blocks
        if len(blocks) > self.pool.num_free_blocks:
            return None  # kept; retried when blocks are free
        self.transfer.cancel(rid)
        if job.failed is not None:
            self.transfer.fallbacks[job.failed] += 1
        assert not self.req_blocks.get(rid), "an import is only installed into a new request"
        ids = self.pool.allocate(len(blocks))
        if self.integrity is not None:
            self.integrity.on_allocate(ids)
        # under TP every rank installs its slice; a block refused on any rank and all after it
        # are recomputed (freed here, unregistered)
        n = self.transfer.install_import(ids, job)
        self.pool.free(ids[n:][::-1])
        ids, blocks = ids[:n], blocks[:n]
        full = [(x, blk) for x, blk in zip(ids, blocks, strict=True)
                if len(blk.token_ids) == self.block_size]
        if full and self.integrity is not None:
            self.integrity.seal([x for x, _ in full], [blk.chain_hash for _, blk in full])
        if self.enable_prefix_caching:
            parent = None  # the chain hash before each block (KV events)
            for x, blk in full:
                if not self.pool.blocks[x].quarantined:
                    self.pool.register(x, blk.chain_hash, blk.token_ids, parent, req.lora)
                parent = blk.chain_hash
        self.req_blocks[rid] = ids
        self._req_committed[rid] = len(full)
        req.metrics.kv_import = KVMove(job.start_monotonic, job.seconds, job.nbytes, n,
                                       job.rejected + len(job.blocks) - n, job.failed)
        return sum(len(blk.token_ids) for blk in blocks)

    def write_down_cached(self) -> int:
        """Queue every cached block the pool holds free for write-down (waiting for room, not
        dropping) and wait until it is stored; returns the number of blocks."""
        if self.tiers is None:
            return 0
        cached = self.pool.cached_free_blocks()
        self._write_down_blocks(cached, block=True)
        self.tiers.flush()
        return len(cached)

    def close(self) -> None:
        """Shutdown: write the pool's cached blocks to disk / the remote store (a restart, or
        another engine, finds them there) and stop the tiers' threads (and the transfer's)."""
        if self.transfer is not None:
            self.transfer.close()
        if self.tiers is None:
            return
        if self.tiers.disk is not None or self.tiers.remote is not None:
            self.write_down_cached()
        self.tiers.close()

    def allocate_slots(
        self, req: Request, num_new_tokens: int, hit: KVCacheBlocks = EMPTY
    ) -> bool:
        """Reserve blocks for ``num_new_tokens`` more tokens (after any hit). False if full."""
        needed = self._num_needed(req, num_new_tokens, hit)
        if needed > self._available(hit):
            return False
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if hit.block_ids:
            assert not blocks, "hits are only taken when a request (re)starts"
            self.pool.touch(list(hit.block_ids))
            blocks.extend(hit.block_ids)
            self._req_committed[req.request_id] = len(hit.block_ids)
        if needed > 0:
            new = self.pool.allocate(needed)
            if self.integrity is not None:
                self.integrity.on_allocate(new)
            blocks.extend(new)
        return True

    def _num_needed(self, req: Request, num_new_tokens: int, hit: KVCacheBlocks) -> int:
        held = len(self.req_blocks.get(req.request_id, ())) + len(hit.block_ids)
        total = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - held)

    def _available(self, hit: KVCacheBlocks) -> int:
        # Hit blocks sitting in the free list stop being allocatable once touched.
        revived = sum(1 for x in hit.block_ids if self.pool.is_free(x))
        return self.pool.num_free_blocks - revived

    def commit(self, req: Request) -> list[int]:
        """After a step wrote KV: queue the request's newly full blocks for sealing and (if
        caching) registration; ``flush_commits`` does both for all requests at once."""
        n_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        done = self._req_committed.get(req.request_id, 0)
        if n_full <= done:
            return []
        blocks = self.req_blocks[req.request_id]
        hashes = self.block_hashes(req)
        tokens = req.all_token_ids
        b = self.block_size
        for i in range(done, n_full):
            self._pending.append((blocks[i], hashes[i], tuple(tokens[i * b : (i + 1) * b]),
                                  hashes[i - 1] if i else None, req.lora))
        self._req_committed[req.request_id] = n_full
        return blocks[done:n_full]

    def flush_commits(self) -> None:
        """Seal every block queued this step in one batch, then make them hittable (a block is
        never hittable before it is sealed)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if self.integrity is not None:
            self.integrity.seal([p[0] for p in pending], [p[1] for p in pending])
        if self.enable_prefix_caching:
            for block_id, block_hash, toks, parent, lora in pending:
                block = self.pool.blocks[block_id]
                if block.ref_cnt > 0 and not block.quarantined:  # failed its seal: not reusable
                    self.pool.register(block_id, block_hash, toks, parent, lora)

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, None)
        self._req_committed.pop(req.request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])

    def forget(self, req: Request) -> None:
        """Drop per-request hash state (request finished for good)."""
        self._req_hashes.pop(req.request_id, None)
        self._restore_from.pop(req.request_id, None)
        self._probed.pop(req.request_id, None)
        if self.tiers is not None:
            self.tiers.cancel(req.request_id)
        if self.transfer is not None:
            self.transfer.cancel(req.request_id)

    def truncate(self, req: Request, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` blocks (integrity rollback)."""
        blocks = self.req_blocks.get(req.request_id, [])
        tail = blocks[num_blocks:]
        del blocks[num_blocks:]
        self._req_committed[req.request_id] = min(
            self._req_committed.get(req.request_id, 0), num_blocks
        )
        if tail:
            self.pool.free(tail[::-1])

    def get_block_ids(self, req: Request) -> list[int]:
        return self.req_blocks.get(req.request_id, [])

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
