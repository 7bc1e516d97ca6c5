"""Per-token acceptance from a suffix draft's evidence, calibrated online.

A suffix draft token comes with what the tree knows about it: how often it followed its
context (``q``: its count over the count of all continuations there), how often that context
occurred (``n``), and how long the matched context was (``m``). A token of a stretch the
output has repeated many times (``q`` 1, ``n`` 10, ``m`` 20) is all but certain; the first
token of a new value (a name after ``"name": "``: ``q`` 1/n) rarely is. The request's
per-token acceptance alpha alone prices both alike, so a perfectly repetitive stretch drafted
only ~3 tokens a step.

``Calibration`` buckets each verified draft token by those features and keeps decayed counts
of its outcomes (accepted, or the first rejected: positions past the first rejection were not
tried). A token's estimate backs off from its bucket to a coarse one (``q`` and ``n`` only) and
from there to the fallback (the request's alpha), each level weighed by its evidence: a
bucket with no history is alpha, one with many outcomes its own rate. The estimate is the
token's probability of acceptance given the draft's earlier tokens were accepted; the drafter
multiplies them along the draft.
"""

from __future__ import annotations

_Q = (0.5, 0.8, 0.95)  # conditional frequency bounds
_N = (2, 3, 5, 9)  # context occurrences bounds: 1, 2, 3-4, 5-8, 9+
_M = (2, 4, 8)  # match length bounds: 1, 2-3, 4-7, 8+
_DECAY = 0.97  # per outcome of the bucket
_WEIGHT = 4.0  # evidence (in outcomes) the level below counts as


def _level(x: float, bounds: tuple) -> int:
    i = 0
    while i < len(bounds) and x >= bounds[i]:
        i += 1
    return i


Bucket = tuple[int, int]  # (fine, coarse)


def bucket(count: int, total: int, match: int, source: int) -> Bucket:
    """The buckets of a draft token that followed ``count`` of the ``total`` times its
    context (matched over ``match`` tokens) occurred in tree ``source`` (0: the request's
    own, 1: an aligned context, realign.py, 2: the global tree)."""
    coarse = _level(count / total, _Q) * 8 + _level(total, _N)
    return (coarse * 8 + _level(match, _M)) * 4 + source, coarse


class Calibration:
    """Decayed (accepted, tried) counts per fine and per coarse bucket."""

    __slots__ = ("_fine", "_coarse")

    def __init__(self) -> None:
        # bucket -> [accepted, tried]
        self._fine: dict[int, list[float]] = {}
        self._coarse: dict[int, list[float]] = {}

    def estimate(self, b: Bucket, fallback: float) -> float:
        """The probability that a token of bucket ``b`` is accepted (its earlier tokens
        accepted); ``fallback`` where the buckets have little evidence."""
        acc, tried = self._coarse.get(b[1], (0.0, 0.0))
        p = (acc + _WEIGHT * fallback) / (tried + _WEIGHT)
        acc, tried = self._fine.get(b[0], (0.0, 0.0))
        return (acc + _WEIGHT * p) / (tried + _WEIGHT)

    def observe(self, buckets: list[Bucket | None], accepted: int) -> None:
        """A verified draft of ``len(buckets)`` tokens, its first ``accepted`` accepted (None:
        a token without tree evidence, e.g. one the grammar forced: not counted)."""
        for j, b in enumerate(buckets[: accepted + 1]):
            if b is None:
                continue
            hit = float(j < accepted)
            for table, key in ((self._fine, b[0]), (self._coarse, b[1])):
                c = table.get(key)
                if c is None:
                    c = table[key] = [0.0, 0.0]
                c[0] = c[0] * _DECAY + hit
                c[1] = c[1] * _DECAY + 1.0
