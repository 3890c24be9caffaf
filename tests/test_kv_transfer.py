"""KV transfer over real loopback sockets: sender in a thread, receiver polled by the test."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from kv_transfer_peer import (
    BLOCK_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    PoolReservations,
    make_caches,
    make_fingerprint,
    prefill_side,
)

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.sequence import Sequence, SequenceStatus
from pdserve.engine.executor.platform import Platform, SplitPlatform
from pdserve.kv_transfer.errors import KVRejected, KVTimeout
from pdserve.kv_transfer.messages import WireFormat
from pdserve.kv_transfer.receiver import KVReceiver, PollResult, ReceiverConfig
from pdserve.kv_transfer.sender import KVSender, SenderConfig
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)
NUM_BLOCKS = 16


@dataclasses.dataclass(frozen=True)
class Link:
    address: str  # where the receiver binds
    shared_memory: bool  # chunks through the sender's shared ring instead of the socket


@pytest.fixture(params=["tcp", "ipc", "tcp+shm"])
def link(request: pytest.FixtureRequest) -> Iterator[Link]:
    shm = request.param.endswith("+shm")
    if request.param.startswith("tcp"):
        yield Link("tcp://127.0.0.1:0", shm)
        return
    folder = tempfile.mkdtemp(prefix="kvt")  # short: ipc paths are limited to ~100 bytes
    yield Link(f"ipc://{folder}/kv.sock", shm)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        yield executor


def make_receiver(
    address: str, num_blocks: int = NUM_BLOCKS, platform: Platform | None = None, **config: object
) -> KVReceiver:
    keys, values = make_caches(num_blocks, seed=None)
    config = ReceiverConfig(**config)  # type: ignore[arg-type]
    pool = PoolReservations(BlockManager(num_blocks, BLOCK_SIZE))
    receiver = KVReceiver(address, make_fingerprint(), pool, keys, values, config, platform=platform)
    pool.deliver = receiver.grant
    return receiver


def make_sender(
    receiver: KVReceiver, link: Link, platform: Platform | None = None, **config: object
) -> KVSender:
    sender_config = SenderConfig(shared_memory=link.shared_memory, staging_bytes=1 << 20, **config)  # type: ignore
    return KVSender(receiver.address, make_fingerprint(), sender_config, platform=platform)


def poll_until(
    receiver: KVReceiver, done: Callable[[PollResult], bool], timeout_s: float = 10.0
) -> PollResult:
    """Poll, accumulating events, until ``done`` holds for them."""
    total = PollResult()
    deadline = time.monotonic() + timeout_s
    while not done(total):
        assert time.monotonic() < deadline, "receiver made no progress"
        got = receiver.poll(0.05)
        total.completed += got.completed
        total.failed += got.failed
    return total


def assert_blocks_equal(
    src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor], dst_ids: list[int]
):
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s[src_ids], d[dst_ids])


# "split": both caches stand for device memory (engine.platform.SplitPlatform), so every chunk is
# copied on a copy stream that lands only at its event: bytes read before it would be stale.
@pytest.mark.parametrize("platform", [Platform(), SplitPlatform()], ids=["host", "split"])
def test_round_trip_lands_exact_bytes_in_the_granted_blocks(link, pool, platform):
    receiver = make_receiver(link.address, platform=platform)
    squatter = Sequence("squat", [9] * 3 * BLOCK_SIZE, 3 * BLOCK_SIZE, SamplingParams())
    receiver.reservations.block_manager.append(squatter, 3 * BLOCK_SIZE)  # so the free layouts differ
    tokens = list(range(100, 100 + 3 * BLOCK_SIZE + 1))  # 3 full blocks and one partial
    src_bm, src_seq = prefill_side(tokens, NUM_BLOCKS, skip=5)
    keys, values = make_caches(NUM_BLOCKS, seed=1)
    sender = make_sender(receiver, link, platform)  # each side makes its own copy stream

    future = pool.submit(sender.transfer, "r1", tokens, keys, values, src_seq.block_table, first_token=7)
    got = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
    stats = future.result(timeout=5)

    seq = receiver.reservations.seqs[got.request_id]
    assert seq.status is SequenceStatus.WAITING_FOR_KV and got.num_held_blocks == 0 and got.first_token == 7
    receiver.reservations.arrived(got.request_id)
    assert seq.num_computed_tokens == len(tokens) and seq.status is SequenceStatus.RUNNING
    assert seq.block_table == [3, 4, 5, 6] and src_seq.block_table == [5, 6, 7, 8]
    assert_blocks_equal(keys, src_seq.block_table, receiver.key_caches, seq.block_table)
    assert_blocks_equal(values, src_seq.block_table, receiver.value_caches, seq.block_table)
    assert stats.bytes_sent == got.bytes_received == 2 * NUM_LAYERS * 4 * keys[0][0].numel() * 4
    assert stats.shm == (link.shared_memory and not platform.separate_host)  # device caches: the socket
    receiver.reservations.block_manager.check_integrity([squatter, seq])
    receiver.reservations.finish(got.request_id)
    receiver.reservations.block_manager.free(squatter)
    assert receiver.reservations.block_manager.num_free_blocks == NUM_BLOCKS
    src_bm.free(src_seq)
    sender.close()
    receiver.close()


def test_prefix_blocks_held_by_the_receiver_are_not_sent(link, pool):
    receiver = make_receiver(link.address)
    bm = receiver.reservations.block_manager
    keys, values = make_caches(NUM_BLOCKS, seed=2)
    sender = make_sender(receiver, link)
    first = list(range(1, 2 * BLOCK_SIZE + 2))  # 2 full blocks + 1 token
    _, src_seq = prefill_side(first, NUM_BLOCKS)
    future = pool.submit(sender.transfer, "a", first, keys, values, src_seq.block_table, 5)
    receiver.reservations.finish(
        poll_until(receiver, lambda r: bool(r.completed)).completed[0].request_id
    )  # blocks stay cached
    future.result(timeout=5)  # a KVSender is used from one thread at a time

    second = [*first[: 2 * BLOCK_SIZE], 50, 51, 52, 53, 54]  # same 2 leading blocks, new tail (2 blocks)
    _, src_seq2 = prefill_side(second, NUM_BLOCKS)
    future = pool.submit(sender.transfer, "b", second, keys, values, src_seq2.block_table, 6)
    got = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
    stats = future.result(timeout=5)

    block_bytes = 2 * NUM_LAYERS * keys[0][0].numel() * 4  # K and V, every layer, fp32
    assert got.num_held_blocks == stats.num_held_blocks == 2
    assert stats.bytes_sent == got.bytes_received == 2 * block_bytes  # only the two tail blocks
    assert_blocks_equal(
        keys,
        src_seq2.block_table,
        receiver.key_caches,
        receiver.reservations.arrived(got.request_id).block_table,
    )
    bm.check_integrity([receiver.reservations.arrived(got.request_id)])
    receiver.reservations.finish(got.request_id)
    assert bm.num_free_blocks == NUM_BLOCKS
    sender.close()
    receiver.close()


def test_second_sender_waits_for_room_then_completes(link, pool):
    receiver = make_receiver(link.address, num_blocks=3)  # room for one 9-token prompt (3 blocks)
    keys, values = make_caches(NUM_BLOCKS, seed=3)
    tokens_a, tokens_b = list(range(1, 10)), list(range(20, 29))
    _, seq_a = prefill_side(tokens_a, NUM_BLOCKS)
    _, seq_b = prefill_side(tokens_b, NUM_BLOCKS)
    sender_a = make_sender(receiver, link)
    sender_b = make_sender(receiver, link)
    pool.submit(sender_a.transfer, "a", tokens_a, keys, values, seq_a.block_table, 1)
    got_a = poll_until(receiver, lambda r: bool(r.completed)).completed[0]

    future_b = pool.submit(sender_b.transfer, "b", tokens_b, keys, values, seq_b.block_table, 2)
    poll_until(receiver, lambda r: receiver.num_queued == 1)
    receiver.poll(0.2)
    assert receiver.num_queued == 1 and receiver.num_incoming == 0 and not future_b.done()
    receiver.reservations.finish(got_a.request_id)  # request a finished decoding
    got_b = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
    assert future_b.result(timeout=5).num_sent_blocks == 3
    assert_blocks_equal(
        keys,
        seq_b.block_table,
        receiver.key_caches,
        receiver.reservations.arrived(got_b.request_id).block_table,
    )
    receiver.reservations.finish(got_b.request_id)
    receiver.reservations.block_manager.check_integrity([])
    assert receiver.reservations.block_manager.num_free_blocks == 3
    sender_a.close()
    sender_b.close()
    receiver.close()


def test_fingerprint_mismatch_is_rejected_naming_the_field(link, pool):
    receiver = make_receiver(link.address)
    sender = KVSender(receiver.address, make_fingerprint(num_kv_heads=4))
    future = pool.submit(sender.reserve, "r", [1, 2, 3])
    receiver.poll(0.5)
    with pytest.raises(KVRejected) as info:
        future.result(timeout=5)
    assert info.value.field == "num_kv_heads"
    assert receiver.reservations.block_manager.num_free_blocks == NUM_BLOCKS
    sender.close()
    receiver.close()


def test_prompt_that_can_never_fit_is_rejected(link, pool):
    receiver = make_receiver(link.address, num_blocks=2)
    sender = make_sender(receiver, link)
    future = pool.submit(sender.reserve, "big", list(range(3 * BLOCK_SIZE)))
    receiver.poll(0.5)
    with pytest.raises(KVRejected) as info:
        future.result(timeout=5)
    assert info.value.field == "token_ids" and receiver.num_queued == 0
    sender.close()
    receiver.close()


def test_queued_reservation_is_rejected_when_its_ttl_passes(link, pool):
    receiver = make_receiver(link.address, num_blocks=2, max_ttl_s=0.3)  # caps the sender's 5 s
    hog = Sequence("hog", [0] * BLOCK_SIZE, BLOCK_SIZE, SamplingParams())
    receiver.reservations.block_manager.append(hog, BLOCK_SIZE)
    sender = make_sender(receiver, link, grant_timeout_s=5)
    future = pool.submit(sender.reserve, "late", list(range(2 * BLOCK_SIZE)))
    got = poll_until(receiver, lambda r: bool(r.failed))
    assert isinstance(got.failed[0].error, KVTimeout) and receiver.num_queued == 0
    with pytest.raises(KVRejected) as info:
        future.result(timeout=5)
    assert info.value.field == "ttl_s"
    receiver.reservations.block_manager.free(hog)
    assert receiver.reservations.block_manager.num_free_blocks == 2
    sender.close()
    receiver.close()


def test_int8_wire_quarters_the_bytes_within_quantization_error(link, pool):
    receiver = make_receiver(link.address)
    tokens = list(range(1, 2 * BLOCK_SIZE + 1))
    _, src_seq = prefill_side(tokens, NUM_BLOCKS)
    keys, values = make_caches(NUM_BLOCKS, seed=4)
    sender = make_sender(receiver, link, wire_format=WireFormat.INT8)
    future = pool.submit(sender.transfer, "q", tokens, keys, values, src_seq.block_table, 3)
    got = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
    stats = future.result(timeout=5)
    elems = 2 * NUM_LAYERS * 2 * keys[0][0].numel()  # K and V, layers, blocks, elements per block
    num_scales = 2 * NUM_LAYERS * 2 * NUM_KV_HEADS  # K and V, layers, blocks, heads
    assert stats.bytes_sent == elems + num_scales * 4  # int8 values + one fp32 scale per (block, head)
    for src, dst in [(keys, receiver.key_caches), (values, receiver.value_caches)]:
        for s, d in zip(src, dst, strict=True):
            x, y = (
                s[src_seq.block_table],
                d[receiver.reservations.arrived(got.request_id).block_table],
            )  # [blocks, block_size, heads, dim]
            step = x.abs().amax(dim=(1, 3), keepdim=True) / 127  # one scale per (block, head)
            assert ((x - y).abs() <= step / 2 + 1e-6).all()
    receiver.reservations.finish(got.request_id)
    assert receiver.reservations.block_manager.num_free_blocks == NUM_BLOCKS
    sender.close()
    receiver.close()


def test_a_reservation_waits_while_the_engine_runs_max_num_seqs(link, pool):
    """Incoming transfers are admitted by the engine's rules: with max_num_seqs 1 and one request
    holding its slot, the next reservation queues (KVWait) until that one finishes."""
    keys, values = make_caches(NUM_BLOCKS, seed=None)
    reservations = PoolReservations(BlockManager(NUM_BLOCKS, BLOCK_SIZE), max_num_seqs=1)
    receiver = KVReceiver(link.address, make_fingerprint(), reservations, keys, values)
    reservations.deliver = receiver.grant
    sender = make_sender(receiver, link, grant_timeout_s=10)
    src_keys, src_values = make_caches(NUM_BLOCKS, seed=5)
    tokens = list(range(1, BLOCK_SIZE + 3))
    _, src_seq = prefill_side(tokens, NUM_BLOCKS)
    first = pool.submit(sender.transfer, "one", tokens, src_keys, src_values, src_seq.block_table, 3)
    assert poll_until(receiver, lambda r: bool(r.completed)).completed[0].request_id == "one"
    first.result(timeout=5)
    second = pool.submit(sender.transfer, "two", [*tokens, 9], src_keys, src_values, src_seq.block_table, 3)
    receiver.poll(0.5)
    assert receiver.num_queued == 1 and receiver.num_incoming == 0 and not second.done()
    reservations.finish("one")  # it decoded to its end: the slot is free
    assert poll_until(receiver, lambda r: bool(r.completed)).completed[0].request_id == "two"
    second.result(timeout=5)
    reservations.finish("two")
    assert reservations.block_manager.num_free_blocks == NUM_BLOCKS
    sender.close()
    receiver.close()
