"""One interface for every place KV goes outside the pool, shaped like vLLM's
``KVConnectorBase_V1`` (docs/kv-connector.md): the tiers (``kv_tiers.py``), the PD transfer
(``kv_transfer.py``) and third-party connectors (``--kv-connector module:Class``) subclass
``KVConnector``. Scheduler side (``KVCacheManager`` calls it on rank 0's step thread): how many
of a request's next blocks it can load, start / poll / cancel the load, what to save on an
eviction or a finished request. Worker side: the load threads read and ``verify`` (always
``block_store.verify``), ``commit_load`` installs on every tensor-parallel rank (``KVPeers``).
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvserve.cache import block_store
from kvserve.cache.block_store import Rejected, StoredBlock, StoreSpec
from kvserve.cache.kv_cache import PagedKVCache

logger = logging.getLogger("kvserve.kv_connector")

# Load latency histogram bucket bounds (seconds).
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A peer rank's per-block verdict crosses ranks as a code: 0 = verified, i = PEER_REASONS[i-1].
PEER_REASONS = (*(r.value for r in block_store.Reason), "missing")
MISSING = len(PEER_REASONS)


@dataclass(frozen=True, slots=True)
class BlockRef:
    """A block leaving or entering the pool: where it is (-1: not in the pool) and its
    identity in the chain (a prompt's last block may hold fewer than block_size tokens)."""

    block_id: int
    chain_hash: bytes
    token_ids: tuple[int, ...]
    parent_hash: bytes | None = None  # the chain block before it (KV events only)


@dataclass(slots=True)
class Load:
    """One request's load: the blocks asked for, in chain order, and what came of it."""

    refs: list[BlockRef]
    handle: dict | None = None  # PD: the prefill replica's transfer handle
    start_monotonic: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    blocks: list[StoredBlock] = field(default_factory=list)  # the verified prefix
    seconds: float = 0.0
    nbytes: int = 0  # bytes fetched
    rejected: int = 0  # blocks refused or missing
    failed: str | None = None  # nothing usable arrived: why
    by_tier: tuple[tuple[str, int], ...] = ()  # blocks read back, per tier


class KVPeers(Protocol):
    """The other tensor-parallel ranks (kvserve.engine.executor.MultiprocExecutor): each saves
    and loads its own slice of the blocks through its connector of the same name."""

    # -> the bytes they saved
    def kv_save(self, connector: str, refs: list[BlockRef], arg: str | None,
                wait: bool) -> int: ...
    # -> per block the reason some rank refused it (None: verified everywhere), their bytes
    def kv_load(self, connector: str, refs: list[BlockRef], arg: dict | None
                ) -> tuple[list[str | None], int]: ...


class KVEvents(Protocol):
    """Told which blocks a connector's store gains and loses
    (``kvserve.cache.kv_events.KVEventPublisher``); called from its threads."""

    def stored(self, block_hash: bytes, parent_hash: bytes | None,
               token_ids: tuple[int, ...], lora: None = None, medium: str | None = None
               ) -> None: ...
    def removed(self, block_hash: bytes, medium: str | None = None) -> None: ...


class KVConnector:
    """The base of every connector: request-keyed load jobs served in order by ``threads``
    load threads, and the shared copy / serialize / verify / install steps. A subclass sets
    ``name`` and overrides what it does; the defaults load and save nothing."""

    name = "connector"  # its key in KVCacheManager.connectors, stats and peer messages
    buckets = LOAD_BUCKETS
    saves_finished = False  # request_finished is called for every finished request
    persistent = False  # its saves outlive the process: the pool is saved into it at close

    def __init__(self, spec: StoreSpec, kv_cache: PagedKVCache, peers: KVPeers | None = None,
                 threads: int = 1) -> None:
        self.spec, self.kv_cache, self.peers = spec, kv_cache, peers
        self.events: KVEvents | None = None  # set by the engine builder before any save
        self.load_hist = np.zeros(len(self.buckets) + 1, dtype=np.int64)
        self.load_seconds = 0.0
        self._lock = threading.Lock()
        self._jobs: dict[str, Load] = {}
        self._queue: queue.Queue[Load | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._serve, name=f"kv-{self.name}-load{i}",
                                          daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    # ---- scheduler side -------------------------------------------------------------------
    def num_loadable(self, refs: list[BlockRef], handle: dict | None) -> int:
        """How many of ``refs`` (a request's next chain blocks, in order) this connector can
        load; ``handle``: a PD transfer handle naming the prefill replica's copy, else None."""
        return 0

    def start_load(self, req_id: str, refs: list[BlockRef], handle: dict | None) -> None:
        assert req_id not in self._jobs
        job = Load(refs, handle)
        self._jobs[req_id] = job
        self._queue.put(job)

    def loading(self, req_id: str) -> bool:
        return req_id in self._jobs

    def finished(self, req_id: str) -> Load | None:
        """The request's load once it finished (it stays until ``cancel``), else None."""
        job = self._jobs.get(req_id)
        return job if job is not None and job.done.is_set() else None

    def cancel(self, req_id: str) -> None:
        self._jobs.pop(req_id, None)  # (a thread still running it finishes it unseen)

    def wait_any(self, timeout: float) -> None:
        """Sleep until some load finished (or ``timeout``): an idle step loop does not spin."""
        for job in list(self._jobs.values()):
            if not job.done.is_set():
                job.done.wait(timeout)
                return

    def on_evict(self, refs: list[BlockRef], sums: list[np.ndarray | None],
                 wait: bool) -> None:
        """The pool evicts these cached blocks (``sums``: their seals, when integrity is on);
        copy what to keep before returning. ``wait``: shutdown, do not drop."""

    def request_finished(self, refs: list[BlockRef], sums: list[np.ndarray | None],
                         export: bool) -> dict | None:
        """A request finished (``saves_finished``): ``refs`` are its computed prompt blocks,
        the last one partial when the whole prompt was computed; ``export``: a PD prefill
        request, answered by a transfer handle."""
        return None

    # ---- worker side ----------------------------------------------------------------------
    def load(self, job: Load) -> None:
        """A load thread: read and verify ``job.refs`` in order into ``job.blocks`` (stop at
        the first missing or refused block). May raise: the blocks verified so far count."""

    def commit_load(self, job: Load, block_ids: list[int], blocks: list[StoredBlock]) -> int:
        """Install a finished load's verified ``blocks`` into fresh pool blocks; under tensor
        parallelism every other rank loads and installs its slice too. How many blocks every
        rank verified (the caller frees the rest)."""
        if block_ids:
            self.install(block_ids, blocks)
        if self.peers is None:
            return len(block_ids)
        refs = [BlockRef(x, b.chain_hash, b.token_ids)
                for x, b in zip(block_ids, blocks, strict=True)]
        reasons, nbytes = self.peers.kv_load(self.name, refs, job.handle)
        n = next((i for i, r in enumerate(reasons) if r is not None), len(block_ids))
        self.peers_loaded(reasons, nbytes, len(block_ids) - n)
        return n

    def peers_loaded(self, reasons: list[str | None], nbytes: int, dropped: int) -> None:
        """What the other ranks' ``load_slice`` reported (counters)."""

    def save_slice(self, refs: list[BlockRef], arg: str | None, wait: bool) -> int:
        return 0  # a rank > 0: save this rank's slice of ``refs``; its bytes

    def load_slice(self, refs: list[BlockRef], arg: dict | None) -> tuple[list[int], int]:
        """A rank > 0: load, verify and install this rank's slice of ``refs`` into their pool
        blocks; per block a ``PEER_REASONS`` code (0 = verified), and its bytes."""
        return [MISSING] * len(refs), 0

    def install(self, block_ids: list[int], blocks: list[StoredBlock]) -> None:
        block_store.install(self.kv_cache, block_ids, blocks)  # into freshly allocated pool blocks

    def verify(self, blob: bytes, ref: BlockRef) -> StoredBlock | Rejected:
        # the one check of every block that enters the pool, wherever it comes from
        return block_store.verify(self.spec, blob, ref.chain_hash, ref.token_ids)

    def copy_out(self, block_ids: list[int], last_filled: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blocks' bytes on the CPU, [L, n, C, bs, H, D] (and scales), copied now as bytes
        (FP8 has few CPU kernels); ``last_filled``: the last block's filled rows, the rest
        zeroed (unfilled rows hold stale bytes of an earlier owner)."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.data.device)

        def copy(t: torch.Tensor) -> torch.Tensor:
            b = t.view(torch.uint8).index_select(1, idx).cpu()
            if last_filled is not None and last_filled < self.spec.block_size:
                b[:, -1, :, last_filled:] = 0  # dim 3: the block's token rows
            return b.view(t.dtype)

        cache = self.kv_cache
        return copy(cache.data), None if cache.scales is None else copy(cache.scales)

    def serialize(self, ref: BlockRef, payload: torch.Tensor, scales: torch.Tensor | None,
                  sums: np.ndarray) -> bytes:  # payload [L, C, bs, H, D]
        return block_store.serialize(self.spec, StoredBlock(ref.chain_hash, ref.token_ids,
                                                            payload, scales, sums))

    def save_blobs(self, refs: list[BlockRef], sealed: list[np.ndarray | None]) -> list[bytes]:
        """The stored form of the pool blocks ``refs``, copied now (the last may be partial);
        their sums: the pool's seals (``sealed``) where given, else taken now."""
        payload, scales = self.copy_out([r.block_id for r in refs], len(refs[-1].token_ids))
        now = block_store.block_sums(payload, scales)  # [n, L, 4]
        return [self.serialize(r, payload[:, i], None if scales is None else scales[:, i],
                               sealed[i] if sealed[i] is not None else now[i])
                for i, r in enumerate(refs)]

    # ---- lifecycle / stats ----------------------------------------------------------------
    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self.load(job)
            except Exception as e:  # noqa: BLE001 - a failed load is a miss / a local prefill
                logger.exception("kv %s: load failed", self.name)
                if not job.blocks:
                    job.failed = job.failed or f"error:{type(e).__name__}"
            job.seconds = dt = time.monotonic() - job.start_monotonic
            with self._lock:
                self.load_seconds += dt
                self.load_hist[int(np.searchsorted(self.buckets, dt))] += 1
            job.done.set()

    def flush(self) -> None:  # wait until every save queued so far is stored (tests, shutdown)
        pass

    def close(self) -> None:
        for _ in self._threads:  # each ends once it took the jobs queued before
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []

    def describe(self) -> str:
        return f"KV connector {self.name} ({type(self).__module__}.{type(self).__name__})"

    def stats(self) -> dict:
        return {"load_buckets": list(self.buckets),
                "load_counts": [int(x) for x in self.load_hist],
                "load_seconds": self.load_seconds}


def load_connector(path: str) -> type[KVConnector]:
    """The class named by ``--kv-connector module:Class``; ValueError naming the parameter."""
    mod, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as e:  # ValueError: no module name
        raise ValueError(f"kv_connector {path!r} (module:Class) cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        raise ValueError(f"kv_connector {path!r} is not a subclass of "
                         "kvserve.cache.kv_connector.KVConnector")
    return cls
