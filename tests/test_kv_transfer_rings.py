"""Staging rings: shared memory only for a peer on this machine, as a memfd (never in /dev/shm, whose
64 MB in a default container made a second ring crash the prefill node), and the socket path with a
log line when shared memory cannot be had."""

from __future__ import annotations

import concurrent.futures
import logging
import os

import pytest

from pdserve.kv_transfer import memfd, staging
from pdserve.kv_transfer.sender import KVSender, SenderConfig
from tests.test_kv_transfer import make_caches, make_fingerprint, make_receiver, poll_until, prefill_side


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _transfer(sender: KVSender, receiver, request_id: str):
    tokens = list(range(1, 40))
    _, seq = prefill_side(tokens, 16)
    keys, values = make_caches(16, seed=3)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sender.transfer, request_id, tokens, keys, values, seq.block_table, 7)
        got = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
        stats = future.result(timeout=10)
    receiver.reservations.finish(got.request_id)
    return stats


@pytest.mark.parametrize(
    "address, local",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://localhost:5555", True),
        ("ipc:///tmp/x.sock", True),
        ("tcp://192.0.2.7:5555", False),  # TEST-NET-1: an address of no interface here (nothing is sent)
        ("tcp://no-such-host.invalid:5555", False),
    ],
)
def test_peer_is_local_only_for_addresses_of_this_machine(address, local):
    assert staging.peer_is_local(address) is local


def test_rings_for_several_local_peers_are_memfds_outside_dev_shm():
    before = _dev_shm()
    receivers = [make_receiver("tcp://127.0.0.1:0") for _ in range(3)]
    senders = [
        KVSender(r.address, make_fingerprint(), SenderConfig(staging_bytes=1 << 20)) for r in receivers
    ]
    try:
        for sender in senders:
            ref = sender._ring.ref
            assert ref is not None and os.readlink(f"/proc/self/fd/{ref.fd}").startswith(
                "/memfd:pdserve-kv-ring"
            )
        assert _dev_shm() == before
        stats = [_transfer(s, r, f"r{i}") for i, (s, r) in enumerate(zip(senders, receivers, strict=True))]
        assert all(s.shm for s in stats)  # the receivers mapped the rings
    finally:
        for endpoint in [*senders, *receivers]:
            endpoint.close()


def test_no_shared_memory_falls_back_to_the_socket_with_a_log_line(monkeypatch, caplog):
    def no_memory(name: str, num_bytes: int):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(memfd, "create", no_memory)  # the fault a full tmpfs or cgroup would cause
    receiver = make_receiver("tcp://127.0.0.1:0")
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.staging"):
        sender = KVSender(receiver.address, make_fingerprint(), SenderConfig(staging_bytes=1 << 20))
    try:
        assert sender._ring.ref is None
        assert "staging ring in private memory" in caplog.text
        stats = _transfer(sender, receiver, "r1")
        assert not stats.shm and stats.bytes_sent > 0
    finally:
        sender.close()
        receiver.close()


def test_ring_bytes_that_change_after_the_check_never_land(monkeypatch):
    """A sender that rewrites a slot between the receiver's checksum and its copy (a reset ring
    reused by the next request) must not get unchecked bytes into the receiver's cache."""
    import pdserve.kv_transfer.receiver as receiver_module

    receiver = make_receiver("tcp://127.0.0.1:0")
    sender = KVSender(receiver.address, make_fingerprint(), SenderConfig(staging_bytes=1 << 20))
    check = receiver_module.chunk_problem

    def check_then_scribble(msg, frames, *args):
        problem = check(msg, frames, *args)
        size = sum(len(f) for f in frames)
        sender._ring.buffer[msg.shm_offset : msg.shm_offset + size].fill_(
            0x5A
        )  # after the check, before the copy
        return problem

    monkeypatch.setattr(receiver_module, "chunk_problem", check_then_scribble)
    tokens = list(range(1, 40))
    _, seq = prefill_side(tokens, 16)
    keys, values = make_caches(16, seed=4)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(sender.transfer, "r1", tokens, keys, values, seq.block_table, 7)
            got = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
            assert future.result(timeout=10).shm
        for src, dst in ((keys, receiver.key_caches), (values, receiver.value_caches)):
            for layer in range(len(src)):
                assert src[layer][seq.block_table].equal(
                    dst[layer][receiver.reservations.arrived(got.request_id).block_table]
                )
    finally:
        sender.close()
        receiver.close()
