"""Stored responses (``store: true``) for ``GET /v1/responses/{id}`` and
``previous_response_id``: an LRU map id -> (the response's JSON, its whole conversation as chat
messages), bounded by count (``--responses-max-stored``) and by bytes
(``--responses-max-bytes``, the entries' compact JSON). The oldest (least recently stored or
read) entries are evicted first; an entry larger than the byte bound alone is not kept.
Event-loop only (not thread-safe), in memory, per server process."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict  # the Response object as returned
    messages: tuple[dict, ...]  # the conversation so far (chat messages, without instructions)
    nbytes: int


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int) -> None:
        assert max_items >= 0 and max_bytes >= 0
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, response: dict, messages: list[dict]) -> bool:
        """Store (replacing an entry of the same id); False if it is too big to keep."""
        self.delete(rid)
        size = len(json.dumps(response, separators=(",", ":"))) + \
            len(json.dumps(messages, separators=(",", ":")))
        if self.max_items == 0 or size > self.max_bytes:
            return False
        self._items[rid] = StoredResponse(response, tuple(messages), size)
        self.nbytes += size
        while len(self._items) > self.max_items or self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1
        return True

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._items.get(rid)
        if entry is not None:
            self._items.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._items.pop(rid, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True
