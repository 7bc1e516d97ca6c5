"""Incremental detokenization with stop strings that never split mid-stream.

Text is decoded with a small window of context tokens (``prefix_offset``) so multi-byte
characters and leading-space tokens come out right; a delta is released only once it no longer
ends in an incomplete UTF-8 sequence. While stop strings are active, the last
``max(len(stop)) - 1`` characters are held back, so a stop string is never partly streamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: object
    prompt_token_ids: list[int]
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stop_reason: str | None = None

    _raw: object = None  # the Rust tokenizer when decoding through it equals tokenizer.decode

    def __post_init__(self) -> None:
        tail = self.prompt_token_ids[-5:]
        self.tokens = list(tail)
        self.prefix_offset = 0
        self.read_offset = len(tail)
        # A fast tokenizer without space clean-up decodes exactly as its Rust backend; calling
        # that directly skips transformers' per-call argument handling (~half the cost; this
        # runs twice per generated token).
        raw = getattr(self.tokenizer, "_tokenizer", None)
        if raw is not None and hasattr(raw, "decode") and \
                getattr(self.tokenizer, "clean_up_tokenization_spaces", True) is False:
            self._raw = raw

    def _decode(self, ids: list[int]) -> str:
        if self._raw is not None:
            return self._raw.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now ends the text (text truncated)."""
        for tok in new_token_ids:
            self.tokens.append(tok)
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta_start = len(self.text)
                self.text += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.tokens)
                if self.stop and self._check_stop(delta_start):
                    return self.stop_reason
        return None

    def _check_stop(self, delta_start: int) -> bool:
        longest = max(len(s) for s in self.stop)
        search_from = max(0, delta_start - longest + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop_str_in_output else self.text[:i]
        self.stop_reason = s
        return True

    def visible_len(self, finished: bool) -> int:
        """How much of ``text`` is safe to show now: a possible stop-string prefix is held back
        while running."""
        if finished or not self.stop:
            return len(self.text)
        hold = max(len(s) for s in self.stop) - 1
        return max(0, len(self.text) - hold)

    def output_text(self, finished: bool) -> str:
        """Text safe to show now (``visible_len``)."""
        return self.text[: self.visible_len(finished)]
