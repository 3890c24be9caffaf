"""The C++ copy-and-checksum of KV blocks (kernels/csrc/kv_copy_cpu.cpp) against xxhash and torch."""

from __future__ import annotations

import pytest
import torch
import xxhash

from pdserve.kernels import cpu_ext


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ext.load() is not None, "the extension could not be built: is a C++ compiler installed?"


def _stream_digest(k: torch.Tensor, v: torch.Tensor, ids: list[int]) -> int:
    data = b"".join(k[i].numpy().tobytes() for i in ids) + b"".join(v[i].numpy().tobytes() for i in ids)
    return xxhash.xxh3_64(data).intdigest()


# Block sizes: one stripe; the stream just past XXH3's 240-byte short path; XXH3 blocks (1 KB)
# that straddle cache blocks; a stream of exactly 16 stripes (no scramble); the default model's
# 12 KB blocks; a cache block of one XXH3 block.
@pytest.mark.parametrize(
    ("block_bytes", "num_blocks", "count"),
    [(64, 10, 2), (128, 3, 1), (192, 40, 17), (512, 4, 1), (12288, 64, 37), (1024, 9, 9)],
)
def test_copy_lands_the_blocks_and_returns_xxhash_digest(block_bytes, num_blocks, count):
    gen = torch.Generator().manual_seed(block_bytes + count)
    k = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8, generator=gen)
    v = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8, generator=gen)
    src = torch.randperm(num_blocks, generator=gen)[:count]
    dst = torch.randperm(num_blocks + 5, generator=gen)[:count]
    dk, dv = (
        torch.zeros(num_blocks + 5, block_bytes, dtype=torch.uint8),
        torch.zeros(num_blocks + 5, block_bytes, dtype=torch.uint8),
    )
    want = _stream_digest(k, v, src.tolist())
    assert cpu_ext.copy_blocks_xxh3(k, v, dk, dv, src, dst) == want
    assert torch.equal(dk[dst], k[src]) and torch.equal(dv[dst], v[src])
    untouched = torch.ones(num_blocks + 5, dtype=torch.bool)
    untouched[dst] = False
    assert not dk[untouched].any() and not dv[untouched].any()
    assert cpu_ext.copy_blocks_xxh3(k, v, None, None, src, None) == want  # checksum only


def test_a_destination_off_64_byte_alignment_is_copied_with_plain_stores():
    gen = torch.Generator().manual_seed(3)
    k = torch.randint(0, 256, (6, 256), dtype=torch.uint8, generator=gen)
    v = torch.randint(0, 256, (6, 256), dtype=torch.uint8, generator=gen)
    buf = torch.zeros(16 + 6 * 256 * 2, dtype=torch.uint8)
    dk, dv = buf[16 : 16 + 6 * 256].view(6, 256), buf[16 + 6 * 256 :].view(6, 256)
    assert dk.data_ptr() % 64 != 0
    ids = torch.tensor([5, 0, 3])
    assert cpu_ext.copy_blocks_xxh3(k, v, dk, dv, ids, ids) == _stream_digest(k, v, ids.tolist())
    assert torch.equal(dk[ids], k[ids]) and torch.equal(dv[ids], v[ids])


def test_a_changed_byte_or_block_order_changes_the_digest():
    gen = torch.Generator().manual_seed(4)
    k = torch.randint(0, 256, (4, 256), dtype=torch.uint8, generator=gen)
    v = torch.randint(0, 256, (4, 256), dtype=torch.uint8, generator=gen)
    base = cpu_ext.copy_blocks_xxh3(k, v, None, None, torch.tensor([0, 1, 2]), None)
    assert cpu_ext.copy_blocks_xxh3(k, v, None, None, torch.tensor([1, 0, 2]), None) != base
    v[2, 255] ^= 1
    assert cpu_ext.copy_blocks_xxh3(k, v, None, None, torch.tensor([0, 1, 2]), None) != base


def test_bad_input_is_a_clear_error():
    k = v = torch.zeros(4, 128, dtype=torch.uint8)
    ids = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ext.copy_blocks_xxh3(k, v, None, None, torch.tensor([0, 4]), None)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ext.copy_blocks_xxh3(k, v, k.clone(), v.clone(), ids, torch.tensor([0, -1]))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        odd = torch.zeros(4, 96, dtype=torch.uint8)
        cpu_ext.copy_blocks_xxh3(odd, odd, None, None, ids, None)
    with pytest.raises(RuntimeError, match="over 240 bytes"):
        one_stripe = torch.zeros(4, 64, dtype=torch.uint8)
        cpu_ext.copy_blocks_xxh3(one_stripe, one_stripe, None, None, torch.tensor([0]), None)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_ext.copy_blocks_xxh3(k.float(), v.float(), None, None, ids, None)
    assert (
        not cpu_ext.xxh3_streams(96, 10) and not cpu_ext.xxh3_streams(64, 1) and cpu_ext.xxh3_streams(64, 2)
    )
