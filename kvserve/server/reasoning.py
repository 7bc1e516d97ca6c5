"""Reasoning models (``--reasoning-parser``, vLLM's names): the answer's ``<think>...</think>``
part becomes ``reasoning_content``, the rest ``content``; and the structured-output grammar
(``StructuredOutputsParams.reasoning_state``) and the tool-call parser only see the content.

Where an answer starts is read from the prompt, as vLLM does: the last reasoning tag in the
prompt's token ids. A start tag (DeepSeek-R1's generation prompt ends in ``<think>\\n``)
means the answer starts inside the reasoning; an end tag (Qwen3's template with
``enable_thinking: false`` ends in ``<think>\\n\\n</think>\\n\\n``) means it is all content.
With neither, ``deepseek_r1`` starts inside the reasoning and ``qwen3`` is undecided: the
answer is reasoning if it starts with ``<think>``, else content.

In the text: inside the reasoning a leading ``<think>`` is dropped and everything up to
``</think>`` is ``reasoning_content`` (all of it if the answer ends first); the content is what
follows ``</think>``, without its leading whitespace. Streaming splits the same way, holding
back only text that may be the start of ``</think>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.settings import REASONING_PARSERS

START, END = "<think>", "</think>"
_REASONING, _UNDECIDED, _CONTENT = "reasoning", "undecided", "content"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    start_token_id: int | None  # the tags' token ids (None: not one token in this vocabulary)
    end_token_id: int | None

    def initial_state(self, prompt_ids: list[int]) -> str:
        """"reasoning", "undecided" or "content": where the answer after ``prompt_ids``
        starts."""
        for t in reversed(prompt_ids):
            if t == self.start_token_id:
                return _REASONING
            if t == self.end_token_id:
                return _CONTENT
        return _REASONING if self.name == "deepseek_r1" else _UNDECIDED

    def split(self, text: str, state: str) -> tuple[str | None, str]:
        """(reasoning_content or None, content) of a whole answer."""
        s = ReasoningStream(state)
        reasoning, content = s.feed(text)
        r2, c2 = s.finish()
        reasoning, content = reasoning + r2, content + c2
        return (reasoning if s.reasoned else None), content

    def grammar_state(self, state: str) -> str | None:
        """``StructuredOutputsParams.reasoning_state`` for an answer starting in ``state``
        (None: the grammar applies from the first token, also when the tags are not single
        tokens, which the engine's gate needs)."""
        if state == _CONTENT or self.end_token_id is None:
            return None
        if state == _UNDECIDED and self.start_token_id is None:
            return None
        return state


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Splits an answer's text, delta by delta, into (reasoning, content) deltas."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.reasoned = state == _REASONING  # the answer had a reasoning part
        self._held = ""  # text that may still become a tag
        self._at_start = True  # no reasoning text given out yet (a leading <think> is dropped)
        self._content_started = False  # content's leading whitespace is dropped

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        return text

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning = content = ""
        if self.state == _UNDECIDED:
            stripped = text.lstrip()
            if stripped.startswith(START):
                self.state, self.reasoned = _REASONING, True
            elif START.startswith(stripped):
                self._held = text  # maybe "<thi": wait for more
                return "", ""
            else:
                self.state = _CONTENT
        if self.state == _REASONING:
            if self._at_start:
                stripped = text.lstrip()
                if START.startswith(stripped) and stripped != START:
                    self._held = text
                    return "", ""
                if stripped.startswith(START):
                    text = stripped[len(START):]
                self._at_start = False
            i = text.find(END)
            if i < 0:
                keep = _partial_suffix(text, END)
                self._held = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
            reasoning, text = text[:i], text[i + len(END):]
            self.state = _CONTENT
        content = self._content(text)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back when the answer ends."""
        held, self._held = self._held, ""
        if not held:
            return "", ""
        if self.state == _REASONING:
            return held, ""
        return "", self._content(held)


def get_reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {name!r}")
    return ReasoningParser(name, _tag_id(tokenizer, START), _tag_id(tokenizer, END))


def _tag_id(tokenizer, tag: str) -> int | None:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
