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
