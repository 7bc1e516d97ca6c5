"""Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
longest n-gram (``max_n`` down to ``min_n`` tokens) that ends the sequence.

The index is incremental: each call inserts only the n-grams that ended since the last one, so a
step costs O(max_n - min_n) dict operations per request, whatever the context length.
"""

from __future__ import annotations


class NgramIndex:
    """One sequence's n-grams -> the position right after their latest occurrence."""

    __slots__ = ("min_n", "max_n", "_last", "_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self._last: dict[tuple[int, ...], int] = {}
        # n-grams ending at positions <= _indexed are in _last (the one ending the sequence is
        # not: a lookup wants an *earlier* occurrence)
        self._indexed = 0

    def propose(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens continuing ``seq``, and the length of the n-gram matched
        (0: no match, no draft)."""
        L = len(seq)
        for end in range(self._indexed + 1, L):  # grams ending at end (exclusive), end < L
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._last[tuple(seq[end - n : end])] = end
        self._indexed = max(self._indexed, L - 1)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = self._last.get(tuple(seq[L - n :]))
            if start is not None:
                return seq[start : start + k], n
        return [], 0
