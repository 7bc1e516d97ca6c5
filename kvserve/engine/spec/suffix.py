"""Suffix-tree drafts (SuffixDecoding, Oliaro et al. 2024; vLLM's ``suffix`` method).

A ``SuffixTree`` holds every substring of depth <= D of the sequences it was given, as a trie
with occurrence counts. Drafting matches the longest suffix of the context (<= D - 1 tokens)
that occurred before with a continuation, then follows the most frequent child while the path's
estimated probability (product of child count / sum of the children's counts) stays at least
``min_prob``, for at most ``max_spec_factor`` x the match length tokens: long matches draft far,
short ones little. Each request has its own tree over its prompt and output (appended token by
token); one global tree holds the outputs of the last N finished requests, so a pattern repeated
across requests (agent loops, tool calls) drafts on its first tokens.

Suffix links make matching linear: the node of string ``s`` links to the node of ``s[1:]``,
which always exists (a substring's suffix is a substring: its count is at least ``s``'s, so it
outlives ``s`` when counts are removed). Matching a context walks it once, Aho-Corasick style
(follow links while the next token has no child), O(len(context)) amortized; a draft that
reaches depth D follows links to the longest suffix that still has a continuation instead of
matching again. "Has a continuation" is monotone in the suffix length below D (if ``s x``
occurred, so did ``s[1:] x``), so the first node on the link chain with children is the longest
such suffix.
"""

from __future__ import annotations

from collections import deque


class _Node:
    __slots__ = ("count", "children", "link", "depth")

    def __init__(self, link: _Node | None, depth: int) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.link = link  # the node of this string without its first token (root: None)
        self.depth = depth


class SuffixTree:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(None, 0)
        # append(): the nodes of the followed sequence's suffixes of depth 1..D, shortest first
        self._active: list[_Node] = []

    # ---- building -----------------------------------------------------------------------
    def append(self, token: int) -> None:
        """Extend the one sequence this tree follows by ``token``: every suffix of depth < D
        gains a child (O(D)). Shortest first, so each new node's link (the previous, shorter
        suffix's child) exists."""
        prev = self.root
        nxt = []
        for node in [self.root, *self._active[: self.depth - 1]]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(prev, node.depth + 1)
            child.count += 1
            nxt.append(child)
            prev = child
        self._active = nxt

    def add(self, seq: list[int], sign: int = 1) -> None:
        """Insert (sign 1) or remove (sign -1) every substring of depth <= D of ``seq``.
        Inserted from the last start to the first, so the path of start i + 1 (the links of
        start i's new nodes) is in place."""
        after: list[_Node] = [self.root]  # the nodes of seq[i + 1 : i + 1 + j], j = 0..
        for i in range(len(seq) - 1, -1, -1):
            node, path = self.root, [self.root]
            for t in seq[i : i + self.depth]:
                child = node.children.get(t)
                if child is None:
                    if sign < 0:
                        break
                    child = node.children[t] = _Node(after[len(path) - 1], node.depth + 1)
                child.count += sign
                if child.count <= 0:
                    del node.children[t]
                    break
                node = child
                path.append(child)
            after = path

    # ---- drafting -----------------------------------------------------------------------
    def _match(self, context: list[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` (<= D - 1 tokens) that has a
        continuation, and its length: one pass over the context."""
        root, cap = self.root, self.depth
        node = root
        for t in context[-cap:]:
            while True:
                child = node.children.get(t) if node.depth < cap else None
                if child is not None:
                    node = child
                    break
                if node is root:
                    break
                node = node.link
        return self._with_children(node)

    def _with_children(self, node: _Node) -> tuple[_Node | None, int]:
        """The longest suffix of ``node``'s string that has a continuation."""
        while node is not self.root and not node.children:
            node = node.link
        return (None, 0) if node is self.root else (node, node.depth)

    def match_end(self) -> tuple[_Node | None, int]:
        """``_match`` of the followed sequence itself (``append``), from its suffixes' nodes
        without walking the context: the longest of them with a continuation (an earlier
        occurrence followed by something)."""
        for node in reversed(self._active):
            if node.children:
                return node, node.depth
        return None, 0

    def draft(self, context: list[int], k: int, max_spec_factor: float,
              min_prob: float, match: tuple[_Node | None, int] | None = None
              ) -> tuple[list[int], float]:
        """Up to ``k`` tokens and the draft's score (expected accepted tokens: the sum of the
        path's probabilities). ``match``: ``_match(context)`` when the caller has it."""
        node, m = match if match is not None else self._match(context)
        if node is None:
            return [], 0.0
        limit = min(k, max(1, int(max_spec_factor * m)))
        out: list[int] = []
        prob = 1.0
        score = 0.0
        while len(out) < limit:
            if not node.children:  # the depth bound: the longest suffix that goes on
                node, _ = self._with_children(node)
                if node is None:
                    break
            total = 0
            best = None
            for tok, child in node.children.items():
                total += child.count
                if best is None or child.count > best[1].count:
                    best = (tok, child)
            tok, child = best
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(tok)
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
