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

With KV connectors (``kvserve.cache.kv_connector``: the tiers, a PD transfer, a third-party
store) the manager hands them the blocks the pool evicts and the prompts of finished requests,
and continues a prefix lookup past the pool's hits into them: the request waits
(``KVCacheBlocks.loading``) while a connector's thread reads and verifies the blocks, then
they are installed into fresh pool blocks (sealed and registered like computed ones) and
counted as hits. A PD decode request (``kv_import``) loads its prompt's blocks the same way,
into blocks of its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvserve.cache.block_pool import BlockPool, Cached
from kvserve.cache.block_store import StoredBlock
from kvserve.cache.kv_connector import BlockRef, KVConnector, Load
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
    # The request's next blocks are being loaded by a KV connector: schedule it later.
    loading: bool = False
    # PD decode role: the tokens are in the request's own blocks, received by transfer.
    imported: bool = False


EMPTY = KVCacheBlocks((), 0)
LOADING = KVCacheBlocks((), 0, loading=True)
# Loads one request may start (a pool that changed under a load can waste one).
MAX_LOADS_PER_REQUEST = 4


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool,
        salt: bytes,
        integrity: BlockIntegrity | None = None,
        connectors: list[KVConnector] = (),
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
        self.connectors = {c.name: c for c in connectors}
        assert len(self.connectors) == len(connectors), "connector names must differ"
        self.num_restored_tokens = 0  # hit tokens that came from a connector's load
        self._loading: dict[str, KVConnector] = {}  # request -> the connector loading for it
        self._load_from: dict[str, list[int]] = {}  # request -> chain index of each load
        self._probed: dict[str, int] = {}  # request -> chain index no connector had last time
        if self.connectors:
            pool.on_evict = self._evicted

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
        """A waiting request's KV, the one entry point: its imported blocks (PD decode role,
        ``kv_import``: loaded by the transfer), else the longest verified prefix-cache hit,
        continued by a connector's load; at least one prompt token is left to compute."""
        held = self.req_blocks.get(req.request_id)
        if held:  # imported, then no room to schedule it
            return KVCacheBlocks((), min(len(held) * self.block_size, req.num_prompt_tokens),
                                 imported=True)
        if req.kv_import is not None:
            got = self._import(req)
            if got.loading or got.num_tokens:
                return got  # (nothing imported: a plain prefill, from the prefix cache too)
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
        if self.connectors and len(hits) < max_blocks:
            more = self._load_prefix(req, hits, max_blocks)
            if more is None:
                return LOADING  # not counted as a query yet: it is asked again
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

    # ---- KV connectors (kvserve/cache/kv_connector.py) -----------------------------------
    def _refs(self, req: Request, start: int, stop: int, ids: list[int] = ()
              ) -> list[BlockRef]:
        """Chain blocks start..stop-1 of the request (in pool blocks ``ids[i]``, if given)."""
        hashes, tokens, b = self.block_hashes(req), req.all_token_ids, self.block_size
        return [BlockRef(ids[i] if i < len(ids) else -1, hashes[i],
                         tuple(tokens[i * b: (i + 1) * b])) for i in range(start, stop)]

    def _evicted(self, blocks: list[Cached], wait: bool = False) -> None:
        """BlockPool.on_evict: hand the evicted blocks (bytes still intact) to the connectors."""
        sums = [None if self.integrity is None else self.integrity.sealed_sums(e[0])
                for e in blocks]
        refs = [BlockRef(*e) for e in blocks]
        for c in self.connectors.values():
            c.on_evict(refs, sums, wait)

    def _finished(self, rid: str) -> tuple[KVConnector, Load] | None:
        c = self._loading.get(rid)
        job = c.finished(rid) if c is not None else None
        return None if job is None else (c, job)

    def _start(self, req: Request, refs: list[BlockRef], handle: dict | None) -> bool:
        """Start a load with the first connector that can load some of ``refs``."""
        for c in self.connectors.values():
            n = c.num_loadable(refs, handle)
            if n > 0:
                c.start_load(req.request_id, refs[:n], handle)
                self._loading[req.request_id] = c
                return True
        return False

    def _install(self, req: Request, c: KVConnector, job: Load, blocks: list[StoredBlock],
                 start: int) -> list[int]:
        """Install verified ``blocks`` (chain blocks start, start+1, ...) into fresh pool
        blocks (every rank its slice), seal and register the full ones; the blocks that every
        rank verified (the rest is freed unregistered)."""
        ids = self.pool.allocate(len(blocks))
        if self.integrity is not None:
            self.integrity.on_allocate(ids)
        n = c.commit_load(job, ids, blocks)
        self.pool.free(ids[n:][::-1])
        ids, blocks = ids[:n], blocks[:n]
        full = [(x, blk) for x, blk in zip(ids, blocks, strict=True)
                if len(blk.token_ids) == self.block_size]
        if full and self.integrity is not None:
            self.integrity.seal([x for x, _ in full], [blk.chain_hash for _, blk in full])
        if self.enable_prefix_caching:
            parent = self.block_hashes(req)[start - 1] if start else None
            for x, blk in full:
                if not self.pool.blocks[x].quarantined:
                    self.pool.register(x, blk.chain_hash, blk.token_ids, parent, req.lora)
                parent = blk.chain_hash
        return ids

    def _done(self, rid: str) -> None:
        c = self._loading.pop(rid, None)
        if c is not None:
            c.cancel(rid)

    def _load_prefix(self, req: Request, hits: list[int], max_blocks: int) -> list[int] | None:
        """Pool blocks for the chain blocks after ``hits`` loaded by a connector: [] when none
        has them, None while a load runs (the request waits)."""
        rid, start, b = req.request_id, len(hits), self.block_size
        got = self._finished(rid)
        if got is None:
            if rid in self._loading:
                return None
            starts = self._load_from.setdefault(rid, [])
            if (start in starts or len(starts) >= MAX_LOADS_PER_REQUEST
                    or self._probed.get(rid) == start):
                return []
            if not self._start(req, self._refs(req, start, max_blocks), None):
                # a request waiting for room asks every step: look again only once its pool
                # hits change
                self._probed[rid] = start
                return []
            starts.append(start)
            return None
        c, job = got
        self._done(rid)
        if req.metrics.kv_restores is None:
            req.metrics.kv_restores = []
        req.metrics.kv_restores.append(KVMove(
            job.start_monotonic, job.seconds, blocks=len(job.blocks), by_tier=job.by_tier))
        first = self._load_from[rid][-1]
        todo = job.blocks[start - first:]
        if start < first or not todo:
            return []  # (start < first: the pool lost blocks before the loaded ones meanwhile)
        # Install into fresh blocks, sealed and registered, then freed as cached blocks: the
        # hits are pinned meanwhile so the allocation cannot evict them.
        self.pool.touch(hits)
        try:
            ids = self._install(req, c, job, todo[: self.pool.num_free_blocks], start)
            self.pool.free(ids[::-1])
        finally:
            self.pool.free(hits[::-1])
        more = self._pool_hits(req, start, max_blocks)
        self.num_restored_tokens += min(len(more), len(ids)) * b
        return more

    def wait_for_loads(self, timeout: float = 0.005) -> None:
        """An empty step while requests wait for loads sleeps here instead of spinning."""
        for c in self.connectors.values():
            c.wait_any(timeout)

    def _prompt_refs(self, req: Request, computed: int) -> list[BlockRef]:
        """The prompt's blocks within ``computed`` tokens: full ones by the chain hash, then
        the partly filled last one (hashed the same way over its fewer tokens) once the whole
        prompt is in."""
        b, p = self.block_size, req.num_prompt_tokens
        ids = self.req_blocks.get(req.request_id, [])
        n_full = min(p, computed) // b
        out = self._refs(req, 0, n_full, ids)
        if computed >= p and p % b:
            parent = out[-1].chain_hash if out else self._salt_for(req)
            rest = tuple(req.prompt_token_ids[n_full * b: p])
            out.append(BlockRef(ids[n_full] if n_full < len(ids) else -1,
                                BLOCK_HASH_FN(parent, rest), rest))
        return out

    def request_finished(self, req: Request, export: bool) -> dict | None:
        """A request finished (before ``free``): the connectors that keep finished requests'
        KV save its prompt blocks; ``export`` (prefill role, the prompt computed): a PD
        transfer handle comes back."""
        savers = [c for c in self.connectors.values() if c.saves_finished]
        if not savers:
            return None
        refs = self._prompt_refs(req, req.num_computed_tokens)
        sums = [self.integrity.sealed_sums(r.block_id) if self.integrity is not None
                and len(r.token_ids) == self.block_size else None for r in refs]
        handles = [c.request_finished(refs, sums, export) for c in savers] if refs else []
        return next((h for h in handles if h is not None), None)

    def _import(self, req: Request) -> KVCacheBlocks:
        """Decode role, a waiting request with ``kv_import``: start the fetch, wait for it,
        then install the verified blocks into the request's own fresh blocks (LOADING
        meanwhile, also while the pool has no room for them); the prompt tokens they hold
        come back (IMPORTED; 0 after a fallback)."""
        rid = req.request_id
        got = self._finished(rid)
        if got is None:
            if rid not in self._loading:
                started = self._start(req, self._prompt_refs(req, req.num_prompt_tokens),
                                      req.kv_import)
                assert started, "a handle is only accepted with a KV transfer"
            return LOADING
        c, job = got
        if len(job.blocks) > self.pool.num_free_blocks:
            return LOADING  # kept; retried when blocks are free
        self._done(rid)
        assert not self.req_blocks.get(rid), "an import is only installed into a new request"
        ids = self._install(req, c, job, job.blocks, 0)
        n = len(ids)
        self.req_blocks[rid] = ids
        self._req_committed[rid] = sum(len(b.token_ids) == self.block_size
                                       for b in job.blocks[:n])
        req.metrics.kv_import = KVMove(job.start_monotonic, job.seconds, job.nbytes, n,
                                       job.rejected + len(job.blocks) - n, job.failed)
        req.kv_import = None
        return KVCacheBlocks((), sum(len(b.token_ids) for b in job.blocks[:n]), imported=True)

    def write_down_cached(self) -> int:
        """Hand every cached block the pool holds free to the connectors (waiting for room,
        not dropping) and wait until they are stored; returns the number of blocks."""
        if not self.connectors:
            return 0
        cached = self.pool.cached_free_blocks()
        self._evicted(cached, wait=True)
        for c in self.connectors.values():
            c.flush()
        return len(cached)

    def close(self) -> None:
        """Shutdown: save the pool's cached blocks into the connectors whose saves outlive the
        process (disk, a remote store: a restart, or another engine, finds them there), then
        stop the connectors' threads."""
        if any(c.persistent for c in self.connectors.values()):
            self.write_down_cached()
        for c in self.connectors.values():
            c.close()

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
        self._load_from.pop(req.request_id, None)
        self._probed.pop(req.request_id, None)
        self._done(req.request_id)

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
