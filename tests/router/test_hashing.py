"""Consistent hashing with bounded load: hand-worked capacities and placements, and the
properties that make it consistent (Hypothesis): a replica leaving moves only its own keys, a
replica joining takes keys only for itself, and no replica is ever filled past capacity."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.hashing import HashRing, capacity, ring_hash
from kvserve.router.policy import Candidate, decide


def test_capacity_hand_worked() -> None:
    # ceil(c * (m + 1) / n)
    assert capacity(0, 2, 1.25) == 1  # ceil(0.625)
    assert capacity(1, 2, 1.25) == 2  # ceil(1.25)
    assert capacity(3, 2, 1.25) == 3  # ceil(2.5)
    assert capacity(9, 4, 1.0) == 3  # ceil(2.5)
    assert capacity(7, 3, 1.5) == 4  # ceil(4.0)


def test_ring_walk_hand_worked() -> None:
    ring = HashRing(["a", "b"], vnodes=1)
    pa, pb = ring_hash("a#0"), ring_hash("b#0")
    lo, hi = sorted([(pa, "a"), (pb, "b")])
    # a key just after the lower point goes to the higher point's replica, and vice versa
    key_between = next(k for k in (f"k{i}" for i in range(10_000))
                       if lo[0] < ring_hash(k) <= hi[0])
    assert ring.walk(key_between) == [hi[1], lo[1]]
    key_after = next(k for k in (f"k{i}" for i in range(10_000)) if ring_hash(k) > hi[0])
    assert ring.walk(key_after) == [lo[1], hi[1]]  # wraps around
    # bounded load: the first choice full (load 2 >= cap ceil(1.25 * 3 / 2) = 2) -> the next
    assert ring.assign(key_between, {hi[1]: 2, lo[1]: 0}) == lo[1]
    assert ring.assign(key_between, {hi[1]: 1, lo[1]: 0}) == hi[1]  # 1 < 2: stays


names = st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=2, max_size=6,
                 unique=True)
keys = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=60, unique=True)


@settings(max_examples=60, deadline=None)
@given(names, keys, st.data())
def test_removing_a_replica_moves_only_its_keys(replicas, ks, data) -> None:
    ring = HashRing(replicas, vnodes=16)
    before = {k: ring.assign(k, {}) for k in ks}
    gone = data.draw(st.sampled_from(replicas))
    ring.remove(gone)
    after = {k: ring.assign(k, {}) for k in ks}
    for k in ks:
        if before[k] != gone:
            assert after[k] == before[k]
        else:
            assert after[k] != gone
    ring.add(gone)  # and it comes back to the same keys
    assert {k: ring.assign(k, {}) for k in ks} == before


@settings(max_examples=60, deadline=None)
@given(names, keys)
def test_adding_a_replica_takes_keys_only_for_itself(replicas, ks) -> None:
    ring = HashRing(replicas[:-1], vnodes=16)
    before = {k: ring.assign(k, {}) for k in ks}
    ring.add(replicas[-1])
    for k in ks:
        now = ring.assign(k, {})
        assert now == before[k] or now == replicas[-1]


@settings(max_examples=60, deadline=None)
@given(names, keys, st.floats(1.0, 2.0))
def test_bounded_load_never_exceeds_capacity(replicas, ks, c) -> None:
    ring = HashRing(replicas, vnodes=8)
    loads = {r: 0 for r in replicas}
    for k in ks:
        cap = capacity(sum(loads.values()), len(replicas), c)
        r = ring.assign(k, loads, c)
        assert loads[r] < cap
        loads[r] += 1
    assert max(loads.values()) <= capacity(len(ks) - 1, len(replicas), c)


def test_decide_order_session_prefix_least_loaded() -> None:
    ring = HashRing(["r0", "r1"])
    c = [Candidate("r0", 0), Candidate("r1", 0)]
    kw = dict(ring=ring, rr_turn=0, load_factor=1.25, load_cost_tokens=64.0)
    s = decide("auto", c, session="user-1", matches={"r1": 512}, **kw)
    assert s.reason == "session" and s.replica == ring.assign("user-1", {})
    p = decide("auto", c, session=None, matches={"r1": 512}, **kw)
    assert (p.replica, p.reason, p.matched_tokens) == ("r1", "prefix", 512)
    # the prefix replica is busy: 512 - 64 * 1 = 448 > 0 - 64 * 0 still wins (capacity
    # ceil(1.25 * 2 / 2) = 2 > 1)
    busy = [Candidate("r0", 0), Candidate("r1", 1)]
    assert decide("auto", busy, session=None, matches={"r1": 512}, **kw).replica == "r1"
    # a short prefix is not worth the load: 32 - 64 * 1 < 0
    assert decide("auto", busy, session=None, matches={"r1": 32}, **kw).replica == "r0"
    # past the bounded load (3 >= ceil(1.25 * 4 / 2) = 3) even a long prefix goes elsewhere
    full = [Candidate("r0", 0), Candidate("r1", 3)]
    assert decide("auto", full, session=None, matches={"r1": 4096}, **kw).replica == "r0"
    ll = decide("auto", [Candidate("r0", 2), Candidate("r1", 1)], session=None, matches={},
                **kw)
    assert (ll.replica, ll.reason) == ("r1", "least_loaded")
    assert decide("prefix", c, session="user-1", matches={}, **kw).reason == "least_loaded"
    rr = [decide("round-robin", c, session=None, matches={}, ring=ring, rr_turn=t,
                 load_factor=1.25, load_cost_tokens=64.0).replica for t in range(4)]
    assert rr == ["r0", "r1", "r0", "r1"]


def test_least_loaded_ties_rotate() -> None:
    ring = HashRing(["r0", "r1", "r2"])
    idle = [Candidate("r0", 0), Candidate("r1", 0), Candidate("r2", 0)]
    picks = [decide("least-loaded", idle, session=None, matches={}, ring=ring, rr_turn=t,
                    load_factor=1.25, load_cost_tokens=64.0).replica for t in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]
    busy = [Candidate("r0", 1), Candidate("r1", 0, 0.5), Candidate("r2", 0, 0.1)]
    assert {decide("least-loaded", busy, session=None, matches={}, ring=ring, rr_turn=t,
                   load_factor=1.25, load_cost_tokens=64.0).replica for t in range(3)} == {"r2"}
