"""Which adapter each of the ``--max-loras`` slots holds: least-recently-used eviction among the
slots no running request pins. Names only; the tensors live in engine/lora/layers.py.

    slots:      [ 0: "sql" (pins 2) | 1: "chat" (pins 0) | 2: free ]
    LRU order:  "chat", "sql"       (least recently used first; pinned ones are skipped)
    assign("new") -> slot 2 (free, lowest first); then assign("other") -> evicts "chat", slot 1
"""

from __future__ import annotations

import collections
import dataclasses


class AllSlotsPinned(RuntimeError):
    """Every slot holds an adapter that a running request uses: nothing can be evicted now."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlotAssignment:
    slot: int  # the adapter's slot
    is_new: bool  # its weights must be copied in (it was not in a slot)
    evicted: str | None  # the adapter that held the slot before, if one was evicted for it


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1, num_slots
        self.num_slots = num_slots
        self.name_to_slot: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU first
        self.free_slots = list(range(num_slots))  # ascending: the lowest is taken first
        self.ref_counts: dict[str, int] = {}  # running requests pinning each loaded adapter

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def slot_of(self, name: str) -> int | None:
        return self.name_to_slot.get(name)

    def can_assign(self, name: str) -> bool:
        return name in self.name_to_slot or bool(self.free_slots) or self._victim() is not None

    def assign(self, name: str) -> SlotAssignment:
        """``name``'s slot: the one it holds (made most recently used), else a free one, else the
        least recently used unpinned adapter's. AllSlotsPinned when none is left."""
        if name in self.name_to_slot:
            self.name_to_slot.move_to_end(name)
            return SlotAssignment(self.name_to_slot[name], is_new=False, evicted=None)
        evicted = None
        if not self.free_slots:
            evicted = self._victim()
            if evicted is None:
                raise AllSlotsPinned(
                    f"LoRA adapter {name!r}: all {self.num_slots} adapter slots (--max-loras) hold "
                    "adapters of running requests"
                )
            self.remove(evicted)
        slot = self.free_slots.pop(0)
        self.name_to_slot[name] = slot
        self.ref_counts[name] = 0
        return SlotAssignment(slot, is_new=True, evicted=evicted)

    def pin(self, name: str) -> int:
        """A running request uses ``name`` (assigned already): its slot, never evicted until unpinned."""
        slot = self.name_to_slot[name]
        self.ref_counts[name] += 1
        self.name_to_slot.move_to_end(name)
        return slot

    def unpin(self, name: str) -> None:
        assert self.ref_counts[name] > 0, f"LoRA adapter {name!r} is not pinned"
        self.ref_counts[name] -= 1

    def remove(self, name: str) -> int:
        """Unload ``name``: its slot is free again. ValueError while a running request pins it."""
        if name not in self.name_to_slot:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        if self.ref_counts[name]:
            raise ValueError(f"LoRA adapter {name!r} is in use by {self.ref_counts[name]} running requests")
        slot = self.name_to_slot.pop(name)
        del self.ref_counts[name]
        self.free_slots.append(slot)
        self.free_slots.sort()
        return slot

    def _victim(self) -> str | None:
        return next((name for name in self.name_to_slot if self.ref_counts[name] == 0), None)

    def check_integrity(self) -> None:
        held = list(self.name_to_slot.values())
        assert sorted(held + self.free_slots) == list(range(self.num_slots)), (held, self.free_slots)
        assert self.ref_counts.keys() == self.name_to_slot.keys()
        assert all(n >= 0 for n in self.ref_counts.values()), self.ref_counts
