"""``TokenizerPool``: tokenization and chat templating off the event loop.

A fixed number of worker threads, each with its own copy of the front end's tokenizer (a
Hugging Face tokenizer must not be used from two threads at once). The Rust tokenizers release
the GIL while they encode, so the event loop keeps answering ``/health`` and feeding streams
while a large prompt is tokenized. The work waiting for a worker is bounded by admission: only
admitted requests (at most ``--max-num-seqs + --max-queue`` sequences) submit any.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TokenizerPool:
    def __init__(self, tokenizer: Any, workers: int = 2) -> None:
        if workers < 1:
            raise ValueError(f"tokenizer workers must be >= 1, got {workers}")
        # Copies made here, on the caller's thread, before any worker exists.
        self._spare: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            self._spare.put(copy.deepcopy(tokenizer))
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvserve-tokenizer")
        self.workers = workers

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = self._spare.get_nowait()
        return fn(tok, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(tokenizer, *args)`` in a worker thread with that worker's tokenizer."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn, args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
