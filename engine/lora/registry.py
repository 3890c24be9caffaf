"""The adapters one engine serves, by name: the PEFT folder each is read from, the requests that
pin a slot, and the counts a node's /metrics reports. It is the scheduler's admission rule for
adapters (``admit``, engine/core/scheduler.py's ``SlotAdmission``), consulted as a waiting request comes
up in the scheduler's one FIFO:

    a request names adapter "sql" (known: from lora_modules or load_adapter, else a ValueError)
        │
        ├─ its request pins a slot already (a preempted or forked sequence) ─► admitted
        ├─ "sql" holds a slot ───────────────────────────────► pin it ─► admitted
        ├─ a slot is free, or an unpinned one can be evicted
        │  (LRU), and no request waits for a slot before it ─► fill it, pin it ─► admitted
        └─ every slot is pinned ─► it stays in the FIFO, passed by those behind it, until a
                                   request ends and unpins a slot

A request pins its adapter from admission until it ends (all its sequences: forks, beams,
preemptions and recomputes keep the same slot), so the slot a step's rows name never changes
under them. An adapter that leaves its slot stays known: its folder is read again on demand.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from pdserve.engine.core.sequence import Sequence
from pdserve.engine.lora.adapter import LoRAAdapter
from pdserve.engine.lora.model import LoRAModel

if TYPE_CHECKING:
    from pdserve.engine.executor.executor import Executor


class UnknownAdapterError(ValueError):
    """A request names an adapter this engine does not serve (OpenAI's 404-style error, where a
    node tells it from the other ValueErrors: its 400s)."""


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterStats:
    """One served adapter, for a node's status record and /metrics."""

    name: str  # what requests call it (SamplingParams.adapter)
    path: str  # its PEFT folder
    slot: int | None  # the slot it holds now; None while out of memory (evicted, or never used)
    num_running_requests: int  # admitted requests that pin its slot
    num_waiting_requests: int  # requests queued until a slot frees for it
    num_requests: int  # requests admitted with it since it was loaded
    num_loads: int  # times its weights were copied into a slot
    num_evictions: int  # times it left its slot for another adapter


@dataclasses.dataclass(slots=True)
class _Counts:
    num_requests: int = 0
    num_loads: int = 0
    num_evictions: int = 0


class AdapterRegistry:
    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.lora: LoRAModel = executor.lora_slots  # the slot table that decides (rank 0's)
        self.name_to_path: dict[str, str] = {}  # every known adapter, in the order it came
        self.counts: dict[str, _Counts] = {}
        self.request_to_adapter: dict[str, str] = {}  # admitted requests -> the adapter they pin

    # ------------------------------------------------------------------ known adapters
    def add(self, name: str, path: str) -> None:
        """Serve the PEFT folder ``path`` as ``name``: read and checked now (ValueError naming
        the adapter and the field), and put in a slot if one is free (none is evicted for it)."""
        if name in self.name_to_path:
            raise ValueError(f"adapter: {name!r} is already loaded (from {self.name_to_path[name]})")
        adapter = self.lora.read(name, path)
        self.name_to_path[name] = str(path)
        self.counts[name] = _Counts()
        if self.lora.slots.num_free_slots:
            self._fill(name, adapter)

    def remove(self, name: str, waiting: Iterable[Sequence] = ()) -> None:
        """Stop serving ``name``; ValueError when it is unknown or a request uses it or waits for
        it (``waiting``: the scheduler's queue)."""
        self.check(name)
        users = {r for r, a in self.request_to_adapter.items() if a == name}
        users |= {s.request_id for s in waiting if s.params.adapter == name}
        if users:
            raise ValueError(f"adapter: {name!r} is in use by {len(users)} requests")
        if self.lora.slot_of(name) is not None:
            self.executor.unload_adapter(name)
        del self.name_to_path[name], self.counts[name]

    def check(self, name: str, path: str | None = None) -> None:
        """ValueError unless ``name`` is served here (in a slot or not), or comes with the
        ``path`` of its folder to be read from (SamplingParams.adapter_path: ``add`` it first)."""
        if name not in self.name_to_path and path is None:
            known = ", ".join(map(repr, self.name_to_path)) or "none"
            raise UnknownAdapterError(f"adapter: {name!r} is not loaded (loaded: {known})")

    def names(self) -> tuple[str, ...]:
        return tuple(self.name_to_path)

    # ------------------------------------------------------------------ requests
    def admit(self, seq: Sequence, may_load: bool) -> bool:
        """Whether ``seq`` may enter a step: it names no adapter, its request pins a slot already,
        or its adapter's slot is pinned for it now (filled first if ``may_load`` and a slot is
        free or evictable). False while every slot is pinned. ValueError when the adapter's
        folder cannot be read again."""
        if seq.params.adapter is None or seq.request_id in self.request_to_adapter:
            return True
        return self._pin(seq, may_fill=may_load)

    def release(self, request_id: str) -> None:
        """The request ended (finished or aborted): unpin its slot, if it held one."""
        name = self.request_to_adapter.pop(request_id, None)
        if name is not None:
            self.lora.unpin(name)

    def _pin(self, seq: Sequence, may_fill: bool) -> bool:
        name = seq.params.adapter
        assert name is not None and seq.request_id not in self.request_to_adapter, seq.request_id
        if self.lora.slot_of(name) is None:
            if not may_fill or not self.lora.can_load(name):
                return False
            self._fill(name, self.lora.read(name, self.name_to_path[name]))
        self.lora.pin(name)
        self.request_to_adapter[seq.request_id] = name
        self.counts[name].num_requests += 1
        return True

    def _fill(self, name: str, adapter: LoRAAdapter) -> None:
        assignment = self.executor.load_adapter(adapter)
        self.counts[name].num_loads += 1
        if assignment.evicted is not None:
            self.counts[assignment.evicted].num_evictions += 1

    # ------------------------------------------------------------------ reports
    def check_integrity(self, live_request_ids: Collection[str]) -> None:
        """Pins match the requests that hold them, and those are the engine's live requests."""
        self.lora.slots.check_integrity()
        pins = collections.Counter(self.request_to_adapter.values())
        assert dict(pins) == {n: c for n, c in self.lora.slots.ref_counts.items() if c}, pins
        assert all(r in live_request_ids for r in self.request_to_adapter), self.request_to_adapter
        assert self.name_to_path.keys() >= self.lora.slots.name_to_slot.keys(), "an unknown adapter in a slot"

    def stats(self, waiting: Iterable[Sequence] = ()) -> tuple[AdapterStats, ...]:
        """Each adapter's counts; ``waiting``: the scheduler's queue (requests not yet pinning)."""
        pins = collections.Counter(self.request_to_adapter.values())
        unpinned = {
            s.request_id: s.params.adapter for s in waiting if s.request_id not in self.request_to_adapter
        }
        waits = collections.Counter(a for a in unpinned.values() if a is not None)
        return tuple(
            AdapterStats(
                name=name,
                path=path,
                slot=self.lora.slot_of(name),
                num_running_requests=pins[name],
                num_waiting_requests=waits[name],
                num_requests=self.counts[name].num_requests,
                num_loads=self.counts[name].num_loads,
                num_evictions=self.counts[name].num_evictions,
            )
            for name, path in self.name_to_path.items()
        )
