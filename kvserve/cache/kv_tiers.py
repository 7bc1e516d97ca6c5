"""KV tiers below the pool: a bounded host-memory tier and a bounded disk tier that keep sealed
blocks after the pool reuses them, and give them back, verified, on a later prefix hit.

Flow (docs/kv-tiers.md)::

    pool evicts a cached block ──copy bytes (step loop, one index_select)──> write queue
        (bounded; full -> the write is dropped and counted, the step never waits)
    writer thread: serialize (block_store) -> memory tier (LRU, byte cap)
                                           -> disk tier (write-through; tmp file + os.replace)
    prefix lookup past the pool's hits: which of the next chain blocks a tier holds (dict
        lookup / one stat per block) -> a restore job for the request (it waits, others run)
    restore thread: read memory, else disk -> block_store.verify -> StoredBlocks
    next schedule: the manager installs them in fresh pool blocks (seal + register) and they
        count as a prefix hit.

KV events (``kv_events.py``, docs/kv-tiers.md): with an ``events`` sink, each block a tier
newly holds is announced as ``BlockStored`` with ``medium`` "cpu" (memory tier), "disk" or
"remote", and each entry a tier loses (LRU eviction, disk trim, a refused entry, a file another
process deleted, noticed at the next scan) as ``BlockRemoved`` of that medium. Only entries this
process stored are announced; the sink is called on the writer and restore threads.

A block that fails ``verify`` is a miss: its entry is dropped and counted by reason; the
request recomputes those tokens. Nothing here changes what is computed, only what is reused.

Entries are content addressed: file / key = blake2b(fingerprint || token-chain hash), so one
directory can hold several models, KV modes and ranks and a name never leaks tokens. Disk LRU
is by mtime (a read bumps it); every writer scans the directory after each ``cap / 16`` bytes
it wrote and deletes the oldest files down to ``LOW_WATER * cap``, tolerating files that other
processes delete concurrently. With k writers the directory can exceed its cap by at most
k * cap / 16 between scans; each writer's ``trim`` brings it back under the cap.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvserve.cache import block_store, jobs
from kvserve.cache.block_store import Reason, Rejected, StoredBlock, StoreSpec
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.remote_tier import RemoteTier

logger = logging.getLogger("kvserve.kv_tiers")

LOW_WATER = 0.9  # a disk trim deletes the oldest files down to this share of the cap
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 600.0  # temporary files older than this were left by a dead writer
# Restore latency histogram bucket bounds (seconds), exported as kvserve_kv_restore_seconds.
RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class TierConfig:
    memory_bytes: int = 0  # 0: no host-memory tier
    disk_dir: str | None = None  # None: no disk tier
    disk_bytes: int = 0
    queue_blocks: int = 256  # write-down queue bound (blocks)
    remote_url: str | None = None  # None: no remote store (kvserve/cache/remote_tier.py)
    remote_timeout_s: float = 0.2

    @property
    def enabled(self) -> bool:
        return self.memory_bytes > 0 or self.disk_dir is not None or self.remote_url is not None


@dataclass(frozen=True, slots=True)
class Evicted:
    """A cached block leaving the pool: its identity (the bytes are copied by the manager)."""

    block_id: int
    chain_hash: bytes
    token_ids: tuple[int, ...]
    parent_hash: bytes | None = None  # the chain block before it (KV events only)


class TierPeers(Protocol):
    """The other tensor-parallel ranks (kvserve.engine.executor.MultiprocExecutor): each keeps
    its own slice of every block in its own tier entries."""

    def tier_write_down(self, evicted: list[Evicted], block: bool) -> None:
        """Every other rank copies its slice of the blocks now and queues them."""
        ...

    def tier_restore(self, block_ids: list[int], items: list[tuple[bytes, tuple[int, ...]]]
                     ) -> list[bool]:
        """Every other rank reads, verifies and installs its slice of each block into
        ``block_ids``; per block, whether it failed on any rank."""
        ...


class TierEvents(Protocol):
    """Told which blocks a tier gains and loses (``kvserve.cache.kv_events.KVEventPublisher``);
    called from the tiers' threads, so it must be thread safe."""

    def stored(self, block_hash: bytes, parent_hash: bytes | None,
               token_ids: tuple[int, ...], lora: None = None, medium: str | None = None
               ) -> None: ...
    def removed(self, block_hash: bytes, medium: str | None = None) -> None: ...


# A tier's ``name`` -> the ``medium`` of its KV events (kv_events.TIER_MEDIA).
MEDIUM = {"memory": "cpu", "disk": "disk", "remote": "remote"}


def entry_key(spec: StoreSpec, chain_hash: bytes) -> str:
    h = hashlib.blake2b(spec.fingerprint.encode(), digest_size=16)
    h.update(chain_hash)
    return h.hexdigest()


class MemoryTier:
    """Serialized blocks in host memory, LRU under a byte cap. Thread safe."""

    name = "memory"

    def __init__(self, cap_bytes: int) -> None:
        self.cap = cap_bytes
        self._d: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.evictions = 0

    def put(self, key: str, blob: bytes) -> list[str]:
        """Store ``blob``; the keys evicted to make room."""
        gone = []
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return gone
            if len(blob) > self.cap:
                return gone
            self._d[key] = blob
            self.bytes += len(blob)
            while self.bytes > self.cap:
                old_key, old = self._d.popitem(last=False)
                self.bytes -= len(old)
                self.evictions += 1
                gone.append(old_key)
        return gone

    def get(self, key: str) -> bytes | None:
        with self._lock:
            blob = self._d.get(key)
            if blob is not None:
                self._d.move_to_end(key)
            return blob

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._d

    def drop(self, key: str) -> None:
        with self._lock:
            blob = self._d.pop(key, None)
            if blob is not None:
                self.bytes -= len(blob)

    def __len__(self) -> int:
        return len(self._d)


class DiskTier:
    """One file per block in ``directory``; atomic writes, LRU by mtime under a byte cap, safe
    with several processes sharing the directory (see the module docstring)."""

    name = "disk"

    def __init__(self, directory: str, cap_bytes: int) -> None:
        self.dir = os.path.abspath(directory)
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f"{TMP_PREFIX}{os.getpid()}-probe")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as e:
            raise ValueError(f"kv_offload_dir {directory!r} is not a writable directory: "
                             f"{e}") from None
        self.cap = cap_bytes
        self.evictions = 0
        self.bytes = 0  # as of the last scan, plus this process's writes since
        self._since_scan = 0
        self._lock = threading.Lock()
        self.trim()

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key + SUFFIX)

    def put(self, key: str, blob: bytes) -> list[str] | None:
        """Write ``blob``; after a scan, the keys present before it (None: no scan ran)."""
        path = self.path(key)
        if os.path.exists(path):
            self._bump(path)
            return None
        tmp = os.path.join(self.dir, f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{key}")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # readers see the whole file or none
        except OSError as e:
            logger.warning("kv disk tier: cannot write %s: %s", path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return None
        with self._lock:
            self.bytes += len(blob)
            self._since_scan += len(blob)
            scan = self._since_scan >= max(1, self.cap // 16) or self.bytes > self.cap
        return self.trim() if scan else None

    def get(self, key: str) -> bytes | None:
        """The file's bytes, None when absent (also: deleted concurrently). OSError: unreadable."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        self._bump(path)
        return blob

    def contains(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def drop(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    @staticmethod
    def _bump(path: str) -> None:
        # LRU: mtime = last use (atime is unreliable under relatime)
        with contextlib.suppress(OSError):
            os.utime(path)

    def scan(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every entry; files vanishing meanwhile are skipped."""
        out = []
        now = time.time()
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return out
        for e in entries:
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            if e.name.startswith(TMP_PREFIX):
                if now - st.st_mtime > STALE_TMP_S:
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)
                continue
            if e.name.endswith(SUFFIX):
                out.append((st.st_mtime, st.st_size, e.path))
        return out

    def trim(self) -> list[str]:
        """Delete the least recently used files until the directory is under its cap; the keys
        of the files left."""
        files = self.scan()
        total = sum(f[1] for f in files)
        files_left = {f[2] for f in files}
        if total > self.cap:
            files.sort()
            target = int(self.cap * LOW_WATER)
            for _, size, path in files:
                if total <= target:
                    break
                try:
                    os.unlink(path)
                    self.evictions += 1
                except FileNotFoundError:
                    pass  # another writer took it
                total -= size
                files_left.discard(path)
        with self._lock:
            self.bytes = total
            self._since_scan = 0
        return [os.path.basename(p)[: -len(SUFFIX)] for p in files_left]

    def __len__(self) -> int:
        return len(self.scan())


@dataclass(slots=True)
class _Write:
    chain_hash: bytes
    token_ids: tuple[int, ...]
    parent_hash: bytes | None
    payload: torch.Tensor  # [L, C, bs, H, D] CPU copy
    scales: torch.Tensor | None
    sealed_sums: np.ndarray | None  # [L, 4] the pool's seal, when integrity is on


@dataclass(slots=True)
class _Restore:
    items: list[tuple[bytes, tuple[int, ...]]]  # (chain hash, token ids) in chain order
    started: float
    done: threading.Event
    blocks: list[StoredBlock]
    start_monotonic: float = 0.0
    seconds: float = 0.0
    by_tier: tuple[tuple[str, int], ...] = ()  # blocks read back, per tier


class KVTiers:
    """The tiers of one engine rank, their writer and restore threads, and their counters.
    Owned by ``KVCacheManager``; the step loop calls ``write_down`` (on eviction),
    ``available`` / ``start_restore`` / ``take_restore`` (on prefix lookups) and ``install``."""

    def __init__(self, cfg: TierConfig, spec: StoreSpec, kv: PagedKVCache) -> None:
        assert cfg.enabled
        self.cfg, self.spec, self.kv = cfg, spec, kv
        self.memory = MemoryTier(cfg.memory_bytes) if cfg.memory_bytes > 0 else None
        self.disk = DiskTier(cfg.disk_dir, cfg.disk_bytes) if cfg.disk_dir is not None else None
        self.remote = (RemoteTier(cfg.remote_url, cfg.remote_timeout_s)
                       if cfg.remote_url is not None else None)
        self.tiers: list[MemoryTier | DiskTier | RemoteTier] = [
            t for t in (self.memory, self.disk, self.remote) if t is not None]
        self.hits: Counter[str] = Counter()  # blocks restored, by tier
        self.misses: Counter[str] = Counter()  # chain blocks looked for and absent, by tier
        self.writes: Counter[str] = Counter()  # blocks written, by tier
        self.rejected: Counter[tuple[str, str]] = Counter()  # (tier, reason)
        self.dropped_writes = 0  # write-downs refused by a full queue
        self.corrupt_in_pool = 0  # evicted blocks whose bytes no longer matched their seal
        self.restore_hist = np.zeros(len(RESTORE_BUCKETS) + 1, dtype=np.int64)
        self.restore_seconds = 0.0
        # KV events: the sink (set by the engine builder before any write) and, per tier,
        # the entries announced as stored: key -> (chain hash, parent hash, token ids).
        self.events: TierEvents | None = None
        self._events_lock = threading.Lock()
        self._announced: dict[str, dict[str, tuple[bytes, bytes | None, tuple[int, ...]]]] = {}
        self._writes: queue.Queue[_Write | None] = queue.Queue(maxsize=cfg.queue_blocks)
        self._jobs: jobs.JobBoard[_Restore] = jobs.JobBoard()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                        daemon=True)
        self._reader = threading.Thread(target=self._jobs.serve, args=(self._run_restore,),
                                        name="kv-tier-restore", daemon=True)
        self._writer.start()
        self._reader.start()
        self._closed = False

    def describe(self) -> str:
        parts = []
        if self.memory is not None:
            parts.append(f"host memory {self.memory.cap / 2**30:.2f} GiB")
        if self.disk is not None:
            parts.append(f"disk {self.disk.dir} {self.disk.cap / 2**30:.2f} GiB "
                         f"({len(self.disk)} blocks found there)")
        if self.remote is not None:
            parts.append(f"remote {self.remote.url}")
        return (f"KV tiers: {', '.join(parts)}; {self.spec.block_bytes / 1024:.1f} KiB per "
                f"block; write queue {self.cfg.queue_blocks} blocks")

    # ---- write-down (step loop: copy and enqueue; writer thread: the rest) ------------------
    def write_down(self, evicted: list[Evicted], sealed_sums: list[np.ndarray | None],
                   block: bool = False) -> None:
        """Copy the evicted blocks' bytes now (before the pool reuses them) and queue them.
        A full queue drops the write (``dropped_writes``) unless ``block`` (shutdown)."""
        if not evicted or self._closed:
            return
        if self.memory is not None and self.disk is None:
            todo = [(e, s) for e, s in zip(evicted, sealed_sums, strict=True)
                    if not self.memory.contains(entry_key(self.spec, e.chain_hash))]
        else:
            todo = list(zip(evicted, sealed_sums, strict=True))
        if not block:
            room = self._writes.maxsize - self._writes.qsize()
            if room < len(todo):
                self.dropped_writes += len(todo) - max(room, 0)
                todo = todo[: max(room, 0)]
        if not todo:
            return
        idx = torch.tensor([e.block_id for e, _ in todo], dtype=torch.int64,
                           device=self.kv.data.device)
        # [L, n, C, bs, H, D] (copied as bytes: FP8 has few CPU kernels)
        payload = self.kv.data.view(torch.uint8).index_select(1, idx).cpu().view(
            self.kv.data.dtype)
        scales = None
        if self.kv.scales is not None:
            scales = self.kv.scales.view(torch.uint8).index_select(1, idx).cpu().view(
                self.kv.scales.dtype)
        for i, (e, s) in enumerate(todo):
            w = _Write(e.chain_hash, e.token_ids, e.parent_hash, payload[:, i],
                       None if scales is None else scales[:, i], s)
            try:
                self._writes.put(w, block=block)
            except queue.Full:
                self.dropped_writes += 1

    def _write_loop(self) -> None:
        while True:
            w = self._writes.get()
            try:
                if w is None:
                    return
                self._write_one(w)
            except Exception:  # noqa: BLE001 - a failed write-down only loses a cache entry
                logger.exception("kv tiers: write-down failed")
            finally:
                self._writes.task_done()

    def _write_one(self, w: _Write) -> None:
        sums = block_store.block_sums(w.payload.unsqueeze(1),
                                      None if w.scales is None else w.scales.unsqueeze(1))[0]
        if w.sealed_sums is not None and not np.array_equal(sums, w.sealed_sums):
            self.corrupt_in_pool += 1  # the pool's scrubber / next verify will find it too
            logger.error("kv tiers: an evicted block no longer matches its seal; not stored")
            return
        blob = block_store.serialize(
            self.spec, StoredBlock(w.chain_hash, w.token_ids, w.payload, w.scales, sums))
        key = entry_key(self.spec, w.chain_hash)
        for tier in self.tiers:
            after = tier.put(key, blob)
            self.writes[tier.name] += 1
            if self.events is not None:
                self._announce(tier, key, (w.chain_hash, w.parent_hash, w.token_ids), after)

    # ---- KV events (writer / restore thread) ----------------------------------------------
    def _announce(self, tier: MemoryTier | DiskTier, key: str,
                  block: tuple[bytes, bytes | None, tuple[int, ...]] | None,
                  after: list[str] | None) -> None:
        """After ``tier.put(key)``: announce ``block`` if the tier now holds it newly, and the
        removal of every announced entry it lost (``after``: the memory tier's evicted keys,
        the disk tier's keys left after a scan, None: no news)."""
        assert self.events is not None
        medium = MEDIUM.get(tier.name, tier.name)
        with self._events_lock:
            mine = self._announced.setdefault(tier.name, {})
            if after is not None:
                if isinstance(tier, DiskTier):
                    left = set(after)
                    gone = [k for k in mine if k not in left]
                else:
                    gone = after
                for k in gone:
                    old = mine.pop(k, None)
                    if old is not None:
                        self.events.removed(old[0], medium=medium)
            if block is not None and key not in mine and tier.contains(key):
                mine[key] = block
                self.events.stored(block[0], block[1], block[2], medium=medium)

    def _announce_removed(self, tier: MemoryTier | DiskTier, key: str) -> None:
        if self.events is None:
            return
        with self._events_lock:
            old = self._announced.get(tier.name, {}).pop(key, None)
            if old is not None:
                self.events.removed(old[0], medium=MEDIUM.get(tier.name, tier.name))

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write-down is stored (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    # ---- restore ------------------------------------------------------------------------
    def available(self, items: list[tuple[bytes, tuple[int, ...]]]) -> int:
        """How many of ``items`` (the chain's next blocks, in order) some tier holds. The
        remote store is asked once, for every block the local tiers lack (one round trip)."""
        n = 0
        keys = [entry_key(self.spec, h) for h, _ in items]
        remote: dict[str, bool] | None = None
        for key in keys:
            found = False
            for tier in self.tiers:
                if tier is self.remote:
                    if remote is None:
                        rest = keys[n:]
                        remote = dict(zip(rest, self.remote.contains_many(rest), strict=True))
                    has = remote[key]
                else:
                    has = tier.contains(key)
                if has:
                    found = True
                    break
                self.misses[tier.name] += 1
            if not found:
                break
            n += 1
        return n

    def start_restore(self, req_id: str, items: list[tuple[bytes, tuple[int, ...]]]) -> None:
        self._jobs.submit(req_id, _Restore(items, time.perf_counter(), threading.Event(), [],
                                           time.monotonic()))

    def restoring(self, req_id: str) -> bool:
        job = self._jobs.get(req_id)
        return job is not None and not job.done.is_set()

    def take_restore(self, req_id: str) -> list[StoredBlock] | None:
        """The verified blocks of a finished restore job (consumed), None if none finished."""
        job = self.take_restore_job(req_id)
        return None if job is None else job.blocks

    def take_restore_job(self, req_id: str) -> _Restore | None:
        """``take_restore`` with the job's timing and blocks per tier."""
        job = self._jobs.finished(req_id)
        if job is not None:
            self._jobs.cancel(req_id)
        return job

    def cancel(self, req_id: str) -> None:
        """Forget a request's restore (its result, if it comes, is dropped)."""
        self._jobs.cancel(req_id)

    def wait_any(self, timeout: float) -> None:
        """Sleep until some restore job finished (or ``timeout``)."""
        self._jobs.wait_any(timeout)

    def restore_now(self, block_ids: list[int], items: list[tuple[bytes, tuple[int, ...]]]
                    ) -> list[bool]:
        """Read, verify and install each block synchronously (a tensor-parallel worker rank,
        told by the driver); per block, whether it was missing or refused."""
        bad = []
        for block_id, (chain_hash, tokens) in zip(block_ids, items, strict=True):
            blk = self._read_one(chain_hash, tokens)
            if blk is not None:
                self.install([block_id], [blk])
            bad.append(blk is None)
        return bad

    def _run_restore(self, job: _Restore) -> None:
        # Only this thread reads the tiers in this process (restore_now runs in TP worker
        # ranks, other processes): the hits it adds are this job's.
        before = dict(self.hits)
        try:
            for chain_hash, tokens in job.items:
                blk = self._read_one(chain_hash, tokens)
                if blk is None:
                    break
                job.blocks.append(blk)
        except Exception:  # noqa: BLE001 - a failed restore is a miss
            logger.exception("kv tiers: restore failed")
        dt = time.perf_counter() - job.started
        job.seconds = dt
        job.by_tier = tuple((t, n - before.get(t, 0)) for t, n in self.hits.items()
                            if n > before.get(t, 0))
        self.restore_seconds += dt
        self.restore_hist[int(np.searchsorted(RESTORE_BUCKETS, dt))] += 1
        job.done.set()

    def _read_one(self, chain_hash: bytes, tokens: tuple[int, ...]) -> StoredBlock | None:
        key = entry_key(self.spec, chain_hash)
        for tier in self.tiers:
            try:
                blob = tier.get(key)
            except OSError as e:
                blob = None
                self._reject(tier, key, Rejected(Reason.UNREADABLE, str(e)))
            if blob is None:
                continue
            res = block_store.verify(self.spec, blob, chain_hash, tokens)
            if isinstance(res, Rejected):
                self._reject(tier, key, res)
                continue
            self.hits[tier.name] += 1
            if tier is not self.memory and self.memory is not None:
                evicted = self.memory.put(key, blob)  # promote
                if self.events is not None:
                    with self._events_lock:
                        block = self._announced.get(tier.name, {}).get(key)
                    self._announce(self.memory, key, block, evicted)
            return res
        return None

    def _reject(self, tier: MemoryTier | DiskTier | RemoteTier, key: str, why: Rejected) -> None:
        self.rejected[(tier.name, why.reason.value)] += 1
        logger.warning("kv tiers: %s entry %s refused: %s %s", tier.name, key, why.reason.value,
                       why.detail)
        tier.drop(key)
        self._announce_removed(tier, key)

    def install(self, block_ids: list[int], blocks: list[StoredBlock]) -> None:
        """Copy verified blocks into freshly allocated pool blocks (``block_store.install``)."""
        block_store.install(self.kv, block_ids, blocks)

    # ---- lifecycle / stats --------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._writes.put(None, timeout=5)  # (full only if flush timed out)
        self._jobs.stop()
        self._writer.join(timeout=10)
        self._reader.join(timeout=10)
        if self.disk is not None:
            self.disk.trim()
        if self.remote is not None:
            self.remote.close()

    def stats(self) -> dict:
        tiers = {}
        for t in self.tiers:
            tiers[t.name] = {
                "hits": self.hits[t.name], "misses": self.misses[t.name],
                "writes": self.writes[t.name], "bytes": t.bytes, "cap_bytes": t.cap,
                "evictions": t.evictions,
                "rejected": {r: n for (name, r), n in self.rejected.items() if name == t.name},
            }
            if t is self.remote:  # calls that failed / were skipped while it was down
                tiers[t.name].update(failures=t.failures, skipped=t.skipped, up=t.up)
        return {
            "tiers": tiers, "queue_depth": self._writes.qsize(),
            "queue_capacity": self._writes.maxsize, "dropped_writes": self.dropped_writes,
            "corrupt_in_pool": self.corrupt_in_pool,
            "restore_buckets": list(RESTORE_BUCKETS),
            "restore_counts": [int(x) for x in self.restore_hist],
            "restore_seconds": self.restore_seconds,
        }
