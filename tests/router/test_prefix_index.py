"""The router's prefix index from KV events: chains rebuilt from token ids, removals,
resets, stores it cannot place, and prompt matches per replica."""

from __future__ import annotations

from kvserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.router.prefix_index import PrefixIndex

B = 4


def _store(hashes, parent, tokens):
    return BlockStored(tuple(hashes), parent, tuple(tokens), B)


def test_match_follows_each_replicas_chain() -> None:
    idx = PrefixIndex()
    doc = list(range(100, 112))  # 3 blocks
    idx.apply("r0", _store([1, 2], None, doc[:8]))
    idx.apply("r0", _store([3], 2, doc[8:12]))
    idx.apply("r1", _store([70], None, doc[:4]))  # another replica: other engine hashes
    assert idx.num_blocks("r0") == 3 and idx.num_blocks("r1") == 1
    # a prompt of the doc + 1 token: 3 full blocks can hit
    assert idx.match(doc + [5]) == {"r0": 12, "r1": 4}
    assert idx.match(doc) == {"r0": 8, "r1": 4}  # the last token is always computed
    assert idx.match([9] + doc) == {}
    idx.apply("r0", BlockRemoved((2,)))  # the middle block: the chain breaks there
    assert idx.match(doc + [5]) == {"r0": 4, "r1": 4}
    idx.apply("r1", AllBlocksCleared())
    assert idx.match(doc + [5]) == {"r0": 4}
    idx.clear("r0")
    assert idx.match(doc + [5]) == {} and idx.num_blocks("r0") == 0


def test_unplaceable_stores_are_dropped_and_copies_counted() -> None:
    idx = PrefixIndex()
    idx.apply("r0", _store([5], 999, [1, 2, 3, 4]))  # parent never seen
    assert idx.num_blocks("r0") == 0 and idx.dropped == 1
    idx.apply("r0", _store([6], None, [1, 2, 3]))  # wrong token count
    assert idx.dropped == 2
    # two salted copies of the same tokens (two engine hashes) are two holdings of one key
    idx.apply("r0", _store([7], None, [1, 2, 3, 4]))
    idx.apply("r0", _store([8], None, [1, 2, 3, 4]))
    idx.apply("r0", BlockRemoved((7,)))
    assert idx.match([1, 2, 3, 4, 0]) == {"r0": 4}
    idx.apply("r0", BlockRemoved((8,)))
    assert idx.match([1, 2, 3, 4, 0]) == {}


def test_tier_copies_keep_a_prefix_routable_weighted_by_medium() -> None:
    """A replica whose pool evicted a prefix that its disk still holds wins over one that never
    saw it; a pool copy outranks host memory ("cpu"), which outranks disk."""
    from kvserve.router.hashing import HashRing
    from kvserve.router.policy import Candidate, decide

    idx = PrefixIndex()
    doc = list(range(100, 112))  # 3 blocks
    prompt = doc + [5]
    idx.apply("other", _store([50], None, [9, 9, 9, 9]))  # never saw the doc
    # "disk": the pool stored the doc, the tiers wrote it down, the pool evicted it
    idx.apply("disk", _store([1, 2, 3], None, doc))
    idx.apply("disk", BlockStored((1, 2, 3), None, tuple(doc), B, medium="disk"))
    idx.apply("disk", BlockRemoved((1, 2, 3), medium="CPU"))
    assert idx.num_blocks("disk") == 3 and idx.blocks_by_medium("disk") == {"disk": 3}
    assert idx.match(prompt) == {"disk": 6}  # 3 blocks * 4 tokens * 0.5
    ring = HashRing()
    cands = [Candidate("other", 0), Candidate("disk", 0)]
    for turn in range(2):  # whichever replica the idle rotation favours
        d = decide("auto", cands, session=None, matches=idx.match(prompt), ring=ring,
                   rr_turn=turn, load_factor=1.25, load_cost_tokens=0.0)
        assert (d.replica, d.reason) == ("disk", "prefix")
    # a host-memory copy stored block by block (each parent known from the chain)
    idx.apply("host", _store([7], None, doc[:4]))
    idx.apply("host", BlockStored((8,), 7, tuple(doc[4:8]), B, medium="cpu"))
    idx.apply("host", BlockStored((9,), 8, tuple(doc[8:12]), B, medium="cpu"))
    idx.apply("pool", _store([4, 5, 6], None, doc))
    m = idx.match(prompt)
    assert m["pool"] == 12 and m["host"] == round(4 + 2 * 4 * 0.8) and m["disk"] == 6
    assert m["pool"] > m["host"] > m["disk"]
    # a copy in two media counts the better one; removing one medium leaves the other
    idx.apply("disk", BlockStored((1,), None, tuple(doc[:4]), B, medium="cpu"))
    assert idx.match(prompt)["disk"] == round(4 * 0.8 + 8 * 0.5)
    idx.apply("disk", BlockRemoved((1,), medium="disk"))
    assert idx.match(prompt)["disk"] == round(4 * 0.8 + 8 * 0.5)
    idx.apply("disk", BlockRemoved((1,), medium="cpu"))  # the chain's first block is gone
    assert "disk" not in idx.match(prompt) and idx.num_blocks("disk") == 2
    idx.apply("host", AllBlocksCleared())
    assert "host" not in idx.match(prompt) and idx.blocks_by_medium("host") == {}


def test_tier_store_after_its_parent_left_the_pool_is_placed() -> None:
    """The tiers' writer announces a block after the pool's removal of its parent (a request's
    blocks are evicted tail first): the parent is found among the removed blocks."""
    idx = PrefixIndex()
    doc = list(range(100, 108))  # 2 blocks
    idx.apply("r", _store([1, 2], None, doc))
    idx.apply("r", BlockRemoved((2, 1), medium="CPU"))
    assert idx.match(doc + [5]) == {} and idx.num_blocks("r") == 0
    idx.apply("r", BlockStored((2,), 1, tuple(doc[4:]), B, medium="disk"))  # child first
    idx.apply("r", BlockStored((1,), None, tuple(doc[:4]), B, medium="disk"))
    assert idx.dropped == 0 and idx.match(doc + [5]) == {"r": 4}  # 2 blocks * 4 * 0.5
    idx.clear("r")
    idx.apply("r", BlockStored((2,), 1, tuple(doc[4:]), B, medium="disk"))
    assert idx.dropped == 1  # a cleared replica's removed blocks are forgotten too


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _routed(ttl: float = 10.0, **kw) -> tuple[PrefixIndex, Clock]:
    clock = Clock()
    idx = PrefixIndex(ttl, clock=clock, **kw)
    idx.block_size = B  # as learned from a replica's GET /kv_events, before any event
    return idx, clock


def test_a_routed_prompt_matches_its_replica_until_it_expires() -> None:
    idx, clock = _routed(ttl=10.0)
    doc = list(range(100, 112))  # 3 blocks
    first = doc + [1, 2]  # 14 tokens: (14 - 1) // 4 = 3 blocks an engine could hit
    idx.record("r0", idx.prompt_keys(first))
    assert idx.num_routed("r0") == 3 and idx.num_blocks("r0") == 0  # no event seen
    assert idx.match(doc + [7, 8, 9]) == {"r0": 12}  # the next turn: all 3 blocks
    assert idx.match(doc[:8] + [0] * 5) == {"r0": 8}  # a shorter shared prefix
    assert idx.match(doc) == {"r0": 8}  # the last token is always computed
    assert idx.match([9] + doc) == {}
    clock.t += 9.9
    assert idx.match(doc + [5]) == {"r0": 12}
    clock.t += 0.1  # 10 s after the record: expired, and dropped
    assert idx.match(doc + [5]) == {} and idx.num_routed("r0") == 0
    # recording again restarts the clock; a second prompt appends only its own keys
    idx.record("r0", idx.prompt_keys(doc + [5]))
    clock.t += 6
    idx.record("r0", idx.prompt_keys(doc + [5, 6, 7, 8, 9]))  # 4 blocks, 3 already held
    assert idx.num_routed("r0") == 4
    clock.t += 6  # 12 s after the first record, 6 s after the second: all still held
    assert idx.match(doc + [5, 6, 7, 8, 0]) == {"r0": 16}


def test_routing_off_and_clear_forget_routed_prompts() -> None:
    idx, _ = _routed(ttl=0.0)  # routed_prefix_ttl 0: KV events only
    doc = list(range(100, 112))
    idx.record("r0", idx.prompt_keys(doc + [5]))
    assert idx.match(doc + [5]) == {} and idx.num_routed("r0") == 0
    idx, _ = _routed()
    idx.record("r0", idx.prompt_keys(doc + [5]))
    idx.record("r1", idx.prompt_keys(doc[:4] + [5]))
    idx.clear("r0")
    assert idx.match(doc + [5]) == {"r1": 4} and idx.num_routed("r0") == 0
    idx.apply("r1", AllBlocksCleared())  # the replica dropped its cache: its prompts too
    assert idx.match(doc + [5]) == {} and idx.num_routed("r1") == 0


def test_routed_and_event_holdings_combine_without_double_counting() -> None:
    idx, clock = _routed(ttl=10.0)
    doc = list(range(100, 116))  # 4 blocks
    prompt = doc + [5]
    idx.apply("A", _store([1, 2], None, doc[:8]))  # A holds 2 blocks by events
    idx.record("B", idx.prompt_keys(prompt))  # the prompt was routed to B
    assert idx.match(prompt) == {"A": 8, "B": 16}  # a key held on A and routed to B: both
    # B's events arrive for what was routed: each key counts once (4 blocks, not 8)
    idx.apply("B", _store([11, 12, 13, 14], None, doc))
    assert idx.match(prompt) == {"A": 8, "B": 16}
    # routed to A too, whose pool holds the first 2 blocks: still 4 blocks
    idx.record("A", idx.prompt_keys(prompt))
    assert idx.match(prompt) == {"A": 16, "B": 16}
    # a routed prompt counts as a pool hit over a disk-only copy: 1.0, not 1.0 + 0.5
    idx.apply("C", BlockStored((21, 22, 23, 24), None, tuple(doc), B, medium="disk"))
    assert idx.match(prompt)["C"] == 8  # 4 blocks * 4 tokens * 0.5
    idx.record("C", idx.prompt_keys(doc[:8] + [5]))  # its first 2 blocks routed
    assert idx.match(prompt)["C"] == 2 * 4 + 2 * 2  # 2 routed at 1.0, 2 on disk at 0.5
    clock.t += 10  # routed entries expired: the events alone remain
    assert idx.match(prompt) == {"A": 8, "B": 16, "C": 8}
    idx.clear("B")
    assert idx.match(prompt) == {"A": 8, "C": 8}


def test_routed_keys_are_bounded_oldest_first() -> None:
    idx, clock = _routed(ttl=10.0, routed_keys=5)
    a, b = list(range(100, 112)), list(range(200, 212))  # 3 blocks each
    idx.record("r0", idx.prompt_keys(a + [0]))
    clock.t += 1
    idx.record("r1", idx.prompt_keys(b + [0]))  # 6 entries > 5: a's oldest one dropped
    assert idx.num_routed("r0") == 2 and idx.num_routed("r1") == 3
    # a's tail went first (its leading block is its newest entry): a shorter prefix is left
    assert idx.match(a + [0]) == {"r0": 8} and idx.match(b + [0]) == {"r1": 12}
    clock.t += 1
    idx.record("r1", idx.prompt_keys(a[:4] + [0]))  # 1 more: a's next-oldest entry goes
    assert idx.match(a + [0]) == {"r0": 4, "r1": 4} and idx.num_routed("r0") == 1
    # re-recording refreshes an entry: it becomes the newest and is dropped last
    idx.record("r1", idx.prompt_keys(b + [0]))
    idx.record("r2", idx.prompt_keys([7, 7, 7, 7, 0]))
    assert idx.num_routed("r0") == 0 and idx.match(b + [0]) == {"r1": 12}
    assert sum(idx.num_routed(r) for r in ("r0", "r1", "r2")) == 5
    # expired entries are dropped lazily, by the next record or match
    clock.t += 10
    assert idx.match(b + [0]) == {}
    assert sum(idx.num_routed(r) for r in ("r0", "r1", "r2")) == 0
