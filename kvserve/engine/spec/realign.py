"""Realigning a copy after a one-token shift: the model often copies a span with its whitespace
changed (a hard-wrapped document quoted as one line: " sequence" where the document has
"\\n" "sequence"; "  When" spelled " When"). The draft is then rejected at that token, and
an exact-match drafter would restart from a match of one token, drafting 1, 3, 7 ... tokens
while the match grows back.

``realign`` finds where the emitted token lands in the rejected draft: the shortest run of
draft tokens d[a..i] (i < a + ``MAX_SHIFT``) whose text equals the emitted token's with every
whitespace run counted as one space. The drafter then goes on from the *aligned* context (the
accepted tokens, then d[a..i]: the source's own tokens), where the match is as long as before
the shift. Drafts stay proposals: whatever they say, the verify step decides what is emitted.

Where no run of draft tokens has the emitted token's text, the emitted token is taken as a
*substitution* of d[a] (a value that differs in a copied structure: JSON lines with a new id,
an edited field): the aligned context holds d[a] in its place, so the draft goes on with what
followed d[a] in the source (``", \"name\": \""`` after the id). Its score counts
``SUBST_WEIGHT`` against the sequence's own match, and it lasts while the output follows.
"""

from __future__ import annotations

import re

MAX_SHIFT = 3  # draft tokens one emitted token may stand for
SUBST_WEIGHT = 0.5  # a substitution's draft: its score counts half against the exact match
_WS = re.compile(r"\s+")


class TokenText:
    """Token id -> its text with whitespace runs as one space (None: not a whole character,
    e.g. one byte of a multi-byte UTF-8 character), cached."""

    __slots__ = ("_decode", "_cache")

    def __init__(self, tokenizer) -> None:
        self._decode = tokenizer.decode
        self._cache: dict[int, str | None] = {}

    def __call__(self, token: int) -> str | None:
        if token in self._cache:
            return self._cache[token]
        text = self._decode([token])
        s = self._cache[token] = None if "\ufffd" in text else _WS.sub(" ", text)
        return s


def realign(text: TokenText, emitted: int, draft: list[int], a: int) -> int | None:
    """The emitted token replaced draft[a] (a rejection): the index i of the last draft token
    it stands for (draft[a..i] has the same text, whitespace runs as one space), or None."""
    want = text(emitted)
    if not want or not want.strip():  # whitespace alone aligns with anything: no evidence
        return None
    got = ""
    for i in range(a, min(len(draft), a + MAX_SHIFT)):
        piece = text(draft[i])
        if piece is None:
            return None
        got = _WS.sub(" ", got + piece)
        if got == want:
            return i
        if not want.startswith(got):
            return None
    return None
