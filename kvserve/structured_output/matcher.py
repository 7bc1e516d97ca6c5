"""One sequence's grammar state: ``GrammarMatcher`` (an llguidance ``LLMatcher`` behind a
reasoning gate), which the engine keeps on the ``Request``.

Per generated token: ``fill_bitmask`` writes the allowed tokens as bits (token t is bit t % 32
of int32 word t // 32, ``bitmask.py``); ``accept`` advances the state with the sampled token and
returns False when the token was not allowed (the sampler's mask makes that happen only at a
dead end: no token allowed, so the masked row is all -inf). Speculative decoding asks for the
masks along a draft (``masks_along``) and how much of a draft the grammar allows
(``validate``).
"""

from __future__ import annotations

import numpy as np

from kvserve.structured_output.params import StructuredOutputsParams

_OPEN, _REASONING, _UNDECIDED = 0, 1, 2  # GrammarMatcher's reasoning gate


class GrammarMatcher:
    """One sequence's grammar state (llguidance ``LLMatcher``); engine-side, lives on the
    ``Request``. Output tokens are never taken back (preemption recomputes the KV of tokens
    already accepted), so the state only moves forward.

    A reasoning model's answer (``StructuredOutputsParams.reasoning_state``) passes a gate
    first: while it reasons every token is allowed and none reaches the grammar; the token
    after ``reasoning_end_token_id`` is the grammar's first. "undecided": the first token is
    the start of a reasoning (``reasoning_start_token_id``) or the grammar's first token."""

    __slots__ = ("_m", "num_accepted", "_gate", "_start", "_end")

    def __init__(self, matcher, so: StructuredOutputsParams | None = None) -> None:
        self._m = matcher
        self.num_accepted = 0
        state = so.reasoning_state if so is not None else None
        self._gate = {None: _OPEN, "reasoning": _REASONING, "undecided": _UNDECIDED}[state]
        self._start = so.reasoning_start_token_id if so is not None else None
        self._end = so.reasoning_end_token_id if so is not None else None

    @property
    def reasoning(self) -> bool:
        """Still before the grammar (reasoning, or not yet decided)."""
        return self._gate != _OPEN

    def fill_bitmask(self, words: np.ndarray) -> bool:
        """Write the allowed next tokens into ``words`` (int32 [ceil(V / 32)], contiguous).
        False: a dead end (no token allowed, or the matcher is in an error state)."""
        if self._gate == _REASONING:
            words.fill(-1)  # every token (bits past the vocabulary are never drawn)
            return True
        if self._m.is_error():
            words.fill(0)
            return False
        self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self._gate == _UNDECIDED:
            assert self._start is not None
            words.view(np.uint32)[self._start >> 5] |= np.uint32(1 << (self._start & 31))
            return True
        return not self._m.is_error() and bool(words.any())

    def accept(self, token: int) -> bool:
        """Advance with a sampled token; False if the grammar does not allow it."""
        if self._gate == _UNDECIDED:
            self._gate = _REASONING if token == self._start else _OPEN
        if self._gate == _REASONING:
            if token == self._end:
                self._gate = _OPEN
            return True
        ok = self._m.consume_token(token)
        if ok:
            self.num_accepted += 1
        return bool(ok) and not self._m.is_error()

    def validate(self, tokens: list[int] | tuple[int, ...]) -> int:
        """How many of ``tokens`` (a draft) the grammar accepts in a row from here; the state
        does not move."""
        if self._m.is_error():
            return 0
        return int(self._m.validate_tokens(list(tokens)))

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from here (llguidance's fast-forward tokens: the
        canonical tokenization of the bytes every allowed continuation starts with); none
        while reasoning. Speculative decoding drafts them (jump-forward)."""
        if self._gate != _OPEN or self._m.is_error():
            return []
        return list(self._m.compute_ff_tokens())

    def masks_along(self, draft: tuple[int, ...], vocab_size: int) -> list[_FixedMask]:
        """Speculative decoding: the allowed-token masks at each of the 1 + k positions of a
        verified draft (position j: the state after d_1..d_j), each as a one-use grammar for
        the sampler's row. The state itself does not move (rolled back afterwards)."""
        n = (vocab_size + 31) // 32
        out: list[_FixedMask] = []
        done = 0
        try:
            for j in range(len(draft) + 1):
                words = np.zeros(n, np.int32)
                out.append(_FixedMask(words, self.fill_bitmask(words)))
                if j == len(draft):
                    break
                if not self._m.consume_token(draft[j]):  # unreachable rows: dead ends
                    out.extend(_FixedMask(np.zeros(n, np.int32), False)
                               for _ in range(len(draft) - j))
                    break
                done += 1
        finally:
            if done:
                self._m.rollback(done)
        return out

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (only EOS could follow)."""
        return self._gate == _OPEN and bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class _FixedMask:
    """A mask computed ahead (``GrammarMatcher.masks_along``), served to the sampler like a
    grammar's ``fill_bitmask``."""

    __slots__ = ("words", "ok")

    def __init__(self, words: np.ndarray, ok: bool) -> None:
        self.words, self.ok = words, ok

    def fill_bitmask(self, words: np.ndarray) -> bool:
        words[:] = self.words
        return self.ok
