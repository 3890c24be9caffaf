"""Packing a layer's blocks into a staging slot and landing them in another cache, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer import tensors
from pdserve.kv_transfer.messages import WireFormat
from pdserve.kv_transfer.staging import StagingRing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "src_ids,dst_ids", [([2, 3, 4], [5, 6, 7]), ([7, 1, 4], [0, 6, 3])], ids=["runs", "scattered"]
)
def test_pack_then_unpack_copies_exactly_the_listed_blocks(dtype, src_ids, dst_ids):
    gen = torch.Generator().manual_seed(0)
    shape = (8, 4, 2, 8)  # [num_blocks, block_size, kv_heads, head_dim]
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    dst_k, dst_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slot = torch.zeros(1 << 12, dtype=torch.uint8)
    frames = tensors.pack_layer(k, v, torch.tensor(src_ids), WireFormat.NATIVE, slot)
    tensors.unpack_layer(
        [tensors.as_frame(f) for f in frames], dst_k, dst_v, torch.tensor(dst_ids), WireFormat.NATIVE
    )
    assert torch.equal(dst_k[dst_ids], k[src_ids]) and torch.equal(dst_v[dst_ids], v[src_ids])
    untouched = [i for i in range(8) if i not in dst_ids]
    assert not dst_k[untouched].any() and not dst_v[untouched].any()


def test_int8_frames_round_trip_within_half_a_step_per_block_and_head():
    k, v = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)
    ids = torch.tensor([4, 1, 2])
    sizes = tensors.frame_sizes((4, 2, 8), torch.float32, 3, WireFormat.INT8)
    assert sizes == [3 * 4 * 2 * 8, 3 * 2 * 4, 3 * 4 * 2 * 8, 3 * 2 * 4]
    slot = torch.empty(tensors.frame_offsets(sizes)[1], dtype=torch.uint8)
    frames = tensors.pack_layer(k, v, ids, WireFormat.INT8, slot)
    dst_k, dst_v = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    dst = torch.tensor([0, 3, 5])
    tensors.unpack_layer([tensors.as_frame(f) for f in frames], dst_k, dst_v, dst, WireFormat.INT8)
    for src, out in ((k, dst_k), (v, dst_v)):
        step = src[ids].abs().amax(dim=(1, 3), keepdim=True) / 127
        assert ((out[dst] - src[ids]).abs() <= step / 2 + 1e-6).all()


def test_frame_offsets_are_aligned_for_any_dtype():
    offsets, total = tensors.frame_offsets([10, 3, 64])
    assert offsets == [0, 64, 128] and total == 192


def test_staging_ring_reuses_slots_only_after_credits_in_order():
    ring = StagingRing(256, shared=False)
    assert [ring.try_alloc(100, "r"), ring.try_alloc(100, "r")] == [0, 100]
    assert ring.try_alloc(100, "r") is None  # 56 left at the end, the front is in flight
    assert ring.release_oldest("r")  # slot 0 credited
    assert ring.try_alloc(100, "r") == 0  # wraps to the front
    assert ring.try_alloc(1, "r") is None  # wrapped: only [100, 100) is free until slot 100 is credited
    assert ring.release_oldest("r")
    assert ring.try_alloc(56, "r") == 100 and ring.in_flight_bytes == 156
    with pytest.raises(ValueError):
        ring.try_alloc(257, "r")


def test_late_credits_of_an_abandoned_request_free_no_slot_of_the_next():
    ring = StagingRing(256, shared=False)
    ring.try_alloc(100, "old")
    ring.try_alloc(100, "old")
    ring.reset()  # the peer stopped answering: "old"'s slots are forgotten
    assert ring.try_alloc(200, "new") == 0
    assert not ring.release_oldest("old") and not ring.release_oldest("old")  # its credits, late
    assert ring.in_flight_bytes == 200 and ring.try_alloc(100, "new") is None  # "new"'s slot still held
    assert ring.release_oldest("new") and ring.in_flight_bytes == 0
