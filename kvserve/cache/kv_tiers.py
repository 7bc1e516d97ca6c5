"""KV tiers below the pool, a ``KVConnector`` (``kv_connector.py``): a bounded host-memory
tier, a bounded disk tier and a remote store (``remote_tier.py``) that keep sealed blocks after
the pool reuses them, and give them back, verified, on a later prefix hit.

Flow (docs/kv-tiers.md)::

    pool evicts a cached block ──copy bytes (step loop, one index_select)──> write queue
        (bounded; full -> the write is dropped and counted, the step never waits)
    writer thread: serialize (block_store) -> memory tier (LRU, byte cap)
                                           -> disk tier (write-through; tmp file + os.replace)
    prefix lookup past the pool's hits: which of the next chain blocks a tier holds (dict
        lookup / one stat per block; ``num_loadable``) -> a load job for the request (it
        waits, others run)
    load thread: read memory, else disk, else remote -> block_store.verify -> StoredBlocks
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

import numpy as np
import torch

from kvserve.cache import block_store
from kvserve.cache.block_store import Reason, Rejected, StoredBlock, StoreSpec
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.kv_connector import MISSING, BlockRef, KVConnector, KVPeers, Load
from kvserve.cache.remote_tier import RemoteTier

logger = logging.getLogger("kvserve.kv_tiers")

LOW_WATER = 0.9  # a disk trim deletes the oldest files down to this share of the cap
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 600.0  # temporary files older than this were left by a dead writer


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
    ref: BlockRef
    payload: torch.Tensor  # [L, C, bs, H, D] CPU copy
    scales: torch.Tensor | None
    sealed_sums: np.ndarray | None  # [L, 4] the pool's seal, when integrity is on


class KVTiers(KVConnector):
    """The tiers of one engine rank as a connector: blocks the pool evicts are written down
    (``on_evict``: copied on the step loop, stored by the writer thread); a prefix lookup past
    the pool's hits asks ``num_loadable`` and the load thread reads them back, verified."""

    name = "tiers"

    def __init__(self, cfg: TierConfig, spec: StoreSpec, kv_cache: PagedKVCache,
                 peers: KVPeers | None = None, threads: int = 1) -> None:
        assert cfg.enabled
        super().__init__(spec, kv_cache, peers, threads)
        self.cfg = cfg
        self.memory = MemoryTier(cfg.memory_bytes) if cfg.memory_bytes > 0 else None
        self.disk = DiskTier(cfg.disk_dir, cfg.disk_bytes) if cfg.disk_dir is not None else None
        self.remote = (RemoteTier(cfg.remote_url, cfg.remote_timeout_s)
                       if cfg.remote_url is not None else None)
        self.tiers: list[MemoryTier | DiskTier | RemoteTier] = [
            t for t in (self.memory, self.disk, self.remote) if t is not None]
        self.persistent = self.disk is not None or self.remote is not None
        self.hits: Counter[str] = Counter()  # blocks restored, by tier
        self.misses: Counter[str] = Counter()  # chain blocks looked for and absent, by tier
        self.writes: Counter[str] = Counter()  # blocks written, by tier
        self.rejected: Counter[tuple[str, str]] = Counter()  # (tier, reason)
        self.dropped_writes = 0  # write-downs refused by a full queue
        self.corrupt_in_pool = 0  # evicted blocks whose bytes no longer matched their seal
        # KV events: per tier, the entries announced as stored: key -> (hash, parent, tokens).
        self._events_lock = threading.Lock()
        self._announced: dict[str, dict[str, tuple[bytes, bytes | None, tuple[int, ...]]]] = {}
        self._writes: queue.Queue[_Write | None] = queue.Queue(maxsize=cfg.queue_blocks)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                        daemon=True)
        self._writer.start()
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
    def on_evict(self, refs: list[BlockRef], sums: list[np.ndarray | None],
                 wait: bool) -> None:
        self.write_down(refs, sums, wait)
        if self.peers is not None and refs:  # before any rank's next step overwrites them
            self.peers.kv_save(self.name, refs, None, wait)

    def save_slice(self, refs: list[BlockRef], arg: str | None, wait: bool) -> int:
        self.write_down(refs, [None] * len(refs), wait)
        return 0

    def write_down(self, evicted: list[BlockRef], sealed_sums: list[np.ndarray | None],
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
        payload, scales = self.copy_out([e.block_id for e, _ in todo])
        for i, (e, s) in enumerate(todo):
            w = _Write(e, payload[:, i], None if scales is None else scales[:, i], s)
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
        blob = self.serialize(w.ref, w.payload, w.scales, sums)
        key = entry_key(self.spec, w.ref.chain_hash)
        for tier in self.tiers:
            after = tier.put(key, blob)
            self.writes[tier.name] += 1
            if self.events is not None:
                r = w.ref
                self._announce(tier, key, (r.chain_hash, r.parent_hash, r.token_ids), after)

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
    def num_loadable(self, refs: list[BlockRef], handle: dict | None) -> int:
        """How many of ``refs`` (the chain's next blocks, in order) some tier holds. The
        remote store is asked once, for every block the local tiers lack (one round trip)."""
        if handle is not None:
            return 0
        n = 0
        keys = [entry_key(self.spec, r.chain_hash) for r in refs]
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

    def load(self, job: Load) -> None:
        # Only this thread reads the tiers in this process (load_slice runs in TP worker
        # ranks, other processes): the hits it adds are this job's.
        before = dict(self.hits)
        try:
            for r in job.refs:
                blk = self._read_one(r.chain_hash, r.token_ids)
                if blk is None:
                    break
                job.blocks.append(blk)
        finally:
            job.by_tier = tuple((t, n - before.get(t, 0)) for t, n in self.hits.items()
                                if n > before.get(t, 0))

    def load_slice(self, refs: list[BlockRef], arg: dict | None) -> tuple[list[int], int]:
        """Read, verify and install each block synchronously (a tensor-parallel worker rank,
        told by the driver)."""
        codes = []
        for r in refs:
            blk = self._read_one(r.chain_hash, r.token_ids)
            if blk is not None:
                self.install([r.block_id], [blk])
            codes.append(0 if blk is not None else MISSING)
        return codes, 0

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
            res = self.verify(blob, BlockRef(-1, chain_hash, tokens))
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

    # ---- lifecycle / stats --------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._writes.put(None, timeout=5)  # (full only if flush timed out)
        super().close()
        self._writer.join(timeout=10)
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
            "restore_buckets": list(self.buckets),
            "restore_counts": [int(x) for x in self.load_hist],
            "restore_seconds": self.load_seconds,
        }
