"""Admission and fair dispatch, both counted in sequences (prompts x ``n``).

``Admission`` bounds what the server holds: at most ``--max-num-seqs + --max-queue`` sequences
are admitted at once; a request that would pass that gets 429, and one that needs more than
the whole bound (it could never be admitted) gets 400. ``FairQueue`` decides when an admitted
request's prompts reach the engine: it keeps at most ``budget`` sequences (twice
``--max-num-seqs``, so the engine's batch is always full) in the engine and hands out the
freed room one prompt at a time, round-robin across the waiting requests (by ``priority``
first under ``--scheduling-policy priority``). A request with 64 prompts x ``n=16`` therefore
takes turns with a one-prompt request that arrives after it instead of queueing its 1,024
sequences in front of it.

Both live on the event loop; nothing here is thread-safe or needs to be.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from kvserve.http.errors import APIError, bad_request


class Dispatchable(Protocol):
    priority: int

    @property
    def sequences_per_prompt(self) -> int: ...

    @property
    def has_pending(self) -> bool: ...

    def dispatch_next(self, charge: int) -> None: ...


class Ticket:
    """``sequences`` admitted; ``release()`` gives them back (idempotent)."""

    def __init__(self, admission: Admission, sequences: int) -> None:
        self._admission = admission
        self.sequences = sequences
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self.sequences)


class Admission:
    def __init__(self, max_sequences: int) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.max_sequences = max_sequences
        self.sequences = 0  # admitted, not yet released
        self.requests = 0

    def admit(self, prompts: int, n: int) -> Ticket:
        """Raises ``APIError``: 400 when the request can never fit, 429 when the server is full
        now (with ``Retry-After``)."""
        need = prompts * n
        if need > self.max_sequences:
            what = f"{prompts} prompt(s) x n={n}" if prompts > 1 else f"n={n}"
            raise bad_request(
                f"this request needs {need} sequences ({what}) but the server admits at most "
                f"{self.max_sequences} at a time (--max-num-seqs + --max-queue); send fewer "
                "prompts or a smaller n", "n" if n > 1 else "prompt", "too_many_sequences")
        if self.sequences + need > self.max_sequences:
            raise APIError(429, f"the server queue is full ({self.sequences} of "
                           f"{self.max_sequences} sequences admitted, this request needs "
                           f"{need}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        self.sequences += need
        self.requests += 1
        return Ticket(self, need)

    def _release(self, sequences: int) -> None:
        self.sequences -= sequences
        self.requests -= 1
        assert self.sequences >= 0 and self.requests >= 0, (self.sequences, self.requests)


class FairQueue:
    def __init__(self, budget: int, by_priority: bool = False) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.budget = budget
        self.by_priority = by_priority
        self.used = 0  # sequences charged to prompts in the engine
        self._turns: OrderedDict[Dispatchable, None] = OrderedDict()  # turn order

    @property
    def waiting(self) -> int:
        return len(self._turns)

    def submit(self, item: Dispatchable) -> None:
        if item.has_pending:
            self._turns[item] = None
            self._pump()

    def withdraw(self, item: Dispatchable) -> None:
        self._turns.pop(item, None)

    def release(self, charge: int) -> None:
        self.used -= charge
        assert self.used >= 0, self.used
        self._pump()

    def _next(self) -> Dispatchable:
        if self.by_priority:  # min() keeps the first of equals: round-robin among them
            return min(self._turns, key=lambda item: item.priority)
        return next(iter(self._turns))

    def _pump(self) -> None:
        while self._turns:
            item = self._next()
            # A prompt whose n exceeds the whole budget runs when the engine has room for it.
            charge = min(item.sequences_per_prompt, self.budget)
            if self.used + charge > self.budget:
                return  # its turn stays first: no request is skipped forever
            self.used += charge
            del self._turns[item]
            item.dispatch_next(charge)
            if item.has_pending:
                self._turns[item] = None  # back of the line
