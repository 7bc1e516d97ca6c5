"""KV-cache events: the block pool's stores / evictions / resets, published over ZMQ in vLLM's
format. The payloads are decoded here with vLLM's own schema (msgspec structs written out as
``vllm.distributed.kv_events`` declares them), field by field, in both layouts; sequence
numbers and the replay socket follow vLLM's framing."""

# no `from __future__ import annotations`: msgspec resolves the local structs eagerly

import time

import msgspec
import pytest
import zmq

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.kv_cache_manager import hash_block
from kvserve.cache.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    decode_batch,
    encode_batch,
    external_hash,
)


def _vllm_schema(array_like: bool):
    """vLLM's KV-event structs (vllm/distributed/kv_events.py), for decoding only."""
    opts = dict(omit_defaults=True, gc=False)
    if array_like:
        opts["array_like"] = True

    class EventBatch(msgspec.Struct, **opts):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, tag=True, **opts):
        pass

    class VBlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None

    class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class VKVEventBatch(EventBatch, **opts):
        events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]

    return VKVEventBatch, VBlockStored, VBlockRemoved, VAllBlocksCleared


def _sub(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def _recv(sub: zmq.Socket, timeout_ms: int = 5000) -> tuple[bytes, int, bytes]:
    assert sub.poll(timeout_ms), "no KV event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), payload


def _slow_joiner(pub: KVEventPublisher, sub: zmq.Socket) -> None:
    """PUB drops what it sends before the subscription arrives: publish clears until one
    gets through, then drain them."""
    for _ in range(100):
        pub.cleared()
        if sub.poll(100):
            break
    else:
        raise AssertionError("subscriber never connected")
    time.sleep(0.05)
    while sub.poll(50):
        sub.recv_multipart()


@pytest.mark.parametrize("fmt", ["array", "map"])
def test_encoding_decodes_with_vllm_schema(fmt: str) -> None:
    batch = KVEventBatch(12.5, (
        BlockStored((11, 12), None, tuple(range(8)), 4, medium="CPU"),
        BlockStored((13,), 12, (9, 9, 9, 9), 4, medium="CPU"),
        BlockRemoved((11,), medium="CPU"),
        AllBlocksCleared(),
    ), 0)
    payload = encode_batch(batch, fmt)
    Batch, Stored, Removed, Cleared = _vllm_schema(array_like=fmt == "array")
    got = msgspec.msgpack.decode(payload, type=Batch)
    assert got.ts == 12.5 and got.data_parallel_rank == 0
    s0, s1, r, c = got.events
    assert isinstance(s0, Stored) and isinstance(s1, Stored)
    assert (s0.block_hashes, s0.parent_block_hash, s0.token_ids, s0.block_size) == \
        ([11, 12], None, list(range(8)), 4)
    assert (s0.lora_id, s0.medium, s0.lora_name, s0.extra_keys) == (None, "CPU", None, None)
    assert (s1.block_hashes, s1.parent_block_hash) == ([13], 12)
    assert isinstance(r, Removed) and (r.block_hashes, r.medium) == ([11], "CPU")
    assert isinstance(c, Cleared)
    assert decode_batch(payload) == batch  # and kvserve's own decoder reads it back


def test_decoder_refuses_garbage_and_skips_unknown_tags() -> None:
    import msgpack

    with pytest.raises(ValueError):
        decode_batch(b"\xc1\xc1")
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb({"events": 3}))
    future = msgpack.packb([1.0, [["BlockMoved", [1]], ["AllBlocksCleared"]]])
    assert decode_batch(future).events == (AllBlocksCleared(),)
    # a newer vLLM's extra trailing fields are tolerated
    extra = msgpack.packb([1.0, [["BlockRemoved", [5], "GPU", 0]]])
    assert decode_batch(extra).events == (BlockRemoved((5,), "GPU"),)


def test_pool_publishes_stores_evictions_and_reset() -> None:
    b = 4
    pub = KVEventPublisher("tcp://127.0.0.1:0", block_size=b,
                           replay_endpoint="tcp://127.0.0.1:0", interval_s=0.005)
    sub = _sub(pub.endpoint)
    try:
        _slow_joiner(pub, sub)
        first_seq = pub.next_seq
        pool = BlockPool(3, event_sink=pub)
        ids = pool.allocate(2)
        toks = [(1, 2, 3, 4), (5, 6, 7, 8)]
        h0 = hash_block(b"salt", toks[0])
        h1 = hash_block(h0, toks[1])
        pool.register(ids[0], h0, toks[0])
        pool.register(ids[1], h1, toks[1], parent_hash=h0)
        pool.free(ids[::-1])
        pool.allocate(3)  # evicts both cached blocks
        _, seq, payload = _recv(sub)
        events = list(decode_batch(payload).events)
        while sum(isinstance(e, BlockRemoved) for e in events) < 1:
            _, seq, payload = _recv(sub)
            events += decode_batch(payload).events
        assert seq >= first_seq
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        # the chained stores: one event (merged) or two, the second naming the first as parent
        hashes = [h for e in stored for h in e.block_hashes]
        assert hashes == [external_hash(h0), external_hash(h1)]
        assert stored[0].parent_block_hash is None
        assert [t for e in stored for t in e.token_ids] == [1, 2, 3, 4, 5, 6, 7, 8]
        assert all(e.block_size == b for e in stored)
        assert sorted(removed) == sorted(hashes)
        pool2 = BlockPool(2, event_sink=pub)
        (x,) = pool2.allocate(1)
        pool2.register(x, h0, toks[0])
        pool2.reset_prefix_cache()  # one AllBlocksCleared, no per-block removals
        evs: list = []
        while not any(isinstance(e, AllBlocksCleared) for e in evs):
            evs += decode_batch(_recv(sub)[2]).events
        assert not any(isinstance(e, BlockRemoved) for e in evs)
        # replay: everything from first_seq on, then the end marker
        last = pub.next_seq - 1
        req = zmq.Context.instance().socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(pub.replay_endpoint)
        req.send_multipart((b"", first_seq.to_bytes(8, "big")))
        seqs = []
        while True:
            assert req.poll(5000)
            _, s, p = req.recv_multipart()
            if s == END_SEQ:
                assert p == b""
                break
            seqs.append(int.from_bytes(s, "big"))
            decode_batch(p)
        assert seqs == list(range(first_seq, last + 1))
        req.close(0)
    finally:
        sub.close(0)
        pub.close()


def test_bad_endpoint_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="kv_events_endpoint"):
        KVEventPublisher("tcp://256.0.0.1:1", block_size=16)
    with pytest.raises(ValueError, match="kv_events_format"):
        KVEventPublisher("tcp://127.0.0.1:0", block_size=16, fmt="json")
