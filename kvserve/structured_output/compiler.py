"""``GrammarCompiler``: compiles ``StructuredOutputsParams`` for one tokenizer, cached.

It wraps the tokenizer once (llguidance's ``LLTokenizer``, ~0.5 s for a 49k vocabulary, built
on first use) and compiles each grammar into a prototype ``LLMatcher``, kept in an LRU cache
keyed by ``StructuredOutputsParams.key``. Each sequence gets its own ``GrammarMatcher`` (a deep
copy of the prototype: microseconds). Compiling is thread-safe and may run in any thread (the
server compiles in a worker thread, so a cache hit is all the engine thread does); a grammar
that does not compile raises ``ValueError`` with llguidance's message.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import numpy as np

from kvserve.structured_output.backend import grammar_text, load_llguidance
from kvserve.structured_output.matcher import GrammarMatcher
from kvserve.structured_output.params import StructuredOutputsParams

_CACHE_SIZE = 256


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
                llg = load_llguidance()
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
        llg = load_llguidance()
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
