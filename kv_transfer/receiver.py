"""Decode side of a KV transfer: blocks granted by the engine, chunks landed in them, hand-over.

The decode node drives it from its loop: ``poll(timeout_s)`` handles messages and deadlines and
returns the requests whose KV landed (the engine then moves them to RUNNING) and those that
failed. Which blocks a request gets, and whether it may have any, is the engine's decision
(``BlockReservations``: the same admission rules as local requests). Per reservation:

    KVReserve ─► checks (fingerprint, hashes, fits at all?) ─► KVReject
                 └─► engine.reserve?  blocks ─► KVGrant
                                      not now ─► FIFO queue (≤ max_waiting) ─► KVWait … grant or KVReject at ttl
    KVChunk   ─► sizes + xxh3 checked ─► index_copy_ into the granted blocks ─► KVCredit
                 (device caches: upload, scatter on the copy stream, its event waited on)
    KVDone    ─► all (layer, block) pieces landed? ─► KVAck, report completed

A granted request that stays silent for ``chunk_timeout_s``, fails a check, or is aborted frees
its blocks at once and is reported failed; the node keeps serving every other request.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
import zmq

from kv_transfer import tensors
from kv_transfer.checks import chunk_problem, reserve_problem, ring_frames
from kv_transfer.errors import KVAborted, KVTimeout, KVTransferError
from kv_transfer.messages import (
    Abort,
    Error,
    KVAck,
    KVChunk,
    KVCredit,
    KVDone,
    KVFingerprint,
    KVGrant,
    KVReject,
    KVReserve,
    KVWait,
    Message,
    ProtocolError,
    decode,
)
from kv_transfer.outcomes import PollResult, ReceivedKV, TransferFailure
from kv_transfer.peer_memory import DirectCopy, PeerMemory
from kv_transfer.reservations import BlockReservations
from protocol.channel import Inbound, ListenChannel, PeerUnavailable


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiverConfig:
    window_bytes: int = 64 << 20  # unconsumed chunk bytes a peer may have in flight
    chunk_timeout_s: float = 5.0  # longest silence of a granted request's sender
    max_ttl_s: float = 60.0  # cap on how long a queued reservation may wait
    max_waiting: int = 64  # queued reservations; beyond this, KVReject
    max_frame_bytes: int = 256 << 20  # larger data frames are refused
    shared_memory: bool = True  # map a same-host sender's staging ring instead of taking frames

    def __post_init__(self) -> None:
        if min(self.window_bytes, self.chunk_timeout_s, self.max_ttl_s, self.max_frame_bytes) <= 0:
            raise ValueError("ReceiverConfig sizes and timeouts must be positive")
        if self.max_waiting < 0:
            raise ValueError("ReceiverConfig.max_waiting must be >= 0")


@dataclasses.dataclass(slots=True)
class _Incoming:
    """A granted request whose KV is arriving."""

    peer: bytes
    reserve: KVReserve
    num_held_blocks: int
    block_ids: torch.Tensor  # [num_send_blocks] receiver block ids, in prompt order
    landed: bytearray  # [num_layers * num_send_blocks], 1 where that layer of that block landed
    deadline: float  # time.monotonic() by which the next message must come
    ring: memoryview | None  # the sender's shared staging ring, when chunks come through it
    direct: DirectCopy | None = None  # the one-copy path: the sender's cache is mapped here
    bytes_received: int = 0


@dataclasses.dataclass(slots=True)
class _Queued:
    peer: bytes
    reserve: KVReserve
    expires_at: float


class KVReceiver:
    def __init__(
        self,
        address: str,
        fingerprint: KVFingerprint,
        reservations: BlockReservations,
        key_caches: Sequence[torch.Tensor],
        value_caches: Sequence[torch.Tensor],
        config: ReceiverConfig | None = None,
        context: zmq.Context | None = None,
        platform: tensors.DevicePlatform | None = None,
    ) -> None:
        """key_caches, value_caches: per layer [num_blocks, block_size, kv_heads, head_dim].
        platform: where the caches live (None: host memory). Poll from the thread that makes the
        receiver: it binds that thread to the device and makes its copy stream."""
        assert len(key_caches) == len(value_caches) == fingerprint.num_layers, "one K and V cache per layer"
        expected = (
            reservations.num_blocks,
            fingerprint.block_size,
            fingerprint.num_kv_heads,
            fingerprint.head_dim,
        )
        assert all(tuple(c.shape) == expected for c in [*key_caches, *value_caches]), (
            "cache shape != fingerprint"
        )
        self.fingerprint = fingerprint
        self.config = config or ReceiverConfig()
        self.reservations = reservations
        self.key_caches, self.value_caches = list(key_caches), list(value_caches)
        self._channel = ListenChannel(address, context, self.config.max_frame_bytes, decoder=decode)
        self.address = self._channel.address  # resolved (tcp://host:0 gets its port)
        self.draining = False  # set_draining(): KVReject every new reservation
        self._incoming: dict[str, _Incoming] = {}
        self._queued: deque[_Queued] = deque()
        self._result = PollResult()
        self._peers = PeerMemory(fingerprint, self.config.shared_memory)  # same-host rings and caches
        self._copies = tensors.DeviceCopies(platform)
        tensors.activate(platform)
        k = self.key_caches[0]
        self._bytes_per_block = 2 * self.fingerprint.num_layers * k[0].numel() * k.element_size()
        self._handlers: dict[type[Message], Callable[[bytes, Message, list[memoryview]], None]] = {
            KVReserve: self._on_reserve,
            KVChunk: self._on_chunk,
            KVDone: self._on_done,
            Abort: self._on_abort,
        }

    def set_draining(self) -> None:
        """Refuse new reservations (KVReject) while in-flight transfers finish."""
        self.draining = True

    @property
    def num_incoming(self) -> int:
        """Granted requests whose KV is still arriving."""
        return len(self._incoming)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def poll(self, timeout_s: float) -> PollResult:
        """Handle messages and deadlines until something completes or fails, or the timeout passes."""
        self._result = result = PollResult()
        deadline = time.monotonic() + timeout_s
        num_handled = 0
        while True:
            now = time.monotonic()
            self._expire(now)
            self._grant_queued()
            if result or (now >= deadline and num_handled >= 256):
                break
            inbound = self._recv(max(0.0, min(deadline, self._next_expiry()) - now))
            if inbound is None:
                if time.monotonic() >= deadline:
                    break
                continue
            num_handled += 1
            self._handle(inbound)
        return result

    @property
    def socket(self) -> zmq.Socket:
        """The receiving socket, for a node loop that waits on it together with others."""
        return self._channel.socket

    def abort(self, request_id: str, reason: str) -> bool:
        """Drop a request still in transfer (e.g. its client left); False when unknown here."""
        if request_id in self._incoming or any(q.reserve.request_id == request_id for q in self._queued):
            self._fail(request_id, KVAborted(request_id, reason))
            return True
        return False

    def close(self) -> None:
        """Free every request still in transfer and close the socket."""
        for request_id in [*self._incoming, *(q.reserve.request_id for q in self._queued)]:
            self._fail(request_id, KVAborted(request_id, "receiver closing"))
        self._channel.close()
        self._peers.close()

    # ----------------------------------------------------------------- messages
    def _recv(self, timeout_s: float) -> Inbound | None:
        try:
            return self._channel.recv(timeout_s)
        except ProtocolError as exc:
            self._reply(getattr(exc, "peer", b""), Error(None, "malformed", str(exc)))
            return None

    def _handle(self, inbound: Inbound) -> None:
        handler = self._handlers.get(type(inbound.msg))
        if handler is None:
            self._reply(
                inbound.peer, Error(None, "unexpected", f"a receiver does not take {inbound.msg.TAG}")
            )
            return
        handler(inbound.peer, inbound.msg, inbound.frames)

    def _on_reserve(self, peer: bytes, msg: Message, frames: list[memoryview]) -> None:
        assert isinstance(msg, KVReserve)
        duplicate = msg.request_id in self._incoming or any(
            q.reserve.request_id == msg.request_id for q in self._queued
        )
        problem = reserve_problem(
            msg, self.fingerprint, self.reservations.num_blocks, self.draining, duplicate
        )
        if problem is not None:
            self._reply(peer, KVReject(msg.request_id, *problem))
            return
        try:
            if not self._queued and self._try_grant(peer, msg):
                return
        except ValueError as exc:  # the engine will never admit it
            self._reply(peer, KVReject(msg.request_id, f"not admitted: {exc}"))
            return
        if len(self._queued) >= self.config.max_waiting:
            self._reply(peer, KVReject(msg.request_id, "receiver busy: wait queue full"))
            return
        ttl = min(msg.ttl_s, self.config.max_ttl_s)
        self._queued.append(_Queued(peer, msg, time.monotonic() + ttl))
        self._reply(peer, KVWait(msg.request_id, len(self._queued) - 1))

    def _try_grant(self, peer: bytes, msg: KVReserve) -> bool:
        """Grant when the engine has room now; ValueError when it never will."""
        reservation = self.reservations.reserve(msg.request_id, msg.token_ids, msg.sampling_params)
        if reservation is None:
            return False
        num_held, send_ids = reservation.num_held_blocks, list(reservation.block_ids)
        # The one-copy path writes our caches through numpy views: only for caches in host memory.
        direct_src = self._peers.map_cache(msg) if self._copies.on_host else None
        ring = None if direct_src is not None else self._peers.map_ring(msg)
        self._incoming[msg.request_id] = _Incoming(
            peer,
            msg,
            num_held,
            torch.tensor(send_ids, dtype=torch.long),
            bytearray(self.fingerprint.num_layers * len(send_ids)),
            time.monotonic() + self.config.chunk_timeout_s,
            ring,
            None if direct_src is None else DirectCopy(direct_src),
        )
        grant = KVGrant(
            msg.request_id,
            num_held,
            tuple(send_ids),
            self.config.window_bytes,
            ring is not None,
            direct_src is not None,
        )
        self._reply(peer, grant)
        state = self._incoming[msg.request_id]
        if state.direct is not None:  # copy now, while the sender hashes; KVDone only compares
            state.direct.at_grant(
                msg.cache_block_ids, num_held, self.key_caches, self.value_caches, state.block_ids
            )
            state.deadline = time.monotonic() + self.config.chunk_timeout_s
        return True

    def _on_chunk(self, peer: bytes, msg: Message, frames: list[memoryview]) -> None:
        assert isinstance(msg, KVChunk)
        state = self._incoming.get(msg.request_id)
        try:
            if state is not None and state.peer == peer:  # else a request already failed here
                self._land_chunk(state, msg, frames)
        finally:
            # Credit every chunk, landed or not, once its bytes are no longer read (the sender
            # reuses a shared slot on credit), so the sender's window never leaks.
            self._reply(peer, KVCredit(msg.request_id, sum(len(f) for f in frames)))

    def _land_chunk(self, state: _Incoming, msg: KVChunk, frames: list[memoryview]) -> None:
        wire = state.reserve.wire_format
        if msg.shm_offset is not None:
            # Copy out of the sender's live ring first, then check and land that copy: checking the
            # ring in place would let bytes that change between the check and the copy land unchecked.
            frames = [memoryview(bytes(f)) for f in ring_frames(state.ring, msg, self.key_caches[0], wire)]
        problem = chunk_problem(
            msg,
            frames,
            self.fingerprint.num_layers,
            len(state.block_ids),
            state.landed,
            self.key_caches[0],
            wire,
        )
        if problem is not None:
            self._fail(msg.request_id, KVAborted(msg.request_id, problem))
            return
        ids = state.block_ids[msg.block_start : msg.block_start + msg.num_blocks]
        tensors.unpack_layer(
            frames,
            self.key_caches[msg.layer],
            self.value_caches[msg.layer],
            ids,
            state.reserve.wire_format,
            self._copies,
        )  # landed on return, also in device memory: the engine may read the blocks from now on
        first = msg.layer * len(state.block_ids) + msg.block_start
        state.landed[first : first + msg.num_blocks] = b"\x01" * msg.num_blocks
        state.bytes_received += sum(len(f) for f in frames)
        state.deadline = time.monotonic() + self.config.chunk_timeout_s

    def _on_done(self, peer: bytes, msg: Message, frames: list[memoryview]) -> None:
        assert isinstance(msg, KVDone)
        state = self._incoming.get(msg.request_id)
        if state is None or state.peer != peer:
            self._reply(peer, Error(msg.request_id, "unknown_request", "no transfer in progress for this id"))
            return
        if state.direct is not None:
            problem = state.direct.at_done(
                tuple(msg.src_block_ids),
                msg.layer_checksums,
                self.key_caches,
                self.value_caches,
                state.block_ids,
            )
            if problem is not None:
                self._fail(msg.request_id, KVAborted(msg.request_id, problem))
                return
            state.landed[:] = b"\x01" * len(state.landed)
            state.bytes_received = len(state.block_ids) * self._bytes_per_block
        if not all(state.landed):
            self._fail(msg.request_id, KVAborted(msg.request_id, "done before every chunk landed"))
            return
        del self._incoming[msg.request_id]
        self._reply(peer, KVAck(msg.request_id))
        self._result.completed.append(
            ReceivedKV(
                msg.request_id,
                msg.first_token,
                state.num_held_blocks,
                state.bytes_received,
                msg.num_cached_tokens,
                state.reserve.request_meta,
                msg.first_logprobs,
            )
        )

    def _on_abort(self, peer: bytes, msg: Message, frames: list[memoryview]) -> None:
        assert isinstance(msg, Abort)
        state = self._incoming.get(msg.request_id)
        queued = any(q.reserve.request_id == msg.request_id and q.peer == peer for q in self._queued)
        if (state is not None and state.peer == peer) or queued:
            self._fail(msg.request_id, KVAborted(msg.request_id, f"peer: {msg.reason}"), notify=False)

    # ----------------------------------------------------------------- deadlines and room
    def _expire(self, now: float) -> None:
        for request_id, state in list(self._incoming.items()):
            if state.deadline <= now:
                self._fail(request_id, KVTimeout(request_id, "chunk"))
        for queued in [q for q in self._queued if q.expires_at <= now]:
            self._queued.remove(queued)
            self._reply(
                queued.peer, KVReject(queued.reserve.request_id, "timed out waiting for blocks", "ttl_s")
            )
            self._result.failed.append(
                TransferFailure(
                    queued.reserve.request_id,
                    KVTimeout(queued.reserve.request_id, "grant"),
                    queued.reserve.request_meta,
                )
            )

    def _next_expiry(self) -> float:
        deadlines = [s.deadline for s in self._incoming.values()] + [q.expires_at for q in self._queued]
        return min(deadlines, default=math.inf)

    def _grant_queued(self) -> None:
        """Grant queued reservations in arrival order while the head fits (no overtaking)."""
        while self._queued:
            head = self._queued[0]
            try:
                if not self._try_grant(head.peer, head.reserve):
                    return
            except ValueError as exc:  # admitted rules changed under it (e.g. a duplicate id)
                self._reply(head.peer, KVReject(head.reserve.request_id, f"not admitted: {exc}"))
            self._queued.popleft()

    def _fail(self, request_id: str, error: KVTransferError, notify: bool = True) -> None:
        state = self._incoming.pop(request_id, None)
        peer, meta = None, None
        if state is not None:
            meta = state.reserve.request_meta
            self.reservations.release(request_id)
            peer = state.peer
        for queued in [q for q in self._queued if q.reserve.request_id == request_id]:
            self._queued.remove(queued)
            peer, meta = queued.peer, queued.reserve.request_meta
        if notify and peer is not None:
            self._reply(peer, Abort(request_id, str(error)))
        self._result.failed.append(TransferFailure(request_id, error, meta))

    def _reply(self, peer: bytes, msg: Message) -> None:
        if isinstance(msg, Error):
            self._result.refused.append(f"{msg.code}: {msg.message}"[:500])
        try:
            self._channel.send(peer, msg)
        except PeerUnavailable:
            pass  # a peer that does not drain its replies will hit its own deadlines
