"""kv_transfer.tensors.HeadSplitCache: a tensor-parallel node's ranks' caches seen as the model's
KV heads in order. Packing from any layout gives the bytes a single-rank cache gives (the wire
carries the model's heads whatever either side's layout), and landing them into any layout puts
exactly each rank's heads in its cache, replicas included: every (heads, prefill tp, decode tp)
of the plan's table, native and int8 wire, runs and scattered block ids."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.engine.executor.platform import SplitPlatform
from pdserve.kv_transfer import tensors
from pdserve.kv_transfer.messages import WireFormat
from pdserve.protocol.kv_layout import kv_heads_of

NUM_BLOCKS, BLOCK_SIZE, ROW = 12, 4, 8
LAYOUTS = [
    (h, p, d)
    for h, p, d in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4))
    if all(h % t == 0 or t % h == 0 for t in (p, d))
]


def _split(full: torch.Tensor, tp: int):
    """``full`` [blocks, bs, h, row] as a tp-rank node holds it (tp=1: the tensor itself)."""
    h = full.shape[2]
    if tp == 1:
        return full
    heads = [kv_heads_of(h, tp, r) for r in range(tp)]
    return tensors.HeadSplitCache([full[:, :, r.start : r.stop].clone() for r in heads], heads)


def _pack(k, v, ids: torch.Tensor, wire: WireFormat) -> list[bytes]:
    sizes = tensors.frame_sizes(tuple(k.shape[1:]), k.dtype, len(ids), wire)
    slot = torch.zeros(tensors.frame_offsets(sizes)[1], dtype=torch.uint8)
    return [bytes(f.numpy()) for f in tensors.pack_layer(k, v, ids, wire, slot)]


@pytest.mark.parametrize("wire", [WireFormat.NATIVE, WireFormat.INT8])
@pytest.mark.parametrize(("h", "p", "d"), LAYOUTS)
def test_any_layout_sends_the_single_rank_bytes_and_lands_each_ranks_heads(h, p, d, wire):
    g = torch.Generator().manual_seed(h * 100 + p * 10 + d)
    k_full = torch.randn(NUM_BLOCKS, BLOCK_SIZE, h, ROW, generator=g)
    v_full = torch.randn(NUM_BLOCKS, BLOCK_SIZE, h, ROW, generator=g)
    for ids in (torch.tensor([3, 4, 5]), torch.tensor([7, 1, 10, 2])):  # a run; scattered
        want = _pack(k_full, v_full, ids, wire)
        got = _pack(_split(k_full, p), _split(v_full, p), ids, wire)
        assert got == want  # the same bytes on the wire, so the same checksums
        k_dst = _split(torch.zeros_like(k_full), d)
        v_dst = _split(torch.zeros_like(v_full), d)
        dst_ids = torch.tensor([9, 0, 6, 11][: len(ids)])
        tensors.unpack_layer([memoryview(f) for f in got], k_dst, v_dst, dst_ids, wire)
        plain_k, plain_v = torch.zeros_like(k_full), torch.zeros_like(v_full)
        tensors.unpack_layer([memoryview(f) for f in want], plain_k, plain_v, dst_ids, wire)
        for dst, plain in ((k_dst, plain_k), (v_dst, plain_v)):
            if d == 1:
                assert torch.equal(dst, plain)
                continue
            for rank, (pool, heads) in enumerate(zip(dst.pools, dst.heads, strict=True)):
                assert heads == kv_heads_of(h, d, rank)
                assert torch.equal(pool, plain[:, :, heads.start : heads.stop]), (rank, heads)


def test_a_replicated_head_is_read_from_one_rank_only():
    heads = [kv_heads_of(1, 2, r) for r in range(2)]  # one KV head on both of two ranks
    pools = [torch.ones(2, BLOCK_SIZE, 1, ROW), torch.full((2, BLOCK_SIZE, 1, ROW), 7.0)]
    cache = tensors.HeadSplitCache(pools, heads)
    assert cache.shape == (2, BLOCK_SIZE, 1, ROW)
    assert torch.equal(cache.gather(slice(0, 2), None), pools[0])  # rank 0's copy, never both


def test_a_head_split_cache_on_a_device_platform_is_refused_not_read_or_written():
    """The split platform stands in for a GPU: its copies say the caches are device memory, while
    a HeadSplitCache holds the host memfds rank 0 maps. Packing would send, and landing would
    fill, host bytes the ranks never compute with; both refuse, and nothing lands."""
    k, v = (_split(torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, ROW), 2) for _ in range(2))
    copies = tensors.DeviceCopies(SplitPlatform())
    ids = torch.tensor([3, 4])
    sizes = tensors.frame_sizes(tuple(k.shape[1:]), k.dtype, len(ids), WireFormat.NATIVE)
    slot = torch.zeros(tensors.frame_offsets(sizes)[1], dtype=torch.uint8)
    with pytest.raises(tensors.DevicePoolsNotViewable, match="host memory"):
        tensors.pack_layer(k, v, ids, WireFormat.NATIVE, slot, copies)
    frames = [memoryview(bytes(n)) for n in sizes]
    dst_k, dst_v = (_split(torch.ones(NUM_BLOCKS, BLOCK_SIZE, 2, ROW), 2) for _ in range(2))
    with pytest.raises(tensors.DevicePoolsNotViewable, match="host memory"):
        tensors.unpack_layer(frames, dst_k, dst_v, ids, WireFormat.NATIVE, copies)
    assert all(bool((pool == 1).all()) for pool in (*dst_k.pools, *dst_v.pools))


def test_a_head_split_cache_over_device_tensors_cannot_be_made():
    pools = [torch.zeros(2, BLOCK_SIZE, 1, ROW, device="meta") for _ in range(2)]
    with pytest.raises(tensors.DevicePoolsNotViewable, match="host pools only"):
        tensors.HeadSplitCache(pools, [range(0, 1), range(1, 2)])
