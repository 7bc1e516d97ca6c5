"""Prefill/decode disaggregation, a ``KVConnector`` (``kv_connector.py``): a prompt's KV blocks
leave a prefill engine and enter a decode engine, every block verified on arrival
(docs/disaggregation.md).

Flow::

    prefill engine, request finished after its first token (``request_finished`` -> export):
        copy the prompt's blocks out of the pool (the last, partly filled one too: its unfilled
        rows zeroed) -> block_store.serialize each (sums: the pool's seal for full blocks,
        taken now for the partial one) -> transport.offer(transfer id, blobs) -> a handle
        (transfer id, transport, address, tokens, blocks, bytes) in the RequestOutput.
        The pool blocks are freed at once (cached, as after any request); the serialized copy
        waits in the sender's outbox until the decode side confirms, or ``timeout_s`` passes.
    decode engine, request added with the handle and the first token (Scheduler, waiting):
        load thread: transport.fetch (bounded in bytes and time) -> confirm -> verify
        every block (block_store.verify: digest over payload, scales, sums and identity;
        model, KV mode, rotation, fingerprint, token-chain hash, token ids; sums recomputed)
        -> the verified prefix (up to the first refused block).
        step thread: install it into fresh pool blocks (full ones sealed and cached), count
        those tokens as computed, and decode. Refused blocks and everything after them are
        recomputed from the tokens (``rejected{reason}``); a failed / timed-out fetch is a
        plain prefill on the decode engine (``fallbacks{reason}``).

Transports (both: nothing pickled; the bytes are block_store's, the control messages msgpack):
  * ``DirectoryTransport``: one shared directory (a tmpfs on one host). The sender writes
    ``<id>.<i>.kvb`` (tmp file + os.replace) and then ``<id>.ready`` (msgpack: block count and
    sizes); the receiver waits for ``.ready``, reads, and deletes the files (= confirm). A
    taken or expired transfer leaves an empty ``<id>.gone`` (the receiver's or the sender's),
    so a second fetch of it fails at once (``unknown_transfer``, as ZMQ's) instead of waiting
    out the timeout; the sender deletes its tombstones a TTL later (and orphans at start).
  * ``ZmqTransport``: the sender serves its outbox from a ROUTER socket (a thread); the
    receiver's DEALER asks ``{"op": "get", "id"}`` and gets ``[msgpack header, blob, ...]``,
    then sends ``{"op": "done", "id"}``. ZMQ_MAXMSGSIZE bounds every frame.

Tensor parallelism (rank to rank, the directory transport only): every rank exports its own
slice (its KV heads) under its own id (``slice_id``: the handle's id, ``-<rank>`` after it on
ranks > 0) and the handle names the number of ranks; on the decode side rank 0 fetches and
verifies its slice in the background as above, then (``KVPeers.kv_load``) every
other rank fetches, verifies and installs its own slice of those blocks. The rank and world
size are part of every block's identity, so a slice of another rank is refused. A block is
used only when every rank verified its slice; the first block refused on any rank and all
after it are recomputed. A handle from a prefill replica of another TP size is a fallback
(``tp_mismatch``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Protocol

import msgpack
import numpy as np
import zmq

from kvserve.cache.block_store import Rejected, StoredBlock, StoreSpec
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.kv_connector import (
    MISSING,
    PEER_REASONS,
    BlockRef,
    KVConnector,
    KVPeers,
    Load,
)

logger = logging.getLogger("kvserve.kv_transfer")

PROTOCOL_VERSION = 1
TRANSPORTS = ("dir", "zmq")
# Fetches at once: one slow / dead prefill replica does not hold up the others.
IMPORT_THREADS = 4
# Ranks > 0 fetch their slice on the step thread after rank 0 verified its own; the files were
# written before the handle was issued, so this only waits when the sender is gone.
PEER_FETCH_TIMEOUT_S = 0.5
# Transfer latency histogram bucket bounds (seconds): kvserve_kv_transfer_seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class TransferFailed(Exception):
    """A fetch that produced no blocks; ``reason`` is the fallbacks counter's label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TransferConfig:
    transport: str = "dir"  # dir | zmq
    directory: str | None = None  # dir: the shared directory
    endpoint: str = "tcp://127.0.0.1:*"  # zmq: where the sender binds (* = a free port)
    timeout_s: float = 30.0  # receiver: fetch deadline; sender: unconfirmed offers kept
    max_bytes: int = 4 << 30  # most bytes one transfer may carry

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv_transfer must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport == "dir" and not self.directory:
            raise ValueError("kv_transfer dir needs kv_transfer_dir (a shared directory)")
        if not self.timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout must be > 0, got {self.timeout_s}")
        if self.max_bytes < 1:
            raise ValueError(f"kv_transfer_max_mib must be > 0, got {self.max_bytes} bytes")


@dataclass(frozen=True, slots=True)
class TransferHandle:
    """What a decode engine needs to fetch one request's prompt KV (crosses processes as a
    plain dict: ``to_dict`` / ``from_dict``)."""

    transfer_id: str
    transport: str
    address: str  # the directory, or the sender's tcp:// endpoint
    num_tokens: int  # prompt tokens covered (full blocks + the partial one)
    num_blocks: int
    nbytes: int  # rank 0's slice (every rank's slice is as large)
    num_ranks: int = 1  # the prefill replica's tensor-parallel size (one slice per rank)

    def to_dict(self) -> dict:
        return {"version": PROTOCOL_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: object) -> TransferHandle:
        """Parse and check a handle; ValueError naming the field (``kv_transfer.<field>``)."""
        if not isinstance(d, dict):
            raise ValueError("kv_transfer must be an object (a prefill replica's handle)")
        if d.get("version") != PROTOCOL_VERSION:
            raise ValueError(f"kv_transfer.version must be {PROTOCOL_VERSION}")
        types = {"transfer_id": str, "transport": str, "address": str, "num_tokens": int,
                 "num_blocks": int, "nbytes": int}
        for k, t in types.items():
            v = d.get(k)
            if not isinstance(v, t) or isinstance(v, bool):
                raise ValueError(f"kv_transfer.{k} must be a {t.__name__}")
            if t is int and v < 0:
                raise ValueError(f"kv_transfer.{k} must be >= 0")
        if d["transport"] not in TRANSPORTS:
            raise ValueError(f"kv_transfer.transport must be one of {TRANSPORTS}")
        if not d["transfer_id"].replace("-", "").isalnum():
            raise ValueError("kv_transfer.transfer_id must be alphanumeric")
        ranks = d.get("num_ranks", 1)  # absent: a single-rank replica
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError("kv_transfer.num_ranks must be an int >= 1")
        return cls(**{k: d[k] for k in types}, num_ranks=ranks)


def slice_id(transfer_id: str, rank: int) -> str:
    """The id rank ``rank``'s slice of a transfer travels under (rank 0: the handle's own)."""
    return transfer_id if rank == 0 else f"{transfer_id}-{rank}"


class Transport(Protocol):
    expired: int  # offers dropped unconfirmed after their deadline

    def offer(self, transfer_id: str, blobs: list[bytes]) -> str: ...
    def fetch(self, handle: TransferHandle, timeout_s: float, max_bytes: int) -> list[bytes]: ...
    def expire(self) -> int: ...
    def outstanding(self) -> int: ...
    def close(self) -> None: ...


# ---- the shared-directory transport ---------------------------------------------------------
def _dir_path(directory: str, tid: str, i: int | None) -> str:
    return os.path.join(directory, f"{tid}.ready" if i is None else f"{tid}.{i:05d}.kvb")


def _gone_path(directory: str, tid: str) -> str:
    return os.path.join(directory, f"{tid}.gone")


def _mark_gone(directory: str, tid: str) -> None:
    with contextlib.suppress(OSError):  # a read-only dir: a second fetch times out instead
        open(_gone_path(directory, tid), "wb").close()


def _dir_delete(directory: str, tid: str, n: int) -> None:
    for i in [None, *range(n)]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_dir_path(directory, tid, i))


class DirectoryTransport:
    """Blocks as files in a shared directory (see the module docstring)."""

    def __init__(self, directory: str, ttl_s: float) -> None:
        self.dir = os.path.abspath(directory)
        os.makedirs(self.dir, exist_ok=True)
        self.ttl_s = ttl_s
        self._offers: dict[str, tuple[float, int]] = {}  # id -> (deadline, blocks)
        self._gone: dict[str, float] = {}  # id -> when its tombstone is deleted
        self.expired = 0
        now = time.time()  # tombstones a sender that died left behind, past any TTL
        for name in os.listdir(self.dir):
            if name.endswith(".gone"):
                with contextlib.suppress(OSError):
                    if now - os.path.getmtime(os.path.join(self.dir, name)) > ttl_s:
                        os.unlink(os.path.join(self.dir, name))

    def _write(self, path: str, data: bytes) -> None:
        tmp = os.path.join(self.dir, f".tmp-{os.getpid()}-{os.path.basename(path)}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # a reader sees the whole file or none

    def offer(self, transfer_id: str, blobs: list[bytes]) -> str:
        for i, b in enumerate(blobs):
            self._write(_dir_path(self.dir, transfer_id, i), b)
        self._write(_dir_path(self.dir, transfer_id, None), msgpack.packb(
            {"version": PROTOCOL_VERSION, "n": len(blobs), "sizes": [len(b) for b in blobs]}))
        self._offers[transfer_id] = (time.monotonic() + self.ttl_s, len(blobs))
        return self.dir

    def fetch(self, handle: TransferHandle, timeout_s: float, max_bytes: int) -> list[bytes]:
        if handle.nbytes > max_bytes:
            raise TransferFailed("too_large", f"{handle.nbytes} > {max_bytes} bytes")
        ready = os.path.join(handle.address, f"{handle.transfer_id}.ready")
        gone = _gone_path(handle.address, handle.transfer_id)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(ready):
            if os.path.exists(gone):
                raise TransferFailed("unknown_transfer", "taken or expired")
            if time.monotonic() > deadline:  # a dead sender: drop what it left
                _dir_delete(handle.address, handle.transfer_id, handle.num_blocks)
                raise TransferFailed("timeout", f"no {ready} after {timeout_s} s")
            time.sleep(0.002)
        try:
            with open(ready, "rb") as f:
                meta = msgpack.unpackb(f.read(1 << 20))
            n = int(meta["n"])
        except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            raise TransferFailed("bad_manifest", str(e)) from e
        blobs: list[bytes] = []
        total = 0
        for i in range(min(n, handle.num_blocks)):
            try:
                with open(_dir_path(handle.address, handle.transfer_id, i), "rb") as f:
                    b = f.read(max_bytes - total + 1)
            except OSError:
                break  # the rest is recomputed (counted missing by the caller)
            total += len(b)
            if total > max_bytes:
                raise TransferFailed("too_large", f"over {max_bytes} bytes")
            blobs.append(b)
        _mark_gone(handle.address, handle.transfer_id)
        _dir_delete(handle.address, handle.transfer_id, n)  # confirm: the sender's copy is gone
        return blobs

    def expire(self) -> int:
        """Forget confirmed offers, delete the files of those past their deadline (leaving
        a tombstone), and the tombstones a TTL old."""
        now, n = time.monotonic(), 0
        for tid, (deadline, nb) in list(self._offers.items()):
            if not os.path.exists(_dir_path(self.dir, tid, None)):
                del self._offers[tid]  # confirmed (the receiver deleted it)
                self._gone[tid] = now + self.ttl_s
            elif now > deadline:
                _mark_gone(self.dir, tid)
                _dir_delete(self.dir, tid, nb)
                del self._offers[tid]
                self._gone[tid] = now + self.ttl_s
                n += 1
        for tid, until in list(self._gone.items()):
            if now > until:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_gone_path(self.dir, tid))
                del self._gone[tid]
        self.expired += n
        return n

    def outstanding(self) -> int:
        self.expire()
        return len(self._offers)

    def close(self) -> None:
        for tid, (_, nb) in list(self._offers.items()):
            _dir_delete(self.dir, tid, nb)
        for tid in [*self._offers, *self._gone]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_gone_path(self.dir, tid))
        self._offers.clear()
        self._gone.clear()


# ---- the ZMQ transport ----------------------------------------------------------------------
class ZmqTransport:
    """The sender's outbox served from a ROUTER socket by one thread; fetches connect a DEALER
    (see the module docstring)."""

    def __init__(self, endpoint: str, ttl_s: float, max_bytes: int) -> None:
        self.endpoint, self.ttl_s, self.max_bytes = endpoint, ttl_s, max_bytes
        self.ctx = zmq.Context()
        self._outbox: dict[str, tuple[float, list[bytes]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._bound = threading.Event()
        self.address = ""
        self.expired = 0

    def _serve(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # requests are small
        sock.bind(self.endpoint)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(50) == 0:
                    self.expire()
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 2:
                    continue
                ident, raw = frames
                try:
                    msg = msgpack.unpackb(raw)
                    op, tid = msg["op"], str(msg["id"])
                except (ValueError, KeyError, TypeError, msgpack.UnpackException):
                    continue
                if op == "get":
                    with self._lock:
                        entry = self._outbox.get(tid)
                    if entry is None:
                        sock.send_multipart([ident, msgpack.packb({"ok": False,
                                                                   "error": "unknown"})])
                    else:
                        blobs = entry[1]
                        sock.send_multipart([ident, msgpack.packb({"ok": True,
                                                                   "n": len(blobs)}), *blobs],
                                            copy=False)
                elif op == "done":
                    with self._lock:
                        self._outbox.pop(tid, None)
        finally:
            sock.close(0)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="kv-transfer-send",
                                            daemon=True)
            self._thread.start()
            if not self._bound.wait(10):
                raise RuntimeError(f"kv transfer: cannot bind {self.endpoint}")

    def offer(self, transfer_id: str, blobs: list[bytes]) -> str:
        self._start()
        with self._lock:
            self._outbox[transfer_id] = (time.monotonic() + self.ttl_s, blobs)
        return self.address

    def fetch(self, handle: TransferHandle, timeout_s: float, max_bytes: int) -> list[bytes]:
        if handle.nbytes > max_bytes:
            raise TransferFailed("too_large", f"{handle.nbytes} > {max_bytes} bytes")
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        try:
            sock.connect(handle.address)
            sock.send(msgpack.packb({"op": "get", "id": handle.transfer_id}))
            if sock.poll(int(timeout_s * 1000)) == 0:
                raise TransferFailed("timeout", f"no answer from {handle.address}")
            frames = sock.recv_multipart()
            try:
                head = msgpack.unpackb(frames[0])
                ok, n = bool(head["ok"]), int(head.get("n", 0))
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
                raise TransferFailed("bad_manifest", str(e)) from e
            if not ok:
                raise TransferFailed("unknown_transfer", str(head.get("error")))
            blobs = [bytes(f) for f in frames[1:1 + n]]
            if sum(map(len, blobs)) > max_bytes:
                raise TransferFailed("too_large", f"over {max_bytes} bytes")
            sock.send(msgpack.packb({"op": "done", "id": handle.transfer_id}))
            return blobs
        finally:
            sock.close()

    def expire(self) -> int:
        now = time.monotonic()
        with self._lock:
            old = [t for t, (deadline, _) in self._outbox.items() if now > deadline]
            for t in old:
                del self._outbox[t]
        self.expired += len(old)
        return len(old)

    def outstanding(self) -> int:
        with self._lock:
            return len(self._outbox)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._outbox.clear()
        self.ctx.term()


def make_transport(cfg: TransferConfig) -> Transport:
    if cfg.transport == "dir":
        assert cfg.directory is not None
        return DirectoryTransport(cfg.directory, cfg.timeout_s)
    return ZmqTransport(cfg.endpoint, cfg.timeout_s, cfg.max_bytes)


# ---- export / import ------------------------------------------------------------------------
class KVTransfer(KVConnector):
    """One engine rank's side of disaggregation as a connector: exports when a prefill request
    finishes (``request_finished``), imports by handle on its load threads (decode role), and
    the counters /metrics shows."""

    name = "transfer"
    buckets = LATENCY_BUCKETS
    saves_finished = True

    def __init__(self, cfg: TransferConfig, spec: StoreSpec, kv_cache: PagedKVCache,
                 peers: KVPeers | None = None, threads: int = IMPORT_THREADS,
                 transport: Transport | None = None) -> None:
        assert spec.world_size == 1 or cfg.transport == "dir", "refused in settle()"
        super().__init__(spec, kv_cache, peers, threads)
        self.cfg = cfg
        self.transport = transport or make_transport(cfg)
        self.exported = 0  # transfers offered
        self.imported = 0  # transfers fetched (some blocks may have been refused)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.blocks_installed = 0
        self.rejected: Counter[str] = Counter()  # refused blocks by reason
        self.fallbacks: Counter[str] = Counter()  # imports that became a local prefill
        self._closed = False

    # ---- prefill side ---------------------------------------------------------------------
    def request_finished(self, refs: list[BlockRef], sums: list[np.ndarray | None],
                         export: bool) -> dict | None:
        return self.export(refs, sums).to_dict() if export else None

    def export(self, refs: list[BlockRef], sealed: list[np.ndarray | None],
               transfer_id: str | None = None) -> TransferHandle:
        """Serialize the prompt's blocks ``refs`` (the last may be partial: fewer tokens) and
        offer them; ``sealed``: the pool's seal sums of full blocks. Under TP rank 0 calls
        this; the other ranks export their slice (``save_slice``) before the handle is
        returned."""
        blobs = self.save_blobs(refs, sealed)
        tid = transfer_id or uuid.uuid4().hex
        address = self.transport.offer(slice_id(tid, self.spec.rank), blobs)
        nbytes = sum(map(len, blobs))
        self.exported += 1
        self.bytes_sent += nbytes
        if self.peers is not None:  # synchronous: every slice is offered before the handle
            self.bytes_sent += self.peers.kv_save(self.name, refs, tid, True)
        n_tokens = sum(len(r.token_ids) for r in refs)
        return TransferHandle(tid, self.cfg.transport, address, n_tokens, len(blobs), nbytes,
                              self.spec.world_size)

    def save_slice(self, refs: list[BlockRef], arg: str | None, wait: bool) -> int:
        """A rank > 0: offer this rank's slice under transfer id ``arg`` (sums taken now: this
        rank keeps only its seals' digests); returns its bytes."""
        assert arg is not None
        self.transport.expire()
        return self.export(refs, [None] * len(refs), arg).nbytes

    def load_slice(self, refs: list[BlockRef], arg: dict | None) -> tuple[list[int], int]:
        """A rank > 0: fetch this rank's slice of the transfer ``arg`` (its handle), verify
        ``refs`` and install the verified prefix into ``block_ids``. Nothing expected: only
        drop the slice's files (rank 0's fetch failed or everything was refused there)."""
        handle = TransferHandle.from_dict(arg)
        h = dataclasses.replace(handle, transfer_id=slice_id(handle.transfer_id,
                                                             self.spec.rank))
        if not refs:
            _dir_delete(h.address, h.transfer_id, h.num_blocks)
            return [], 0
        try:
            blobs = self.transport.fetch(h, PEER_FETCH_TIMEOUT_S, self.cfg.max_bytes)
        except TransferFailed as e:
            logger.warning("kv transfer %s: rank %d fetch failed (%s)", h.transfer_id,
                           self.spec.rank, e)
            return [MISSING] * len(refs), 0
        codes, blocks = [], []
        for i, r in enumerate(refs):
            res = self.verify(blobs[i], r) if i < len(blobs) else None
            if isinstance(res, StoredBlock):
                codes.append(0)
                if len(blocks) == i:
                    blocks.append(res)
            else:
                codes.append(MISSING if res is None else PEER_REASONS.index(res.reason.value) + 1)
                if res is not None:
                    logger.warning("kv transfer %s: rank %d block %d refused: %s %s",
                                   h.transfer_id, self.spec.rank, i, res.reason.value,
                                   res.detail)
        if blocks:
            self.install([r.block_id for r in refs[: len(blocks)]], blocks)
        return codes, sum(map(len, blobs))

    def expire(self) -> None:
        self.transport.expire()

    # ---- decode side ----------------------------------------------------------------------
    def num_loadable(self, refs: list[BlockRef], handle: dict | None) -> int:
        return 0 if handle is None else len(refs)

    def load(self, job: Load) -> None:
        assert job.handle is not None
        h = TransferHandle.from_dict(job.handle)
        if h.transport != self.cfg.transport:
            job.failed = "wrong_transport"
        elif h.num_ranks != self.spec.world_size:
            job.failed = "tp_mismatch"  # one slice per rank: the layouts must match
        elif h.num_blocks != len(job.refs) or h.num_tokens != sum(
                len(r.token_ids) for r in job.refs):
            job.failed = "wrong_prompt"  # a handle for another prompt
        else:
            try:
                blobs = self.transport.fetch(h, self.cfg.timeout_s, self.cfg.max_bytes)
            except TransferFailed as e:
                job.failed = e.reason
                logger.warning("kv transfer %s: fetch failed (%s); prefill locally",
                               h.transfer_id, e)
        if job.failed is not None:
            with self._lock:
                self.fallbacks[job.failed] += 1
            return
        reasons = ["missing"] * max(len(job.refs) - len(blobs), 0)
        for i, (blob, r) in enumerate(zip(blobs, job.refs, strict=False)):
            res = self.verify(blob, r)
            if isinstance(res, Rejected):
                reasons.append(res.reason.value)
                logger.warning("kv transfer %s: block %d refused: %s %s", h.transfer_id, i,
                               res.reason.value, res.detail)
            elif len(job.blocks) == i:  # the verified prefix
                job.blocks.append(res)
        job.nbytes, job.rejected = sum(map(len, blobs)), len(reasons)
        with self._lock:
            self.imported += 1
            self.bytes_received += job.nbytes
            self.rejected.update(reasons)

    def install(self, block_ids: list[int], blocks: list[StoredBlock]) -> None:
        super().install(block_ids, blocks)
        self.blocks_installed += len(blocks)

    def peers_loaded(self, reasons: list[str | None], nbytes: int, dropped: int) -> None:
        with self._lock:
            self.bytes_received += nbytes
            self.rejected.update(r for r in reasons if r is not None)
            self.blocks_installed -= dropped

    # ---- lifecycle / stats ----------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        super().close()
        self.transport.close()

    def stats(self) -> dict:
        return {
            "transport": self.cfg.transport, "exported": self.exported,
            "imported": self.imported, "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received, "blocks_installed": self.blocks_installed,
            "outstanding": self.transport.outstanding(), "expired": self.transport.expired,
            "rejected": dict(self.rejected), "fallbacks": dict(self.fallbacks),
            "latency_buckets": list(LATENCY_BUCKETS),
            "latency_counts": [int(x) for x in self.load_hist],
            "latency_seconds": self.load_seconds,
        }
