"""``Admission`` and ``FairQueue`` on their own (no engine): sequences, turns, priorities."""

from __future__ import annotations

import pytest

from kvserve.http.errors import APIError
from kvserve.server.admission import Admission, FairQueue


class Item:
    def __init__(self, name: str, prompts: int, n: int = 1, priority: int = 0) -> None:
        self.name, self.left, self.n, self.priority = name, prompts, n, priority
        self.log: list[str] = []

    @property
    def sequences_per_prompt(self) -> int:
        return self.n

    @property
    def has_pending(self) -> bool:
        return self.left > 0

    def dispatch_next(self, charge: int) -> None:
        self.left -= 1
        self.log.append(f"{self.name}:{charge}")


def test_admission_counts_sequences():
    a = Admission(10)
    t1 = a.admit(2, 4)  # 8 sequences
    assert (a.sequences, a.requests) == (8, 1)
    with pytest.raises(APIError) as e:
        a.admit(1, 3)
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    t2 = a.admit(2, 1)
    with pytest.raises(APIError) as e:
        a.admit(11, 1)  # can never fit, even on an idle server
    assert e.value.status == 400 and e.value.param == "prompt"
    with pytest.raises(APIError) as e:
        a.admit(3, 4)
    assert e.value.status == 400 and e.value.param == "n"
    assert e.value.code == "too_many_sequences"
    t1.release()
    t1.release()  # idempotent
    t2.release()
    assert (a.sequences, a.requests) == (0, 0)


def test_round_robin_across_requests():
    q = FairQueue(budget=2)
    order: list[str] = []
    big, small = Item("big", 6), Item("small", 1)
    big.log = small.log = order
    q.submit(big)
    assert order == ["big:1", "big:1"] and q.used == 2
    q.submit(small)  # waits: the engine budget is used; big already has the next turn
    q.release(1)
    q.release(1)
    assert order[2:] == ["big:1", "small:1"]  # one more of big's, then the newcomer's
    while q.used:
        q.release(1)
    assert big.left == 0 and q.waiting == 0


def test_a_prompt_wider_than_the_budget_is_not_skipped_forever():
    q = FairQueue(budget=4)
    order: list[str] = []
    narrow, wide, late = Item("narrow", 5), Item("wide", 1, n=16), Item("late", 1)
    narrow.log = wide.log = late.log = order
    q.submit(narrow)
    assert order == ["narrow:1"] * 4
    q.submit(wide)  # needs the whole budget (n=16 is charged as 4)
    q.release(1)
    assert order[4:] == ["narrow:1"] and narrow.left == 0
    q.release(1)
    q.submit(late)  # fits now, but wide's turn is first: late waits behind it
    assert order[5:] == []
    q.release(1)
    q.release(1)
    q.release(1)
    assert order[5:] == ["wide:4"]
    q.release(4)
    assert order[6:] == ["late:1"]


def test_priority_first_then_round_robin():
    q = FairQueue(budget=1, by_priority=True)
    order: list[str] = []
    items = [Item("low", 2, priority=5), Item("a", 2), Item("b", 2)]
    for it in items:
        it.log = order
    for it in items:
        q.submit(it)
    for _ in range(6):
        q.release(1)
    assert order == ["low:1", "a:1", "b:1", "a:1", "b:1", "low:1"]


def test_withdraw():
    q = FairQueue(budget=1)
    a, b = Item("a", 3), Item("b", 3)
    q.submit(a)
    q.submit(b)
    q.withdraw(b)
    q.release(1)
    assert b.left == 3 and a.left == 1
