"""The one-copy same-host path: the receiver copies blocks straight out of the sender's shared cache."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from kv_transfer_peer import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, make_fingerprint, prefill_side
from test_kv_transfer import make_receiver, poll_until

from pdserve.engine.core.sequence import Sequence
from pdserve.kv_transfer import shared_cache
from pdserve.kv_transfer.messages import CacheRef
from pdserve.kv_transfer.sender import KVSender, SenderConfig
from pdserve.protocol.kv_layout import KVCacheSpec
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)
NUM_BLOCKS = 16


def _shared_cache(seed: int) -> shared_cache.SharedKVCache:
    spec = KVCacheSpec(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, "float32")
    cache = shared_cache.SharedKVCache(spec)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def test_direct_transfer_copies_exact_bytes_and_sends_no_chunks():
    receiver = make_receiver("tcp://127.0.0.1:0")
    squatter = Sequence("squat", [9] * 2 * BLOCK_SIZE, 2 * BLOCK_SIZE, SamplingParams())
    receiver.reservations.block_manager.append(squatter, 2 * BLOCK_SIZE)
    cache = _shared_cache(seed=3)
    tokens = list(range(200, 200 + 3 * BLOCK_SIZE + 2))
    src_bm, src_seq = prefill_side(tokens, NUM_BLOCKS, skip=4)
    keys = [k for k, _ in cache.layer_caches()]
    values = [v for _, v in cache.layer_caches()]
    sender = KVSender(receiver.address, make_fingerprint(), SenderConfig(), cache_ref=cache.ref)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sender.transfer, "d1", tokens, keys, values, src_seq.block_table, 11)
        got = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
        stats = future.result(timeout=5)
    assert stats.direct and not stats.shm
    assert receiver.reservations.arrived(got.request_id).block_table == [
        2,
        3,
        4,
        5,
    ] and src_seq.block_table == [4, 5, 6, 7]
    for layer in range(NUM_LAYERS):
        for src, dst in ((keys, receiver.key_caches), (values, receiver.value_caches)):
            assert torch.equal(
                src[layer][src_seq.block_table],
                dst[layer][receiver.reservations.arrived(got.request_id).block_table],
            )
    receiver.reservations.finish(got.request_id)
    receiver.reservations.block_manager.free(squatter)
    assert receiver.reservations.block_manager.num_free_blocks == NUM_BLOCKS
    sender.close()
    receiver.close()


def test_a_corrupted_source_block_fails_the_checksum_and_frees_the_grant():
    receiver = make_receiver("tcp://127.0.0.1:0")
    cache = _shared_cache(seed=4)
    tokens = list(range(10, 10 + 2 * BLOCK_SIZE))
    _, src_seq = prefill_side(tokens, NUM_BLOCKS)
    keys = [k for k, _ in cache.layer_caches()]
    values = [v for _, v in cache.layer_caches()]
    sender = KVSender(receiver.address, make_fingerprint(), SenderConfig(), cache_ref=cache.ref)

    def corrupt_and_send():
        tx = sender.reserve("bad", tokens)
        assert tx.direct
        ids = list(src_seq.block_table)
        sums = tuple(shared_cache.layer_checksum(keys[i], values[i], ids) for i in range(NUM_LAYERS))
        keys[1][ids[0]].add_(1.0)  # changes after the checksum was taken
        return sender.finish(tx, 5, 0, tuple(ids), sums)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(corrupt_and_send)
        failed = poll_until(receiver, lambda r: bool(r.failed)).failed[0]
        with pytest.raises(Exception, match="checksum"):
            future.result(timeout=5)
    assert "checksum mismatch in layer 1" in str(failed.error)
    assert receiver.reservations.block_manager.num_free_blocks == NUM_BLOCKS
    sender.close()
    receiver.close()


def _poll_until_granted(receiver, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while receiver.num_incoming == 0:
        assert time.monotonic() < deadline, "no grant"
        receiver.poll(0.02)


@pytest.mark.parametrize("changed", [False, True])
def test_a_direct_copy_starts_at_the_grant_and_the_senders_checksums_decide(changed):
    """With its block table in the reserve, the receiver copies while the sender hashes; KVDone's
    checksums still judge what landed: bytes that change after the receiver copied them fail."""
    receiver = make_receiver("tcp://127.0.0.1:0")  # an empty pool: the grant is blocks 0, 1, 2
    cache = _shared_cache(seed=8)
    tokens = list(range(40, 40 + 2 * BLOCK_SIZE + 3))
    _, src_seq = prefill_side(tokens, NUM_BLOCKS, skip=5)
    keys = [k for k, _ in cache.layer_caches()]
    values = [v for _, v in cache.layer_caches()]
    ids = list(src_seq.block_table)
    original = [k[ids].clone() for k in keys]
    sender = KVSender(receiver.address, make_fingerprint(), SenderConfig(), cache_ref=cache.ref)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sender.reserve, "early", tokens, None, None, ids)
        _poll_until_granted(receiver)
        tx = future.result(timeout=5)
        assert tx.direct
        for layer in range(NUM_LAYERS):  # landed before KVDone
            assert torch.equal(receiver.key_caches[layer][: len(ids)], original[layer])
        if changed:
            keys[2][ids[1]].mul_(-1.0)  # after the receiver copied it, before the sender hashes
        sums = tuple(shared_cache.layer_checksum(keys[i], values[i], ids) for i in range(NUM_LAYERS))
        future = pool.submit(sender.finish, tx, 5, 0, tuple(ids), sums)
        events = poll_until(receiver, lambda r: bool(r.completed or r.failed))
        if changed:
            assert "checksum mismatch in layer 2" in str(events.failed[0].error)
            with pytest.raises(Exception, match="checksum"):
                future.result(timeout=5)
            assert receiver.reservations.block_manager.num_free_blocks == NUM_BLOCKS
        else:
            assert events.completed[0].request_id == "early" and future.result(timeout=5).direct
    sender.close()
    receiver.close()


@pytest.mark.usefixtures("processes")
def test_a_cache_ref_that_cannot_be_opened_falls_back_to_chunks():
    receiver = make_receiver("tcp://127.0.0.1:0")
    tokens = list(range(10, 10 + BLOCK_SIZE + 1))
    _, src_seq = prefill_side(tokens, NUM_BLOCKS)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    bogus = CacheRef(pid=int(dead.stdout), fd=3, num_blocks=NUM_BLOCKS)  # that process is gone
    from kv_transfer_peer import make_caches

    keys, values = make_caches(NUM_BLOCKS, seed=5)
    sender = KVSender(receiver.address, make_fingerprint(), SenderConfig(), cache_ref=bogus)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sender.transfer, "fb", tokens, keys, values, src_seq.block_table, 1)
        got = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
        stats = future.result(timeout=5)
    assert not stats.direct
    assert torch.equal(
        keys[0][src_seq.block_table],
        receiver.key_caches[0][receiver.reservations.arrived(got.request_id).block_table],
    )
    sender.close()
    receiver.close()


@pytest.mark.usefixtures("processes")
def test_the_cache_is_readable_from_another_process():
    cache = _shared_cache(seed=6)
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, "tests")
        from kv_transfer_peer import make_fingerprint
        from pdserve.kv_transfer import shared_cache
        from pdserve.kv_transfer.messages import CacheRef
        view = shared_cache.attach(CacheRef(pid={cache.ref.pid}, fd={cache.ref.fd}, num_blocks={NUM_BLOCKS}), make_fingerprint())
        print(float(view[1, 0, 3].sum()), float(view[2, 1, 7, 1].sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    expected = f"{float(cache.tensor[1, 0, 3].sum())} {float(cache.tensor[2, 1, 7, 1].sum())}"
    assert out.stdout.strip() == expected


def test_runs_split_ids_into_consecutive_stretches():
    assert shared_cache.runs([4, 5, 6, 9, 10, 3]) == [(4, 3), (9, 2), (3, 1)]
    assert shared_cache.paired_runs([1, 2, 3, 7], [5, 6, 9, 10]) == [(1, 5, 2), (3, 9, 1), (7, 10, 1)]


def test_layer_checksum_depends_on_the_bytes_not_on_where_the_blocks_sit():
    k, v = torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    src, dst = [1, 2, 3, 6], [7, 0, 4, 5]
    k2[dst], v2[dst] = k[src], v[src]
    assert shared_cache.layer_checksum(k, v, src) == shared_cache.layer_checksum(k2, v2, dst)
    v2[5, 0, 0, 0] += 1
    assert shared_cache.layer_checksum(k, v, src) != shared_cache.layer_checksum(k2, v2, dst)


@pytest.mark.parametrize(
    ("native", "tile_bytes"),
    [(True, 0), (False, 1), (False, 3 * 4 * 2 * 8 * 4), (False, 1 << 20)],  # torch path: a block, 3, all
)
def test_copy_direct_lands_the_bytes_and_checks_them_tile_by_tile(monkeypatch, native, tile_bytes):
    from pdserve.kernels import cpu_ext
    from pdserve.kv_transfer import peer_memory

    fused_calls = []
    if native:  # the C++ copy-and-hash: counted, so that the test knows it ran
        real = cpu_ext.copy_blocks_xxh3
        monkeypatch.setattr(cpu_ext, "copy_blocks_xxh3", lambda *a: fused_calls.append(1) or real(*a))
    else:
        monkeypatch.setenv("PDSERVE_NATIVE_CPU", "0")
        monkeypatch.setattr(peer_memory, "TILE_BYTES", tile_bytes)
    gen = torch.Generator().manual_seed(7)
    src = torch.randn(3, 2, 12, 4, 2, 8, generator=gen)  # [L, 2, NB, bs, kvh, d]
    src_ids = [1, 2, 3, 4, 5, 9, 10, 0]  # runs of 5, 2 and 1 blocks
    dst_ids = [6, 7, 8, 9, 10, 2, 3, 0]  # paired differently: runs of 5, 2, 1
    sums = tuple(shared_cache.layer_checksum(src[i, 0], src[i, 1], src_ids) for i in range(3))
    keys = [torch.zeros(11, 4, 2, 8) for _ in range(3)]
    values = [torch.zeros(11, 4, 2, 8) for _ in range(3)]
    ids = torch.tensor(dst_ids)
    landed = peer_memory.copy_direct(src, src_ids, keys, values, ids)
    assert peer_memory.checksum_problem(landed, sums) is None
    for layer in range(3):
        assert torch.equal(keys[layer][dst_ids], src[layer, 0][src_ids])
        assert torch.equal(values[layer][dst_ids], src[layer, 1][src_ids])
    src[2, 1, 10, 3, 1, 7] += 1.0  # the sender's bytes changed after it hashed them
    landed = peer_memory.copy_direct(src, src_ids, keys, values, ids)
    assert peer_memory.checksum_problem(landed, sums) == "checksum mismatch in layer 2 (direct)"
    assert peer_memory.checksum_problem(landed, sums[:2]) == "direct transfer without a checksum per layer"
    assert "source blocks" in peer_memory.copy_direct(src, [*src_ids[:-1], 12], keys, values, ids)
    assert len(fused_calls) == (6 if native else 0)  # a call a layer, two copies


def test_a_new_ring_on_a_reused_descriptor_is_mapped_afresh():
    """A sender that closes its staging ring and makes another often gets the same descriptor
    number back: the receiver must map the new ring, not read the old one's pages."""
    from pdserve.kv_transfer import staging
    from pdserve.kv_transfer.messages import KVReserve
    from pdserve.kv_transfer.peer_memory import PeerMemory

    peer = PeerMemory(make_fingerprint(), enabled=True)

    def reserve(ring):
        return KVReserve(
            request_id="r",
            token_ids=(1,),
            block_hashes=(),
            fingerprint=make_fingerprint(),
            ttl_s=5.0,
            ring_ref=ring.ref,
            host_id=peer.host_id,
        )

    old = staging.StagingRing(1 << 16, shared=True)
    old.buffer[:4] = torch.tensor([1, 1, 1, 1], dtype=torch.uint8)
    assert bytes(peer.map_ring(reserve(old))[:4]) == b"\x01\x01\x01\x01"
    old_fd = old.ref.fd
    old.close()
    new = staging.StagingRing(1 << 16, shared=True)
    try:
        assert new.ref.fd == old_fd  # the case that went wrong: same pid, fd and size
        new.buffer[:4] = torch.tensor([2, 2, 2, 2], dtype=torch.uint8)
        assert bytes(peer.map_ring(reserve(new))[:4]) == b"\x02\x02\x02\x02"
    finally:
        new.close()
        peer.close()
