"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

Each replica owns ``vnodes`` points on a 64-bit ring (``blake2b(name#i)``); a key goes to the
first point clockwise from ``blake2b(key)`` whose replica is below its capacity
``ceil(c * (total_load + 1) / n)``, so no replica carries more than ``c`` times the average
load (plus one) and a key only moves when its replica leaves, joins ahead of it on the ring, or
is full. Adding or removing one replica moves only the keys that replica gains or had.

Pure and deterministic: no clocks, no randomness beyond the hash.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping


def ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def capacity(total_load: int, num_replicas: int, load_factor: float) -> int:
    """The most load one replica may hold when one more unit is placed."""
    assert num_replicas > 0 and load_factor >= 1.0
    return math.ceil(load_factor * (total_load + 1) / num_replicas)


class HashRing:
    def __init__(self, replicas: Iterable[str] = (), vnodes: int = 64) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._points: list[tuple[int, str]] = []  # sorted (position, replica)
        self.members: set[str] = set()
        for r in replicas:
            self.add(r)

    def add(self, replica: str) -> None:
        if replica in self.members:
            return
        self.members.add(replica)
        for i in range(self.vnodes):
            bisect.insort(self._points, (ring_hash(f"{replica}#{i}"), replica))

    def remove(self, replica: str) -> None:
        if replica not in self.members:
            return
        self.members.discard(replica)
        self._points = [p for p in self._points if p[1] != replica]

    def walk(self, key: str) -> list[str]:
        """Every member once, in ring order from ``key``'s position (its preference list)."""
        if not self._points:
            return []
        start = bisect.bisect_left(self._points, (ring_hash(key), ""))
        seen: dict[str, None] = {}
        n = len(self._points)
        for i in range(n):
            seen.setdefault(self._points[(start + i) % n][1], None)
            if len(seen) == len(self.members):
                break
        return list(seen)

    def assign(self, key: str, loads: Mapping[str, int], load_factor: float = 1.25,
               allowed: set[str] | None = None) -> str | None:
        """The first replica on ``key``'s preference list (among ``allowed``, default all)
        whose load is below capacity; None when there is none to choose from."""
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        order = [r for r in self.walk(key) if allowed is None or r in allowed]
        if not order:
            return None
        cap = capacity(sum(loads.get(r, 0) for r in order), len(order), load_factor)
        for r in order:
            if loads.get(r, 0) < cap:
                return r
        return order[0]  # unreachable: some replica is always at or below the average
