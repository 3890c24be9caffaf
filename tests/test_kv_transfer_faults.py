"""Faults: corrupt and malformed input, silent and killed peers. The receiver frees and keeps serving."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_transfer_peer import BLOCK_SIZE, make_caches, make_fingerprint, prefill_side
from test_kv_transfer import NUM_BLOCKS, make_receiver, poll_until

from pdserve.kv_transfer import tensors
from pdserve.kv_transfer.errors import KVAborted, KVTimeout
from pdserve.kv_transfer.messages import Abort, Error, KVChunk, KVGrant, KVReserve, WireFormat, decode
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.sender import KVSender, SenderConfig
from pdserve.protocol.block_hash import hash_full_blocks
from pdserve.protocol.channel import PeerChannel

pytestmark = pytest.mark.timeout(40)
PEER_SCRIPT = Path(__file__).with_name("kv_transfer_peer.py")
ROOT = PEER_SCRIPT.parent.parent


def raw_grant(receiver: KVReceiver, peer: PeerChannel, request_id: str, tokens: list[int]) -> KVGrant:
    """Reserve by hand and poll the receiver until the grant comes back."""
    hashes = tuple(hash_full_blocks(tokens, BLOCK_SIZE))
    peer.send(
        KVReserve(
            request_id=request_id,
            token_ids=tuple(tokens),
            block_hashes=hashes,
            fingerprint=make_fingerprint(),
            ttl_s=5.0,
        )
    )
    receiver.poll(0.2)
    grant = peer.recv(2.0)
    assert grant is not None and isinstance(grant.msg, KVGrant)
    return grant.msg


def serve_one_transfer(receiver: KVReceiver, request_id: str) -> None:
    """A well-behaved transfer completes (the node is still serving)."""
    tokens = list(range(1, 2 * BLOCK_SIZE + 1))
    _, src = prefill_side(tokens, NUM_BLOCKS)
    keys, values = make_caches(NUM_BLOCKS, seed=9)
    sender = KVSender(receiver.address, make_fingerprint())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sender.transfer, request_id, tokens, keys, values, src.block_table, 1)
        got = poll_until(receiver, lambda r: bool(r.completed)).completed[0]
        future.result(timeout=5)
    receiver.reservations.finish(got.request_id)
    sender.close()


def assert_all_blocks_free(receiver: KVReceiver) -> None:
    receiver.reservations.block_manager.check_integrity([])
    assert (
        receiver.reservations.block_manager.num_free_blocks == receiver.reservations.block_manager.num_blocks
    )
    assert receiver.num_incoming == receiver.num_queued == 0


def test_corrupted_frame_fails_the_request_and_the_node_keeps_serving():
    receiver = make_receiver("tcp://127.0.0.1:0")
    peer = PeerChannel(receiver.address, decoder=decode)
    tokens = list(range(1, BLOCK_SIZE + 1))
    raw_grant(receiver, peer, "bad", tokens)
    keys, values = make_caches(NUM_BLOCKS, seed=5)
    src_ids = torch.tensor([3])  # any sender block; the receiver maps chunk positions to its grant
    slot = torch.empty(1 << 16, dtype=torch.uint8)
    packed = tensors.pack_layer(keys[0], values[0], src_ids, WireFormat.NATIVE, slot)
    frames = [tensors.as_frame(t) for t in packed]
    sums = [tensors.checksum(f) for f in frames]
    peer.send(
        KVChunk(request_id="bad", layer=0, block_start=0, num_blocks=1, checksums=(sums[0], sums[1] ^ 1)),
        frames,
    )

    got = poll_until(receiver, lambda r: bool(r.failed))
    assert isinstance(got.failed[0].error, KVAborted) and "checksum" in got.failed[0].error.reason
    assert_all_blocks_free(receiver)
    replies = [peer.recv(1.0) for _ in range(3)]  # grant already read: credit, then abort
    assert any(r is not None and isinstance(r.msg, Abort) for r in replies)
    serve_one_transfer(receiver, "next")
    assert_all_blocks_free(receiver)
    peer.close()
    receiver.close()


def test_silent_sender_loses_its_blocks_at_the_chunk_deadline():
    receiver = make_receiver("tcp://127.0.0.1:0", chunk_timeout_s=0.3)
    peer = PeerChannel(receiver.address, decoder=decode)
    raw_grant(receiver, peer, "quiet", list(range(1, 3 * BLOCK_SIZE)))
    assert receiver.reservations.block_manager.num_free_blocks == NUM_BLOCKS - 3
    started = time.monotonic()
    got = poll_until(receiver, lambda r: bool(r.failed))
    assert isinstance(got.failed[0].error, KVTimeout) and time.monotonic() - started < 1.0
    assert_all_blocks_free(receiver)
    peer.close()
    receiver.close()


def test_oversized_frame_is_refused_and_the_node_keeps_serving():
    receiver = make_receiver("tcp://127.0.0.1:0", max_frame_bytes=4096, chunk_timeout_s=0.3)
    peer = PeerChannel(receiver.address, decoder=decode)
    raw_grant(receiver, peer, "huge", list(range(1, BLOCK_SIZE + 1)))
    peer.send(
        KVChunk(request_id="huge", layer=0, block_start=0, num_blocks=1, checksums=(0, 0)),
        [b"x" * 5000, b"y"],
    )
    got = poll_until(receiver, lambda r: bool(r.failed))  # its grant runs out: nothing else came
    assert got.failed[0].request_id == "huge"
    assert_all_blocks_free(receiver)
    serve_one_transfer(receiver, "next")
    peer.close()
    receiver.close()


def test_malformed_messages_get_an_error_reply_and_the_node_keeps_serving():
    folder = tempfile.mkdtemp(prefix="kvt")
    receiver = make_receiver(f"ipc://{folder}/kv.sock")
    peer = PeerChannel(receiver.address, decoder=decode)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    def send_garbage(parts: list[bytes]) -> None:
        peer.send_raw(parts)
        receiver.poll(0.02)
        reply = peer.recv(1.0)
        assert reply is not None and isinstance(reply.msg, Error)

    send_garbage()
    assert_all_blocks_free(receiver)
    serve_one_transfer(receiver, "after-garbage")
    peer.close()
    receiver.close()
    shutil.rmtree(folder, ignore_errors=True)


def _spawn_peer(mode: str, address: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(PEER_SCRIPT), mode, address]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


@pytest.mark.usefixtures("processes")
def test_receiver_frees_granted_blocks_when_the_sender_is_killed_mid_transfer():
    receiver = make_receiver("tcp://127.0.0.1:0", chunk_timeout_s=1.0)
    proc = _spawn_peer("send-half", receiver.address)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            line = pool.submit(proc.stdout.readline)
            poll_until(receiver, lambda r: line.done(), timeout_s=30)
        assert line.result() == "SENT_HALF\n" and receiver.num_incoming == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        killed_at = time.monotonic()
        got = poll_until(receiver, lambda r: bool(r.failed))
        assert isinstance(got.failed[0].error, KVTimeout) and time.monotonic() - killed_at < 1.5
        assert_all_blocks_free(receiver)
    finally:
        proc.kill()
        receiver.close()


@pytest.mark.usefixtures("processes")
def test_sender_reports_a_timeout_and_frees_its_blocks_when_the_receiver_is_killed():
    proc = _spawn_peer("receive", "tcp://127.0.0.1:0")
    try:
        address = proc.stdout.readline().strip()  # the receiver prints its bound address
        tokens = list(range(1, 3 * BLOCK_SIZE + 1))
        src_bm, src = prefill_side(tokens, NUM_BLOCKS)
        keys, values = make_caches(NUM_BLOCKS, seed=6)
        sender = KVSender(address, make_fingerprint(), SenderConfig(reply_timeout_s=0.5))
        tx = sender.reserve("orphan", tokens)
        sender.send_layer(tx, 0, keys[0], values[0], src.block_table)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        started = time.monotonic()
        with pytest.raises(KVTimeout):
            for layer in range(1, len(keys)):
                sender.send_layer(tx, layer, keys[layer], values[layer], src.block_table)
            sender.finish(tx, first_token=1)
        assert time.monotonic() - started < 2.0
        src_bm.free(src)  # the prefill node's side, on the error
        src_bm.check_integrity([])
        assert src_bm.num_free_blocks == NUM_BLOCKS
        sender.close()
    finally:
        proc.kill()
