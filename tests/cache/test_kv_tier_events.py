"""KV events of the KV tiers (kvserve/cache/kv_tiers.py -> kv_events.py): each block a tier
newly holds is announced once with its medium and chain parent, each entry a tier evicts or
refuses is removed for that medium only, and the publisher keeps media apart."""

from __future__ import annotations

import threading

import torch

from kvserve.cache import block_store as bs
from kvserve.cache.kv_connector import BlockRef
from kvserve.cache.kv_events import BlockRemoved, BlockStored, KVEventPublisher, external_hash
from kvserve.cache.kv_tiers import KVTiers, TierConfig, entry_key

BS = 4


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._lock = threading.Lock()

    def stored(self, block_hash, parent_hash, token_ids, lora=None, medium=None) -> None:
        with self._lock:
            self.events.append(("stored", medium, block_hash, parent_hash, tuple(token_ids)))

    def removed(self, block_hash, medium=None) -> None:
        with self._lock:
            self.events.append(("removed", medium, block_hash))


def _tiers(tmp_path, memory_blocks: int) -> KVTiers:
    from kvserve.cache.kv_cache import PagedKVCache
    from kvserve.config import parse_kv_mode

    kv = PagedKVCache(1, 8, BS, 1, 8, 2, parse_kv_mode("bf16"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(0)))
    spec = bs.StoreSpec(model="m", kv_mode=kv.mode.name, rotation="r", fingerprint="f",
                        block_size=BS, num_layers=1, components=2, num_kv_heads=1, head_dim=8,
                        dtype=bs.dtype_str(kv.dtype), scale_dtype="")
    blob = len(bs.serialize(spec, bs.StoredBlock(
        b"x" * 16, (0,) * BS, kv.data[:, 0], None, bs.block_sums(kv.data[:, :1], None)[0])))
    cfg = TierConfig(memory_bytes=memory_blocks * blob + blob // 2, disk_dir=str(tmp_path / "kv"),
                     disk_bytes=2**20)
    return KVTiers(cfg, spec, kv)


def test_tiers_announce_stores_and_removals_per_medium(tmp_path) -> None:
    tiers = _tiers(tmp_path, memory_blocks=2)
    sink = Sink()
    tiers.events = sink
    try:
        h = [bytes([i]) * 16 for i in (1, 2, 3)]
        toks = [tuple(range(i * BS, (i + 1) * BS)) for i in range(3)]
        ev = [BlockRef(b, h[b], toks[b], None if b == 0 else h[b - 1]) for b in range(3)]
        tiers.write_down(ev, [None] * 3)
        tiers.flush()
        stored = [e for e in sink.events if e[0] == "stored"]
        for medium in ("cpu", "disk"):  # every block once per tier, with its chain parent
            assert [e[2:] for e in stored if e[1] == medium] == [
                (h[0], None, toks[0]), (h[1], h[0], toks[1]), (h[2], h[1], toks[2])]
        # the memory tier holds 2 blocks: the third write evicted the first, for "cpu" only
        assert [e for e in sink.events if e[0] == "removed"] == [("removed", "cpu", h[0])]
        # writing a block the tiers already hold announces nothing (and bumps it in memory)
        n = len(sink.events)
        tiers.write_down(ev[1:2], [None])
        tiers.flush()
        assert len(sink.events) == n
        # a restore from disk promotes the block into memory: stored "cpu" again (and the
        # memory tier's least recently used entry leaves it)
        tiers.start_load("r", ev[:1], None)
        tiers._jobs.get("r").done.wait(10)
        assert len(tiers.finished("r").blocks) == 1
        assert sink.events[n:] == [("removed", "cpu", h[2]),
                                   ("stored", "cpu", h[0], None, toks[0])]
        # a refused disk entry is removed for "disk"
        key = entry_key(tiers.spec, h[2])
        with open(tiers.disk.path(key), "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
        tiers.memory.drop(key)
        n = len(sink.events)
        tiers.start_load("r2", ev[2:], None)
        tiers._jobs.get("r2").done.wait(10)
        assert tiers.finished("r2").blocks == []
        assert sink.events[n:] == [("removed", "disk", h[2])]
    finally:
        tiers.close()


def test_publisher_keeps_media_apart() -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:0", block_size=BS, medium="CPU")
    try:
        pub._stop.set()  # drain by hand: the thread publishes nothing more
        pub._thread.join(5)
        a, b = b"a" * 16, b"b" * 16
        pub.stored(a, None, (1, 2, 3, 4))
        pub.stored(b, a, (5, 6, 7, 8))  # chained, same medium: merged
        pub.stored(b, a, (5, 6, 7, 8), medium="disk")  # chained, other medium: apart
        pub.removed(a)
        pub.removed(b, medium="cpu")
        ea, eb = external_hash(a), external_hash(b)
        assert pub._drain() == [
            BlockStored((ea, eb), None, (1, 2, 3, 4, 5, 6, 7, 8), BS, medium="CPU"),
            BlockStored((eb,), ea, (5, 6, 7, 8), BS, medium="disk"),
            BlockRemoved((ea,), medium="CPU"), BlockRemoved((eb,), medium="cpu")]
    finally:
        pub._ctx.destroy(0)
