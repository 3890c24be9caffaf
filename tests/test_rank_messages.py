"""engine/executor/rank_messages.py: every call rank 0 makes on a worker, and every reply, comes back from
the wire as it went (msgpack ``[tag, fields]``, the tag explicit); a frame this code does not
know is refused naming why; the socket carries messages and a memfd beside them; and a worker
process has a handler for every call but the first (WorkerStart) and the last (Shutdown)."""

from __future__ import annotations

import dataclasses
import os
import socket

import msgpack
import numpy as np
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.executor.model_runner import StepPlan
from pdserve.engine.executor.rank_messages import (
    MESSAGES,
    AllocateKV,
    ClearLoRASlot,
    Failed,
    FillLoRASlot,
    Joining,
    Profile,
    RankChannel,
    RankMessageError,
    Ready,
    Shutdown,
    StepCall,
    TimePrefill,
    WorkerStart,
    from_wire,
    to_wire,
)
from pdserve.engine.executor.rank_pools import SharedPool
from pdserve.engine.executor.worker import HANDLERS, process_handlers
from pdserve.protocol.kv_layout import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")


def _plan() -> StepPlan:
    arrays = {
        "input_ids": np.array([10, 24, 25], np.int64),
        "tables": np.array([[6, 1], [3, 0]], np.int32),
        "lora_slots": np.array([2, 2, 0], np.int64),
    }
    return StepPlan(arrays, num_decodes=1, block_copies=[(4, 7)], prompt_rows=[(1, 2)])


SIMPLE = [
    WorkerStart(
        rank=1,
        tp_size=2,
        model="/models/tiny",
        config=EngineConfig(model="/models/tiny", block_size=4, num_kv_blocks=8, enable_lora=True),
        init_method="tcp://127.0.0.1:29500",
        backend="gloo",
        timeout_s=120.0,
        threads=None,
    ),
    AllocateKV(SPEC),
    Profile(num_tokens=2048, num_seqs=64, max_model_len=512),
    TimePrefill(num_tokens=512),
    FillLoRASlot(slot=1, name="sql", path="/adapters/sql"),
    ClearLoRASlot(slot=1),
    Shutdown(),
    Joining(),
    Ready(),
    Failed("ValueError: rank 1 has no slot 9"),
]


@pytest.mark.parametrize("message", SIMPLE, ids=lambda m: type(m).__name__)
def test_each_message_comes_back_from_the_wire_as_it_went_under_its_own_tag(message):
    body = to_wire(message)
    tag, _ = msgpack.unpackb(body, raw=False)
    assert tag == type(message).TAG and MESSAGES[tag] is type(message)
    assert from_wire(body) == message


def test_a_step_call_comes_back_with_its_plan_array_for_array():
    plan = _plan()
    back = from_wire(to_wire(StepCall(plan)))
    assert isinstance(back, StepCall)
    got = back.plan
    assert got.arrays.keys() == plan.arrays.keys()
    for name, array in plan.arrays.items():
        assert got.arrays[name].dtype == array.dtype and got.arrays[name].tolist() == array.tolist()
    assert (got.num_decodes, got.block_copies, got.prompt_rows) == (1, [(4, 7)], [(1, 2)])


def test_every_tag_names_one_message_type():
    assert len({cls.TAG for cls in MESSAGES.values()}) == len(MESSAGES) == 11


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (msgpack.packb(["bogus", {}]), "unknown rank message tag 'bogus'"),
        (msgpack.packb(["time_prefill", {}]), "TimePrefill"),  # a field missing
        (msgpack.packb(["shutdown", {"now": True}]), "Shutdown"),  # a field it does not have
        (msgpack.packb(["step", []]), "unknown rank message tag 'step'"),  # fields not a map
        (b"\xc1", "not a rank message"),
    ],
)
def test_a_frame_this_code_does_not_know_is_refused_naming_why(body, why):
    with pytest.raises(RankMessageError, match=why):
        from_wire(body)


def test_the_channel_carries_messages_and_a_memfd_beside_them_and_says_when_the_peer_left():
    ours, theirs = (RankChannel(s) for s in socket.socketpair())
    pool = SharedPool(SPEC)  # rank 0's memfd for a worker
    pool.tensor[1, 0, 3] = 2.5  # layer 1's K, block 3
    try:
        ours.send(AllocateKV(SPEC))
        ours.send_fd(pool.fd)
        ours.send(ClearLoRASlot(0))
        call = theirs.recv()
        assert call == AllocateKV(SPEC)
        mapped = SharedPool(call.spec, theirs.recv_fd())  # the worker's view of the same pages
        assert mapped.layer_caches()[1][0][3].eq(2.5).all()
        mapped.tensor[0, 1, 4] = -1.0  # the worker writes layer 0's V, block 4: rank 0 sees it
        assert pool.layer_caches()[0][1][4].eq(-1.0).all()
        assert theirs.recv() == ClearLoRASlot(0)
        with pytest.raises(TimeoutError):
            theirs.recv(timeout_s=0.05)
        ours.close()
        assert theirs.recv() is None
    finally:
        theirs.close()
        os.close(pool.fd)


def test_a_worker_has_a_handler_for_every_call_but_the_first_and_the_last():
    ours, theirs = socket.socketpair()
    try:
        table = process_handlers(RankChannel(theirs))
    finally:
        ours.close()
        theirs.close()
    calls = {cls for cls in MESSAGES.values() if cls not in (Joining, Ready, Failed, WorkerStart, Shutdown)}
    assert set(table) == calls
    assert all(table[cls] is handler for cls, handler in HANDLERS.items())  # rank 0's, the same
    assert all(dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen for cls in MESSAGES.values())
