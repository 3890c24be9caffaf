"""engine/lora/slots.py driven directly with three slots: exact slot ids through free slots, reuse,
LRU eviction, pins and unloading."""

from __future__ import annotations

import pytest

from pdserve.engine.lora.slots import AllSlotsPinned, SlotAssignment, SlotTable


def _table(*names: str) -> SlotTable:
    table = SlotTable(3)
    for name in names:
        table.assign(name)
    return table


def test_free_slots_are_taken_lowest_first_and_a_loaded_adapter_keeps_its_slot():
    table = SlotTable(3)
    assert table.assign("a") == SlotAssignment(0, is_new=True, evicted=None)
    assert table.assign("b") == SlotAssignment(1, is_new=True, evicted=None)
    assert table.assign("a") == SlotAssignment(0, is_new=False, evicted=None)
    assert [table.slot_of(name) for name in "abc"] == [0, 1, None]
    assert table.num_free_slots == 1
    table.check_integrity()


def test_the_least_recently_used_adapter_is_evicted_when_no_slot_is_free():
    table = _table("a", "b", "c")
    table.assign("a")  # a is used again: b is now the least recently used
    assert table.assign("d") == SlotAssignment(1, is_new=True, evicted="b")
    assert table.assign("e") == SlotAssignment(2, is_new=True, evicted="c")
    assert list(table.name_to_slot.items()) == [("a", 0), ("d", 1), ("e", 2)]
    table.check_integrity()


def test_a_pinned_adapter_is_never_evicted_and_all_pinned_is_a_clear_error():
    table = _table("a", "b", "c")
    table.pin("a")
    table.pin("b")
    assert table.assign("d") == SlotAssignment(2, is_new=True, evicted="c")
    table.pin("d")
    assert not table.can_assign("e") and table.can_assign("a")
    with pytest.raises(
        AllSlotsPinned, match="'e': all 3 adapter slots .--max-loras. hold adapters of running"
    ):
        table.assign("e")
    table.unpin("b")
    assert table.assign("e") == SlotAssignment(1, is_new=True, evicted="b")
    table.check_integrity()


def test_pins_count_requests_and_the_last_unpin_makes_it_evictable():
    table = _table("a", "b", "c")
    table.pin("a")
    table.pin("a")
    table.unpin("a")
    table.assign("b")
    table.assign("c")  # a is the least recently used, but one request still pins it
    assert table.assign("d").evicted == "b"
    table.unpin("a")
    assert table.assign("e").evicted == "a"


def test_unloading_frees_the_slot_but_not_while_pinned():
    table = _table("a", "b")
    table.pin("b")
    with pytest.raises(ValueError, match="'b' is in use by 1 running requests"):
        table.remove("b")
    assert table.remove("a") == 0
    assert table.assign("c") == SlotAssignment(0, is_new=True, evicted=None)
    table.unpin("b")
    assert table.remove("b") == 1 and table.free_slots == [1, 2]
    table.check_integrity()
