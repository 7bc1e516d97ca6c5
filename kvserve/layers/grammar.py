"""Constrained decoding on llguidance: compiled grammars (cached by key) and per-request
matchers that turn a grammar state into an allowed-token bitmask.

``GrammarCompiler`` wraps the tokenizer once (llguidance's ``LLTokenizer``, ~0.5 s for a 49k
vocabulary, built on first use) and compiles ``StructuredOutputsParams`` into a prototype
``LLMatcher``, kept in an LRU cache keyed by ``StructuredOutputsParams.key``. Each request
gets its own ``GrammarMatcher`` (a deep copy of the prototype: microseconds). Compiling is
thread-safe and may run in any thread (the server compiles in a worker thread, so a cache hit
is all the engine thread does); a grammar that does not compile raises ``ValueError`` with
llguidance's message.

Per generated token: ``fill_bitmask`` writes the allowed tokens as bits (token t is bit t % 32
of int32 word t // 32); ``accept`` advances the state with the sampled token and returns False
when the token was not allowed (the sampler's mask makes that happen only at a dead end: no
token allowed, so the masked row is all -inf). Choice of llguidance over xgrammar:
docs/structured-outputs.md.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

import numpy as np

from kvserve.sampling_params import StructuredOutputsParams

_CACHE_SIZE = 256


def _load_llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:  # pragma: no cover - a dependency of kvserve
        raise ValueError("structured outputs need the llguidance package "
                         "(pip install llguidance)") from e
    return llguidance


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (Lark, or llguidance's JSON form) for ``so``."""
    llg = _load_llguidance()
    m = llg.LLMatcher
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = json.loads(so.json) if kind == "json" else {"type": "object"}
        opts: dict = {"whitespace_flexible": so.whitespace_flexible}
        if not so.whitespace_flexible:
            opts.update(item_separator=", ", key_separator=": ")
        try:
            return m.grammar_from_json_schema(schema, defaults=opts)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        return m.grammar_from_regex(so.regex)
    if kind == "choice":
        assert so.choice
        return "start: " + " | ".join(json.dumps(c) for c in so.choice)
    assert kind == "grammar" and so.grammar is not None
    if "::=" in so.grammar:  # GBNF (llama.cpp); Lark uses ':'
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return m.grammar_from_lark(gbnf_to_lark(so.grammar))
        except Exception as e:  # noqa: BLE001 - the converter raises its own error types
            raise ValueError(f"invalid GBNF grammar: {e}") from None
    return m.grammar_from_lark(so.grammar)


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


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = _CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self._lltok = None
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.compile_seconds = 0.0

    @property
    def num_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _tokenizer(self):
        with self._tok_lock:
            if self._lltok is None:
                llg = _load_llguidance()
                eos = list(self.eos_token_ids) or None
                try:
                    self._lltok = llg.hf.from_tokenizer(self._hf_tokenizer,
                                                        n_vocab=self.vocab_size, eos_token=eos)
                except Exception as e:  # noqa: BLE001 - llguidance raises plain exceptions
                    raise ValueError("structured outputs are not available for this model's "
                                     f"tokenizer: {e}") from e
            return self._lltok

    def compile(self, so: StructuredOutputsParams):
        """The cached prototype matcher for ``so`` (compiling it on a miss); ValueError when
        it does not compile."""
        key = so.key
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return proto
        tok = self._tokenizer()
        llg = _load_llguidance()
        t0 = time.perf_counter()
        text = grammar_text(so)
        proto = llg.LLMatcher(tok, text, log_level=0)
        if proto.is_error():
            raise ValueError(f"the {so.kind} grammar does not compile: {proto.get_error()}")
        # The first mask builds the lexer's start state: pay it here, not in the sampler.
        words = np.zeros(self.num_words, np.int32)
        proto.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if proto.is_error() or not words.any():
            raise ValueError(f"the {so.kind} grammar allows no output: "
                             f"{proto.get_error() if proto.is_error() else 'empty language'}")
        with self._lock:
            self.compile_seconds += time.perf_counter() - t0
            self.misses += 1
            self._cache[key] = proto
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return proto

    def matcher(self, so: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sequence."""
        return GrammarMatcher(self.compile(so).deep_copy(), so)
