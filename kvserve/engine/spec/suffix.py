"""Suffix-tree drafts (SuffixDecoding, Oliaro et al. 2024; vLLM's ``suffix`` method).

A ``SuffixTree`` holds every substring of depth <= D of the sequences it was given, as a trie
with occurrence counts. Drafting matches the longest suffix of the context (<= D tokens) that
occurred before with a continuation, then follows the most frequent child while the path's
estimated probability (product of child count / sum of the children's counts) stays at least
``min_prob``, for at most ``max_spec_factor`` x the match length tokens: long matches draft far,
short ones little. Each request has its own tree over its prompt and output (appended token by
token); one global tree holds the outputs of the last N finished requests, so a pattern repeated
across requests (agent loops, tool calls) drafts on its first tokens.
"""

from __future__ import annotations

from collections import deque


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self._active: list[_Node] = []  # append(): the nodes of the current suffixes

    # ---- building -----------------------------------------------------------------------
    def append(self, token: int) -> None:
        """Extend the one sequence this tree follows by ``token``: every suffix of depth < D
        gains a child (O(D))."""
        nxt = []
        for node in [*self._active[-(self.depth - 1):], self.root] if self.depth > 1 \
                else [self.root]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            nxt.append(child)
        self._active = nxt

    def add(self, seq: list[int], sign: int = 1) -> None:
        """Insert (sign 1) or remove (sign -1) every substring of depth <= D of ``seq``."""
        for i in range(len(seq)):
            node = self.root
            for t in seq[i : i + self.depth]:
                child = node.children.get(t)
                if child is None:
                    if sign < 0:
                        break
                    child = node.children[t] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[t]
                    break
                node = child

    # ---- drafting -----------------------------------------------------------------------
    def _match(self, context: list[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` (<= D tokens) that has a
        continuation, and its length."""
        for m in range(min(self.depth - 1, len(context)), 0, -1):
            node = self.root
            for t in context[len(context) - m :]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, m
        return None, 0

    def draft(self, context: list[int], k: int, max_spec_factor: float,
              min_prob: float) -> tuple[list[int], float]:
        """Up to ``k`` tokens and the draft's score (expected accepted tokens: the sum of the
        path's probabilities)."""
        node, m = self._match(context)
        if node is None:
            return [], 0.0
        limit = min(k, max(1, int(max_spec_factor * m)))
        out: list[int] = []
        ctx = list(context[-self.depth:])
        prob = 1.0
        score = 0.0
        while len(out) < limit:
            if not node.children:  # the depth bound: match again on the context drafted so far
                node, _ = self._match(ctx)
                if node is None:
                    break
            total = sum(c.count for c in node.children.values())
            tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(tok)
            ctx.append(tok)
            score += prob
            node = child
        return out, score


class GlobalSuffixCache:
    """The outputs of the last ``max_requests`` finished requests in one tree."""

    def __init__(self, depth: int, max_requests: int) -> None:
        self.tree = SuffixTree(depth)
        self.max_requests = max_requests
        self._seqs: deque[list[int]] = deque()

    def add(self, output: list[int]) -> None:
        if self.max_requests == 0 or not output:
            return
        self._seqs.append(list(output))
        self.tree.add(self._seqs[-1])
        while len(self._seqs) > self.max_requests:
            self.tree.add(self._seqs.popleft(), sign=-1)
