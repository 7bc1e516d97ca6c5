"""A KV tier in a shared remote store: Redis or Valkey (``--kv-offload-url
redis://HOST:PORT/DB``), read and written with redis-py.

It holds the same serialized blocks as the other tiers (``block_store.serialize``), under the
same content-addressed keys (``kvserve:kv:<blake2b(fingerprint || chain hash)>``), so engines
on several machines that run the same model, KV mode and rank layout share their prefixes; each
value is verified (``block_store.verify``) when it is read back, wherever it came from.

The store is a cache, never a dependency: every call has a bounded socket timeout, and a
failed call (refused, timed out, reset) marks the store down for ``RETRY_S`` seconds during
which every lookup is a miss and every write is dropped (counted), so a stopped or unreachable
server costs at most one timeout per ``RETRY_S`` and never an error. Capacity and eviction are
the server's (set ``maxmemory`` and ``maxmemory-policy allkeys-lru``).
"""

from __future__ import annotations

import logging
import threading
import time

from kvserve.config import check_kv_offload_url

logger = logging.getLogger("kvserve.kv_tiers")

RETRY_S = 5.0  # after a failed call, the store counts as down this long
KEY_PREFIX = "kvserve:kv:"


class RemoteTier:
    """Serialized blocks in Redis / Valkey. Thread safe (redis-py's pool)."""

    name = "remote"

    def __init__(self, url: str, timeout_s: float) -> None:
        import redis  # the optional dependency: imported only when a URL is given

        self.url = check_kv_offload_url(url)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        OSError)
        self._r = redis.Redis.from_url(self.url, socket_timeout=timeout_s,
                                       socket_connect_timeout=timeout_s,
                                       health_check_interval=30)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.cap = 0  # the server's (maxmemory)
        self.bytes = 0  # written by this engine
        self.evictions = 0  # the server evicts; not seen here
        self.failures = 0  # calls that failed (the store was then marked down)
        self.skipped = 0  # calls not made while it was down

    @staticmethod
    def _key(key: str) -> str:
        return KEY_PREFIX + key

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn, default):
        if not self.up:
            self.skipped += 1
            return default
        try:
            return fn()
        except self._errors as e:
            with self._lock:
                self.failures += 1
                first = self.up
                self._down_until = time.monotonic() + RETRY_S
            if first:
                logger.warning("kv tiers: remote store %s unreachable (%s); treated as empty "
                               "for %.0f s", self.url, e, RETRY_S)
            return default

    def put(self, key: str, blob: bytes) -> None:
        if self._call(lambda: self._r.set(self._key(key), blob), None):
            self.bytes += len(blob)

    def get(self, key: str) -> bytes | None:
        return self._call(lambda: self._r.get(self._key(key)), None)

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda: self._r.exists(self._key(key)), 0))

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Which of ``keys`` the store holds, in one round trip."""
        def ask():
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._key(k))
            return [bool(x) for x in pipe.execute()]

        return self._call(ask, [False] * len(keys)) if keys else []

    def drop(self, key: str) -> None:
        self._call(lambda: self._r.delete(self._key(key)), None)

    def __len__(self) -> int:
        return int(self._call(lambda: sum(1 for _ in self._r.scan_iter(
            KEY_PREFIX + "*", count=1000)), 0))

    def close(self) -> None:
        self._r.close()
