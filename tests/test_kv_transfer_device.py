"""KV transfer with the caches in device memory, checked on the CPU with ``SplitPlatform``: its
copies onto a copy stream land only when an event recorded after them is waited on, as a GPU's
complete only then. A frame checksummed, or a block reported landed, before its event would hold
stale bytes here; the tests that switch the waits off show that they would."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import pytest
import torch
from kv_transfer_peer import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, make_fingerprint, prefill_side
from test_kv_transfer import make_caches, make_receiver, poll_until

from pdserve.engine.executor.platform import FakeEvent, Platform, SplitPlatform
from pdserve.kv_transfer import shared_cache, tensors
from pdserve.kv_transfer.messages import KVShipment, WireFormat
from pdserve.kv_transfer.sender import KVSender, SenderConfig
from pdserve.kv_transfer.staging import StagingRing
from pdserve.prefill_node.shipper import Shipment, Shipper
from pdserve.protocol.kv_layout import KVCacheSpec
from tests.cluster import free_port

pytestmark = pytest.mark.timeout(30)
SHAPE = (8, 4, 2, 8)  # [num_blocks, block_size, kv_heads, head_dim]
IDS = pytest.mark.parametrize(
    "src_ids,dst_ids", [([2, 3, 4], [5, 6, 7]), ([7, 1, 4], [0, 6, 3])], ids=["runs", "scattered"]
)
FORMATS = pytest.mark.parametrize(
    "wire,dtype",
    [
        (WireFormat.NATIVE, torch.float32),
        (WireFormat.NATIVE, torch.bfloat16),
        (WireFormat.INT8, torch.float32),
    ],
    ids=["native-fp32", "native-bf16", "int8"],
)


def _caches(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen).to(dtype), torch.randn(SHAPE, generator=gen).to(dtype)


def _slot(dtype: torch.dtype, n: int, wire: WireFormat) -> torch.Tensor:
    """A zeroed staging slot for n blocks: a frame the copies never reached reads as zeros."""
    sizes = tensors.frame_sizes(SHAPE[1:], dtype, n, wire)
    return torch.zeros(tensors.frame_offsets(sizes)[1], dtype=torch.uint8)


def _sums(frames: list[torch.Tensor]) -> list[int]:
    return [tensors.checksum(tensors.as_frame(f)) for f in frames]


def _events_never_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug the tests guard against: reading a copy's destination without waiting for it."""
    monkeypatch.setattr(FakeEvent, "synchronize", lambda self: None)
    monkeypatch.setattr(FakeEvent, "wait", lambda self, stream=None: None)


def test_a_deferred_copy_read_before_its_event_gives_stale_bytes():
    """The fake works: what the other tests prove rests on it."""
    platform = SplitPlatform()
    stream = platform.stream()
    src, dst = torch.arange(16.0), torch.zeros(16)
    platform.copy(dst, src, stream)
    src.fill_(-1.0)  # the copy carries the source as it was when issued
    event = platform.event()
    event.record(stream)
    assert not dst.any()  # issued and recorded, not waited on: stale
    event.synchronize()
    assert torch.equal(dst, torch.arange(16.0))


@FORMATS
@IDS
def test_pack_and_unpack_through_device_copies_equal_the_host_path_bit_for_bit(wire, dtype, src_ids, dst_ids):
    k, v = _caches(dtype, seed=0)
    ids = torch.tensor(src_ids)
    host_frames = tensors.pack_layer(k, v, ids, wire, _slot(dtype, 3, wire))
    copies = tensors.DeviceCopies(SplitPlatform())
    frames = tensors.pack_layer(k, v, ids, wire, _slot(dtype, 3, wire), copies)
    assert _sums(frames) == _sums(host_frames)

    views = [tensors.as_frame(f) for f in frames]
    host_k, host_v = torch.zeros(SHAPE, dtype=dtype), torch.zeros(SHAPE, dtype=dtype)
    tensors.unpack_layer(views, host_k, host_v, torch.tensor(dst_ids), wire)
    dst_k, dst_v = torch.zeros(SHAPE, dtype=dtype), torch.zeros(SHAPE, dtype=dtype)
    tensors.unpack_layer(views, dst_k, dst_v, torch.tensor(dst_ids), wire, copies)
    assert torch.equal(dst_k, host_k) and torch.equal(dst_v, host_v)
    if wire is WireFormat.NATIVE:
        assert torch.equal(dst_k[dst_ids], k[src_ids]) and torch.equal(dst_v[dst_ids], v[src_ids])
    untouched = [i for i in range(SHAPE[0]) if i not in dst_ids]
    assert not dst_k[untouched].any() and not dst_v[untouched].any()
    assert not copies.stream.queue  # every copy landed before the calls returned


@FORMATS
@IDS
def test_packed_frames_hold_the_blocks_only_because_the_copy_event_is_waited_on(
    monkeypatch, wire, dtype, src_ids, dst_ids
):
    k, v = _caches(dtype, seed=1)
    ids = torch.tensor(src_ids)
    expected = _sums(tensors.pack_layer(k, v, ids, wire, _slot(dtype, 3, wire)))
    _events_never_wait(monkeypatch)
    copies = tensors.DeviceCopies(SplitPlatform())
    frames = tensors.pack_layer(k, v, ids, wire, _slot(dtype, 3, wire), copies)
    assert all(not f.any() for f in frames)  # checksummed now, the frames would be the slot's zeros
    copies.stream.flush()  # what waiting on the event does
    assert _sums(frames) == expected


@FORMATS
@IDS
def test_received_blocks_are_scattered_only_after_their_upload_has_landed(
    monkeypatch, wire, dtype, src_ids, dst_ids
):
    k, v = _caches(dtype, seed=2)
    frames = tensors.pack_layer(k, v, torch.tensor(src_ids), wire, _slot(dtype, 3, wire))
    views = [tensors.as_frame(f) for f in frames]
    expected_k, expected_v = torch.zeros(SHAPE, dtype=dtype), torch.zeros(SHAPE, dtype=dtype)
    tensors.unpack_layer(views, expected_k, expected_v, torch.tensor(dst_ids), wire)
    _events_never_wait(monkeypatch)
    copies = tensors.DeviceCopies(SplitPlatform())
    dst_k, dst_v = torch.zeros(SHAPE, dtype=dtype), torch.zeros(SHAPE, dtype=dtype)
    tensors.unpack_layer(views, dst_k, dst_v, torch.tensor(dst_ids), wire, copies)
    # Without the wait the scatter ran while the upload was still queued, and landed whatever the
    # device staging buffer held before it.
    assert len(copies.stream.queue) == 1
    assert not torch.equal(dst_k[dst_ids], expected_k[dst_ids])


def test_a_device_cache_gets_a_private_host_ring_even_for_a_local_peer():
    ring = StagingRing(1 << 16, shared=True, platform=SplitPlatform())
    try:
        assert ring.ref is None and ring.capacity == 1 << 16
    finally:
        ring.close()


def _transfer(sender: KVSender, receiver, tokens: list[int], keys, values, block_table):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sender.transfer, "d", tokens, keys, values, block_table, 3)
        got = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
        return got, future.result(timeout=5)


def _assert_landed(receiver, got, keys, values, src_table) -> None:
    table = receiver.reservations.arrived(got.request_id).block_table
    for layer in range(NUM_LAYERS):
        assert torch.equal(receiver.key_caches[layer][table], keys[layer][src_table])
        assert torch.equal(receiver.value_caches[layer][table], values[layer][src_table])


def test_a_sender_with_device_caches_offers_no_shared_cache_and_sends_chunks():
    """Its cache cannot be read through a memfd by a peer, so cache_ref is dropped."""
    receiver = make_receiver("tcp://127.0.0.1:0")
    spec = KVCacheSpec(NUM_LAYERS, 16, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, "float32")
    cache = shared_cache.SharedKVCache(spec)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(4)))
    keys, values = [k for k, _ in cache.layer_caches()], [v for _, v in cache.layer_caches()]
    tokens = list(range(50, 50 + 2 * BLOCK_SIZE + 1))
    _, src = prefill_side(tokens, 16, skip=3)
    sender = KVSender(
        receiver.address, make_fingerprint(), SenderConfig(), cache_ref=cache.ref, platform=SplitPlatform()
    )
    assert sender.cache_ref is None
    got, stats = _transfer(sender, receiver, tokens, keys, values, src.block_table)
    assert not stats.direct and not stats.shm and stats.num_sent_blocks == 3
    _assert_landed(receiver, got, keys, values, src.block_table)
    sender.close()
    receiver.close()


def test_a_receiver_with_device_caches_takes_chunks_where_a_direct_copy_was_offered():
    """The one-copy path writes the receiver's caches through numpy views: host memory only."""
    receiver = make_receiver("tcp://127.0.0.1:0", platform=SplitPlatform())
    spec = KVCacheSpec(NUM_LAYERS, 16, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, "float32")
    cache = shared_cache.SharedKVCache(spec)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(5)))
    keys, values = [k for k, _ in cache.layer_caches()], [v for _, v in cache.layer_caches()]
    tokens = list(range(60, 60 + 3 * BLOCK_SIZE))
    _, src = prefill_side(tokens, 16, skip=2)
    sender = KVSender(receiver.address, make_fingerprint(), SenderConfig(), cache_ref=cache.ref)
    assert sender.cache_ref is not None  # offered
    got, stats = _transfer(sender, receiver, tokens, keys, values, src.block_table)
    assert not stats.direct  # chunks (through the sender's shared ring: host bytes, uploaded)
    _assert_landed(receiver, got, keys, values, src.block_table)
    assert not receiver._copies.stream.queue
    sender.close()
    receiver.close()


@pytest.mark.parametrize("wire", [WireFormat.NATIVE, WireFormat.INT8])
def test_a_transfer_between_device_caches_matches_the_host_transfer(wire):
    """The same request host to host and split to split lands the same bytes (int8: the same
    dequantized values)."""
    tokens = list(range(70, 70 + 3 * BLOCK_SIZE + 2))
    _, src = prefill_side(tokens, 16, skip=1)
    keys, values = make_caches(16, seed=6)
    landed = []
    for platform in (Platform(), SplitPlatform()):
        receiver = make_receiver("tcp://127.0.0.1:0", platform=platform)
        config = SenderConfig(wire_format=wire, max_chunk_bytes=2 * 2 * keys[0][0].numel() * 4)
        sender = KVSender(receiver.address, make_fingerprint(), config, platform=platform)
        got, _ = _transfer(sender, receiver, tokens, keys, values, src.block_table)
        table = receiver.reservations.arrived(got.request_id).block_table
        landed.append([c[table].clone() for c in [*receiver.key_caches, *receiver.value_caches]])
        sender.close()
        receiver.close()
    assert all(torch.equal(a, b) for a, b in zip(*landed, strict=True))
    if wire is WireFormat.NATIVE:
        assert all(
            torch.equal(a, c[src.block_table]) for a, c in zip(landed[1], [*keys, *values], strict=True)
        )


@dataclasses.dataclass(frozen=True)
class _RecordingPlatform(SplitPlatform):
    activated: list[str] = dataclasses.field(default_factory=list)  # names of threads bound to it

    def activate(self) -> None:
        self.activated.append(threading.current_thread().name)


def test_each_shipper_worker_binds_its_own_thread_to_the_device():
    platform = _RecordingPlatform()
    caches = [torch.zeros(4, 4, 1, 8) for _ in range(2)]
    fingerprint = make_fingerprint(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8)
    config = SenderConfig(grant_timeout_s=0.3, shared_memory=False)
    shipper = Shipper(fingerprint, caches, caches, config, platform=platform)
    addr = f"tcp://127.0.0.1:{free_port()}"  # no receiver there: the transfer times out at its grant
    try:
        assert shipper.submit(Shipment(KVShipment("a", (1, 2, 3, 4, 5), (0, 1), 9, 0, {}, {}), addr))
        assert shipper.outcomes.get(timeout=10).error is not None
        assert platform.activated == [f"ship-{addr}"]
    finally:
        shipper.close()
