"""KV-cache events in vLLM's wire format: what a replica's prefix cache holds, for routers.

The block pool reports each block that becomes prefix-cached (``BlockStored``), each cached
block that is evicted or quarantined (``BlockRemoved``) and a reset (``AllBlocksCleared``) to
its ``event_sink``. ``KVEventPublisher`` is that sink: the engine thread only appends to a
queue; a publisher thread gathers what arrived into one ``KVEventBatch`` every
``interval_s``, msgpack-encodes it and sends it on a ZMQ PUB socket as vLLM does:

    frames  (topic: bytes, seq: 8-byte big-endian unsigned, payload: msgpack KVEventBatch)

``seq`` counts batches from 0; a subscriber that sees a gap asks the ROUTER replay socket (when
one is bound) for everything from a sequence number on: it sends ``(b"", seq 8 bytes)`` and
gets ``(b"", seq, payload)`` per buffered batch, then ``(b"", -1 as 8 signed bytes, b"")``.

The payload follows ``vllm.distributed.kv_events`` field by field (msgspec structs with
``tag=True``): ``KVEventBatch = (ts, events, data_parallel_rank)``;
``BlockStored = ("BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name)``; ``BlockRemoved = ("BlockRemoved", block_hashes, medium)``;
``AllBlocksCleared = ("AllBlocksCleared",)``. Format ``array`` encodes each struct as an array
(``array_like=True``, what vLLM <= 0.11, llm-d and Dynamo decode); ``map`` as a map with a
``"type"`` key for the tag (newer vLLM). Fields at their default (``extra_keys``,
``group_idx``, ...) are omitted, as msgspec's ``omit_defaults`` does.

The pool's blocks carry ``medium`` "GPU" / "CPU" (the device of the KV cache); blocks the KV
tiers hold (``kv_tiers.py``) are announced by the tiers with ``medium`` "cpu" (host memory),
"disk" or "remote" (``TIER_MEDIA``), a ``BlockRemoved`` of that medium when a tier drops them.
A block can be held by several media at once; each announces and removes its own copy.

Block hashes on the wire are ``ExternalBlockHash`` integers: the first 8 bytes of kvserve's
16-byte chain hash, big-endian unsigned. ``token_ids`` of a ``BlockStored`` are the tokens of
all its blocks in order, so a consumer can rebuild the chain with its own hash function.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from kvserve.request import AdapterRef

logger = logging.getLogger("kvserve")

FORMATS = ("array", "map")
# The ``medium`` of blocks held by the KV tiers below the pool (host memory, disk, a remote
# store); the pool's own blocks are "GPU" or "CPU" (where its tensors live), as in vLLM.
TIER_MEDIA = ("cpu", "disk", "remote")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def external_hash(block_hash: bytes) -> int:
    """kvserve's 16-byte chain hash as vLLM's ``ExternalBlockHash`` (an unsigned 64-bit int)."""
    return int.from_bytes(block_hash[:8], "big")


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # len(block_hashes) * block_size tokens
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


# ---- encoding ---------------------------------------------------------------------------------
_FIELDS: dict[type, tuple[str, ...]] = {
    BlockStored: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name"),
    BlockRemoved: ("block_hashes", "medium"),
    AllBlocksCleared: (),
}
_BY_TAG = {cls.__name__: cls for cls in _FIELDS}


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def encode_batch(batch: KVEventBatch, fmt: str = "array") -> bytes:
    if fmt not in FORMATS:
        raise ValueError(f"kv_events_format must be one of {FORMATS}, got {fmt!r}")
    events: list[Any] = []
    for ev in batch.events:
        names = _FIELDS[type(ev)]
        if fmt == "array":
            events.append([type(ev).__name__] + [_plain(getattr(ev, n)) for n in names])
        else:
            events.append({"type": type(ev).__name__,
                           **{n: _plain(getattr(ev, n)) for n in names}})
    if fmt == "array":
        body: Any = [batch.ts, events]
        if batch.data_parallel_rank is not None:
            body.append(batch.data_parallel_rank)
    else:
        body = {"ts": batch.ts, "events": events}
        if batch.data_parallel_rank is not None:
            body["data_parallel_rank"] = batch.data_parallel_rank
    return msgpack.packb(body, use_bin_type=True)


def _event(raw: Any) -> KVEvent | None:
    """One event from either format; None for a tag this decoder does not know."""
    if isinstance(raw, dict):
        cls = _BY_TAG.get(raw.get("type"))
        if cls is None:
            return None
        kw = {n: raw.get(n) for n in _FIELDS[cls] if n in raw}
    elif isinstance(raw, list | tuple) and raw:
        cls = _BY_TAG.get(raw[0])
        if cls is None:
            return None
        kw = dict(zip(_FIELDS[cls], raw[1:], strict=False))  # later fields: defaults / extras
    else:
        raise ValueError(f"KV event is neither an array nor a map: {type(raw).__name__}")
    for name in ("block_hashes", "token_ids"):
        if name in kw:
            if not isinstance(kw[name], list | tuple):
                raise ValueError(f"KV event field {name} is not a list")
            kw[name] = tuple(kw[name])
    return cls(**kw)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Either format back into ``KVEventBatch``; ``ValueError`` on anything malformed (a
    consumer must verify what it reads off a socket before using it)."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types on bad input
        raise ValueError(f"KV event batch is not msgpack: {e}") from e
    if isinstance(body, dict):
        ts, events, rank = body.get("ts"), body.get("events"), body.get("data_parallel_rank")
    elif isinstance(body, list) and len(body) >= 2:
        ts, events = body[0], body[1]
        rank = body[2] if len(body) > 2 else None
    else:
        raise ValueError("KV event batch is neither (ts, events, ...) nor a map")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise ValueError("KV event batch has no numeric ts or no event list")
    decoded = tuple(e for e in (_event(r) for r in events) if e is not None)
    return KVEventBatch(float(ts), decoded, rank)


# ---- publishing -------------------------------------------------------------------------------
class KVEventPublisher:
    """The block pool's ``event_sink``: ``stored`` / ``removed`` / ``cleared`` are called on the
    engine thread and only enqueue; the publisher thread batches, encodes and sends.

    ``endpoint`` (and ``replay_endpoint``) are bound: ``tcp://*:5557``, ``tcp://127.0.0.1:0``
    (any free port; ``self.endpoint`` says which), ``ipc://...``."""

    def __init__(self, endpoint: str, *, block_size: int, medium: str = "CPU",
                 replay_endpoint: str | None = None, topic: str = "", fmt: str = "array",
                 data_parallel_rank: int | None = None, interval_s: float = 0.01,
                 buffer_batches: int = 10_000) -> None:
        import zmq

        if fmt not in FORMATS:
            raise ValueError(f"kv_events_format must be one of {FORMATS}, got {fmt!r}")
        self.block_size, self.medium, self.fmt = block_size, medium, fmt
        self.rank, self.interval_s = data_parallel_rank, interval_s
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._bind(self._pub, endpoint, "kv_events_endpoint")
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._bind(self._replay, replay_endpoint, "kv_events_replay_endpoint")
            self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.next_seq = 0  # publisher thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events",
                                        daemon=True)
        self._thread.start()

    def _bind(self, sock: Any, endpoint: str, param: str) -> None:
        import zmq

        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(0)
            raise ValueError(f"{param}: cannot bind {endpoint!r}: {e}") from e

    # ---- the pool's sink (engine thread) ----------------------------------------------------
    # Also the KV tiers' sink (``kvserve.cache.kv_tiers``), from their writer and restore
    # threads, with ``medium`` one of TIER_MEDIA: the queue is thread safe.
    def stored(self, block_hash: bytes, parent_hash: bytes | None,
               token_ids: tuple[int, ...], lora: AdapterRef | None = None,
               medium: str | None = None) -> None:
        self._queue.put(BlockStored(
            (external_hash(block_hash),),
            None if parent_hash is None else external_hash(parent_hash),
            tuple(token_ids), self.block_size, medium=medium or self.medium,
            lora_id=None if lora is None else lora.lora_id,
            lora_name=None if lora is None else lora.lora_name))

    def removed(self, block_hash: bytes, medium: str | None = None) -> None:
        self._queue.put(BlockRemoved((external_hash(block_hash),),
                                     medium=medium or self.medium))

    def cleared(self) -> None:
        self._queue.put(AllBlocksCleared())

    # ---- publisher thread ---------------------------------------------------------------------
    def _drain(self) -> list[KVEvent]:
        """Everything queued, with chained stores (each the parent of the next) merged into one
        ``BlockStored`` and consecutive removals into one ``BlockRemoved``."""
        out: list[KVEvent] = []
        while True:
            try:
                ev = self._queue.get_nowait()
            except queue.Empty:
                return out
            prev = out[-1] if out else None
            if (isinstance(ev, BlockStored) and isinstance(prev, BlockStored)
                    and ev.parent_block_hash == prev.block_hashes[-1]
                    and ev.lora_id == prev.lora_id and ev.medium == prev.medium):
                out[-1] = BlockStored(prev.block_hashes + ev.block_hashes,
                                      prev.parent_block_hash, prev.token_ids + ev.token_ids,
                                      prev.block_size, medium=prev.medium,
                                      lora_id=prev.lora_id, lora_name=prev.lora_name)
            elif (isinstance(ev, BlockRemoved) and isinstance(prev, BlockRemoved)
                  and ev.medium == prev.medium):
                out[-1] = BlockRemoved(prev.block_hashes + ev.block_hashes, medium=prev.medium)
            else:
                out.append(ev)

    def _send(self, events: list[KVEvent]) -> None:
        payload = encode_batch(KVEventBatch(time.time(), tuple(events), self.rank), self.fmt)
        seq = self.next_seq
        self.next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: ignoring a malformed replay request")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            stopping = self._stop.is_set()
            try:
                if self._replay is not None and poller.poll(0):
                    self._serve_replay()
                events = self._drain()
                if events:
                    self._send(events)
            except Exception:  # keep publishing: a router resyncs over the gap
                logger.exception("kv events: publishing failed")
            if stopping:
                return
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        """Publish what is queued, then stop the thread and close the sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5.0)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()
