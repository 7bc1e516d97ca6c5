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

Nodes are integer ids into flat lists, and a node's children a dict of ints (token -> node):
CPython's garbage collector tracks neither such dicts nor ints, so a tree of millions of nodes
adds nothing to a full collection (as objects, a 400-token prompt's 10k nodes made each full
collection of the engine's process tens of milliseconds longer, and triggered them).
"""

from __future__ import annotations

from collections import deque

_ROOT = 0


class SuffixTree:
    """Node i: ``count[i]`` occurrences, ``link[i]`` (the node of its string without the first
    token; the root: -1), ``dep[i]`` (its length), ``kids[i]`` (token -> child; None: none
    yet). Ids of removed nodes are reused."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.count: list[int] = [0]
        self.link: list[int] = [-1]
        self.dep: list[int] = [0]
        self.kids: list[dict[int, int] | None] = [None]
        self._free: list[int] = []
        # append(): the nodes of the followed sequence's suffixes of depth 1..D, shortest first
        self._active: list[int] = []

    def _new(self, link: int, depth: int) -> int:
        if self._free:
            i = self._free.pop()
            self.count[i], self.link[i], self.dep[i], self.kids[i] = 0, link, depth, None
            return i
        self.count.append(0)
        self.link.append(link)
        self.dep.append(depth)
        self.kids.append(None)
        return len(self.count) - 1

    def _release(self, node: int) -> None:
        """Free ``node`` and its subtree (all of count 0: a child's count never exceeds its
        parent's)."""
        stack = [node]
        while stack:
            i = stack.pop()
            if self.kids[i]:
                stack.extend(self.kids[i].values())
            self.kids[i] = None
            self._free.append(i)

    # ---- building -----------------------------------------------------------------------
    def append(self, token: int) -> None:
        """Extend the one sequence this tree follows by ``token``: every suffix of depth < D
        gains a child (O(D)). Shortest first, so each new node's link (the previous, shorter
        suffix's child) exists."""
        kids, count, dep = self.kids, self.count, self.dep
        prev = _ROOT
        nxt = []
        for node in [_ROOT, *self._active[: self.depth - 1]]:
            k = kids[node]
            if k is None:
                k = kids[node] = {}
            child = k.get(token)
            if child is None:
                child = k[token] = self._new(prev, dep[node] + 1)
            count[child] += 1
            nxt.append(child)
            prev = child
        self._active = nxt

    def add(self, seq: list[int], sign: int = 1) -> None:
        """Insert (sign 1) or remove (sign -1) every substring of depth <= D of ``seq``.
        Inserted from the last start to the first, so the path of start i + 1 (the links of
        start i's new nodes) is in place."""
        kids, count, dep = self.kids, self.count, self.dep
        after = [_ROOT]  # the nodes of seq[i + 1 : i + 1 + j], j = 0..
        for i in range(len(seq) - 1, -1, -1):
            node, path = _ROOT, [_ROOT]
            for t in seq[i : i + self.depth]:
                k = kids[node]
                child = k.get(t) if k else None
                if child is None:
                    if sign < 0:
                        break
                    if k is None:
                        k = kids[node] = {}
                    child = k[t] = self._new(after[len(path) - 1], dep[node] + 1)
                count[child] += sign
                if count[child] <= 0:
                    del k[t]
                    self._release(child)
                    break
                node = child
                path.append(child)
            after = path

    # ---- drafting -----------------------------------------------------------------------
    def _match(self, context: list[int]) -> tuple[int | None, int]:
        """The node of the longest suffix of ``context`` (<= D - 1 tokens) that has a
        continuation, and its length: one pass over the context."""
        kids, link, dep, cap = self.kids, self.link, self.dep, self.depth
        node = _ROOT
        for t in context[-cap:]:
            while True:
                k = kids[node] if dep[node] < cap else None
                child = k.get(t) if k else None
                if child is not None:
                    node = child
                    break
                if node == _ROOT:
                    break
                node = link[node]
        return self._with_children(node)

    def _with_children(self, node: int) -> tuple[int | None, int]:
        """The longest suffix of ``node``'s string that has a continuation."""
        kids, link = self.kids, self.link
        while node != _ROOT and not kids[node]:
            node = link[node]
        return (None, 0) if node == _ROOT else (node, self.dep[node])

    def match_end(self) -> tuple[int | None, int]:
        """``_match`` of the followed sequence itself (``append``), from its suffixes' nodes
        without walking the context: the longest of them with a continuation (an earlier
        occurrence followed by something)."""
        for node in reversed(self._active):
            if self.kids[node]:
                return node, self.dep[node]
        return None, 0

    def draft(self, context: list[int], k: int, max_spec_factor: float,
              min_prob: float, match: tuple[int | None, int] | None = None,
              evidence: list[tuple[int, int, int]] | None = None) -> tuple[list[int], float]:
        """Up to ``k`` tokens and the draft's score (expected accepted tokens: the sum of the
        path's probabilities). ``match``: ``_match(context)`` when the caller has it;
        ``evidence``: as ``draft_path``'s (then cut to the draft)."""
        path, limit, score = self.draft_path(context, k, max_spec_factor, min_prob, match,
                                             evidence=evidence)
        if evidence is not None:
            del evidence[limit:]
        return path[:limit], score

    def draft_path(self, context: list[int], k: int, max_spec_factor: float,
                   min_prob: float, match: tuple[int | None, int] | None = None,
                   lookahead: int = 0, evidence: list[tuple[int, int, int]] | None = None
                   ) -> tuple[list[int], int, float]:
        """``draft``'s path, going on for up to ``lookahead`` tokens past the draft's length
        limit (same rules, not in the score), the limit, and the draft's score.
        ``evidence``: gets each path token's (count, count of all continuations there, match
        length) (calibrate.py)."""
        node, m = match if match is not None else self._match(context)
        if node is None:
            return [], 0, 0.0
        kids, count = self.kids, self.count
        limit = min(k, max(1, int(max_spec_factor * m)))
        out: list[int] = []
        prob = 1.0
        score = 0.0
        while len(out) < limit + lookahead:
            if not kids[node]:  # the depth bound: the longest suffix that goes on
                node, _ = self._with_children(node)
                if node is None:
                    break
            total, best, tok = 0, -1, -1
            for t, child in kids[node].items():
                c = count[child]
                total += c
                if c > best:
                    best, tok, nxt = c, t, child
            prob *= best / total
            if prob < min_prob:
                break
            out.append(tok)
            if evidence is not None:
                evidence.append((best, total, m))
            if len(out) <= limit:
                score += prob
            node = nxt
        return out, min(limit, len(out)), score


class GlobalSuffixCache:
    """The outputs of the last ``max_requests`` finished requests in one tree."""

    def __init__(self, depth: int, max_requests: int) -> None:
        self.tree = SuffixTree(depth)
        self.max_requests = max_requests
        self._seqs: deque[list[int]] = deque()

    def clear(self) -> None:
        """Forget every finished request's output."""
        self.tree = SuffixTree(self.tree.depth)
        self._seqs.clear()

    def add(self, output: list[int]) -> None:
        if self.max_requests == 0 or not output:
            return
        self._seqs.append(list(output))
        self.tree.add(self._seqs[-1])
        while len(self._seqs) > self.max_requests:
            self.tree.add(self._seqs.popleft(), sign=-1)
