"""Engine logprobs (one ``{token_id: logprob}`` per position, the sampled token always present)
to OpenAI's chat (``content: [...]``) and legacy completions (``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``) shapes."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvserve.http.protocol import CompletionLogprobs, TokenLogprob, TopLogprob
from kvserve.outputs import Logprobs

_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp the same way
_CACHE_LIMIT = 1 << 18
_SLACK = 32  # characters a token may be found past the current offset (dropped whitespace)


def clean(lp: float) -> float:
    return lp if math.isfinite(lp) else _FLOOR


class TokenText:
    """Token id -> its text, cached. Event-loop only (owns a front-end tokenizer)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < _CACHE_LIMIT:
                self._cache[token_id] = s
        return s

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


def _top(lps: Logprobs, k: int) -> list[tuple[int, float]]:
    return sorted(lps.items(), key=lambda kv: kv[1], reverse=True)[:k]


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[Logprobs], top: int,
                  text: TokenText) -> list[TokenLogprob]:
    out = []
    for tid, lps in zip(token_ids, logprobs, strict=False):
        s = text(tid)
        out.append(TokenLogprob(
            token=s, logprob=clean(lps.get(tid, _FLOOR)), bytes=list(s.encode()),
            top_logprobs=[TopLogprob(token=text(t), logprob=clean(v),
                                     bytes=list(text(t).encode())) for t, v in _top(lps, top)],
        ))
    return out


class TextOffsets:
    """Places tokens in the text a choice returns, for ``text_offset``.

    Each token's string is looked for at the current offset (or a little after it: word-level
    tokenizers drop the spaces between words). A token that is not there takes no room and
    gets the current offset: a special token the text does not contain (``<|bos|>``, which
    decoding skips), or a fragment of a multi-byte character. The next token found puts the
    offsets back in step. ``extend`` adds text as a stream produces it."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self.pos = 0

    def extend(self, more: str) -> None:
        self.text += more

    def place(self, token: str) -> int:
        if not token:
            return self.pos
        i = self.text.find(token, self.pos, self.pos + len(token) + _SLACK)
        if i < 0:
            return self.pos
        self.pos = i + len(token)
        return i


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[Logprobs | None],
                        text: TokenText, offsets: TextOffsets) -> CompletionLogprobs:
    """``offsets``: where the choice's text stands (see ``TextOffsets``). Positions without
    logprobs (the first prompt token) get ``None``."""
    res = CompletionLogprobs()
    for tid, lps in zip(token_ids, logprobs, strict=False):
        s = text(tid)
        res.tokens.append(s)
        res.text_offset.append(offsets.place(s))
        if lps is None:
            res.token_logprobs.append(None)
            res.top_logprobs.append(None)
        else:
            res.token_logprobs.append(clean(lps.get(tid, _FLOOR)))
            top = {}
            for t, v in sorted(lps.items(), key=lambda kv: kv[1], reverse=True):
                top.setdefault(text(t), clean(v))
            res.top_logprobs.append(top)
    return res
