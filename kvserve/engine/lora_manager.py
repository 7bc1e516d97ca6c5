"""The engine's LoRA adapters: which are registered (by name), which of the ``max_loras`` slots
each occupies, and each step's row -> slot assignment.

Adapters are read and checked once, when registered (``add``: ``--lora-modules``, the
server's ``/v1/load_lora_adapter``, or a ``LoRARequest`` with a path), and kept on the host; an
adapter is copied into a slot of the wrapped linears (kvserve.model.lora) the first time a step
needs it, evicting the least recently used slot the step does not use. The scheduler never
runs more distinct adapters at once than there are slots (``Scheduler(max_loras=...)``), so a
step always finds room. Runs on the engine thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from kvserve.layers.lora import LoRALinear
from kvserve.model.lora import LoRAAdapter, load_into_slot, read_adapter
from kvserve.request import AdapterRef, LoRARequest

logger = logging.getLogger("kvserve")


class LoRAManager:
    def __init__(self, wrapped: dict[tuple[int, str], LoRALinear], config, max_loras: int,
                 max_rank: int) -> None:
        self.wrapped, self.config = wrapped, config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self.refs: dict[str, AdapterRef] = {}
        self._next_id = 1
        self.slots: list[str | None] = [None] * max_loras
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))

    # ---- registry ----------------------------------------------------------------------------
    def add(self, name: str, path: str, lora_id: int = 0,
            param: str = "lora_path") -> AdapterRef:
        """Read, check and register the PEFT folder ``path`` as ``name`` (ValueError naming
        ``param`` for a bad adapter, or ``lora_name`` for a name already taken)."""
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name must be a non-empty string")
        if name in self.adapters:
            raise ValueError(f"lora_name: adapter {name!r} is already loaded")
        adapter = read_adapter(name, path, self.config, self.max_rank, param)
        taken = {r.lora_id for r in self.refs.values()}
        if not lora_id or lora_id in taken:
            while self._next_id in taken:
                self._next_id += 1
            lora_id = self._next_id
        self.adapters[name] = adapter
        self.refs[name] = ref = AdapterRef(lora_id, name, adapter.digest)
        logger.info("LoRA adapter %s (id %d): rank %d, %s, from %s", name, lora_id,
                    adapter.rank, ", ".join(adapter.target_modules), path)
        return ref

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"lora_name: no adapter {name!r} is loaded")
        del self.adapters[name], self.refs[name]
        for s, held in enumerate(self.slots):
            if held == name:
                load_into_slot(self.wrapped, s, None)
                self.slots[s] = None

    def resolve(self, req: LoRARequest) -> AdapterRef:
        """The adapter a request names, registered from its ``lora_path`` on first use."""
        if not isinstance(req, LoRARequest):
            raise ValueError("lora_request must be a LoRARequest")
        ref = self.refs.get(req.lora_name)
        if ref is not None:
            return ref
        if not req.lora_path:
            raise ValueError(f"lora_request: no adapter {req.lora_name!r} is loaded (and the "
                             "request gives no lora_path)")
        return self.add(req.lora_name, req.lora_path, req.lora_int_id)

    def names(self) -> list[str]:
        return list(self.adapters)

    # ---- slots -------------------------------------------------------------------------------
    def slots_for(self, adapters: list[AdapterRef | None]) -> list[int]:
        """Each sequence's slot (-1: none), loading adapters the step lacks into the least
        recently used slots the step does not use."""
        wanted = {a.lora_name for a in adapters if a is not None}
        assert len(wanted) <= self.max_loras, "the scheduler admitted more adapters than slots"
        slot_of = {name: s for s, name in enumerate(self.slots) if name in wanted}
        for name in wanted - set(slot_of):
            free = next(s for s in self._lru if self.slots[s] not in wanted)
            load_into_slot(self.wrapped, free, self.adapters[name])
            self.slots[free] = name
            slot_of[name] = free
        for s in slot_of.values():
            self._lru.move_to_end(s)
        return [-1 if a is None else slot_of[a.lora_name] for a in adapters]
