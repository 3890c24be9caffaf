"""Packing a layer's blocks into a staging slot and landing them in another cache, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import tensors
from kv_transfer.messages import WireFormat
from kv_transfer.staging import StagingRing


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


def test_int8_round_trip_error_is_within_half_a_step():
    x = torch.randn(3, 4, 2, 8)
    q, scale = tensors.quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 4, 2, 1)
    assert ((tensors.dequantize_int8(q, scale, torch.float32) - x).abs() <= scale / 2 + 1e-7).all()


def test_frame_offsets_are_aligned_for_any_dtype():
    offsets, total = tensors.frame_offsets([10, 3, 64])
    assert offsets == [0, 64, 128] and total == 192


def test_staging_ring_reuses_slots_only_after_credits_in_order():
    ring = StagingRing(256, shared=False)
    assert [ring.try_alloc(100), ring.try_alloc(100)] == [0, 100]
    assert ring.try_alloc(100) is None  # 56 left at the end, the front is in flight
    ring.release_oldest()  # slot 0 credited
    assert ring.try_alloc(100) == 0  # wraps to the front
    assert ring.try_alloc(1) is None  # wrapped: only [100, 100) is free until slot 100 is credited
    ring.release_oldest()
    assert ring.try_alloc(56) == 100 and ring.in_flight_bytes == 156
    with pytest.raises(ValueError):
        ring.try_alloc(257)
