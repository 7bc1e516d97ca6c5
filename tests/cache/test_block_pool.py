from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.cache.block_pool import BlockPool, DoubleFreeError, NoFreeBlocksError


def test_hand_worked_ids_and_eviction_order():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert a == [0, 1] and b == [2, 3, 4]
    assert pool.free_block_ids() == [5]
    pool.register(0, b"h0", (1, 2))
    pool.register(1, b"h1", (3, 4))
    pool.free(a[::-1])  # tail first: 1 then 0
    assert pool.free_block_ids() == [5, 1, 0]
    assert pool.lookup(b"h0", (1, 2)) == 0
    # Next allocation takes the never-cached block 5, then evicts cached block 1 (freed first).
    assert pool.allocate(1) == [5]
    assert pool.allocate(1) == [1]
    assert pool.lookup(b"h1", (3, 4)) is None  # evicted
    assert pool.lookup(b"h0", (1, 2)) == 0  # still cached, still free
    pool.touch([0])  # a prefix hit revives it
    assert pool.free_block_ids() == []
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free([0, 1, 5])
    pool.free(b)
    pool.check_invariants()
    assert pool.num_free_blocks == 6


def test_generation_changes_on_every_reuse():
    pool = BlockPool(1)
    [x] = pool.allocate(1)
    g = pool.blocks[x].generation
    pool.free([x])
    pool.allocate(1)
    assert pool.blocks[x].generation == g + 1


def test_double_free_raises():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(DoubleFreeError):
        pool.free([ids[0]])
    with pytest.raises(DoubleFreeError):
        x = pool.allocate(1)
        pool.free([x[0], x[0]])
    pool.check_invariants()


def test_collision_refused_by_content_check():
    pool = BlockPool(2)
    [x] = pool.allocate(1)
    pool.register(x, b"same-hash", (1, 2, 3))
    assert pool.lookup(b"same-hash", (9, 9, 9)) is None
    assert pool.lookup(b"same-hash", (1, 2, 3)) == x


def test_quarantined_block_never_returns():
    pool = BlockPool(3)
    ids = pool.allocate(2)
    pool.register(ids[0], b"h", (1,))
    pool.quarantine(ids[0])
    pool.free(ids)
    assert ids[0] not in pool.free_block_ids()
    assert pool.lookup(b"h", (1,)) is None
    assert pool.num_free_blocks == 2
    pool.check_invariants()


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(8)
        self.held: list[list[int]] = []  # each entry: one holder's references
        self.n = 0

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if n > self.pool.num_free_blocks:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        ids = self.pool.allocate(n)
        assert len(set(ids)) == n
        self.held.append(ids)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        ids = self.held.pop(i % len(self.held))
        self.pool.free(ids[::-1])

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def register_and_share(self, i):
        ids = self.held[i % len(self.held)]
        self.n += 1
        key = f"h{self.n}".encode()
        if self.pool.register(ids[0], key, (self.n,)):
            hit = self.pool.lookup(key, (self.n,))
            assert hit == ids[0]
            self.pool.touch([hit])
            self.held.append([hit])

    @rule()
    def double_free_is_loud(self):
        free = self.pool.free_block_ids()
        if free:
            with pytest.raises(DoubleFreeError):
                self.pool.free([free[0]])

    @invariant()
    def invariants(self):
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for ids in self.held:
            for b in ids:
                refs[b] = refs.get(b, 0) + 1
        for b, r in refs.items():
            assert self.pool.blocks[b].ref_cnt == r
        assert self.pool.num_free_blocks + len(refs) == self.pool.num_blocks
        assert self.pool.num_free_blocks <= self.pool.num_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
