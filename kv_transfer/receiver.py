"""Decode side of a KV transfer: bytes landed in the blocks the engine granted, and hand-over.

The decode node drives it from its loop: ``poll(timeout_s)`` handles messages and deadlines and
returns the requests whose KV landed (the engine then moves them to RUNNING) and those that
failed. The request itself is the engine's (``BlockReservations``): it queues the reservation
beside its local prompts and grants blocks from its own scheduling loop, by the same rules. This
side keeps, per request, only where replies go, its deadline, and which bytes have landed:

    KVReserve ─► checks (fingerprint, hashes, fits at all?) ─► KVReject
                 └─► engine.reserve ─► KVWait (its place in the engine's queue) … KVReject at ttl
    engine grant (its step result; the node calls grant) ─► KVGrant
    KVChunk   ─► sizes + xxh3 checked ─► index_copy_ into the granted blocks ─► KVCredit
                 (device caches: upload, scatter on the copy stream, its event waited on)
    KVDone    ─► all (layer, block) pieces landed? ─► KVAck, report completed

A request that stays silent for ``chunk_timeout_s`` once granted, fails a check, or is aborted by
its sender is dropped by the engine at once (``abort``) and reported failed; an abort the node
starts goes through the engine, which says when to ``stop`` the transfer. The node keeps serving
every other request.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch
import zmq

from pdserve.kv_transfer import tensors
from pdserve.kv_transfer.checks import chunk_problem, reserve_problem, ring_frames
from pdserve.kv_transfer.errors import KVAborted, KVTimeout, KVTransferError
from pdserve.kv_transfer.messages import (
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
from pdserve.kv_transfer.outcomes import PollResult, ReceivedKV, TransferFailure
from pdserve.kv_transfer.peer_memory import DirectCopy, PeerMemory
from pdserve.kv_transfer.reservations import BlockReservations, Reservation
from pdserve.protocol.channel import Inbound, ListenChannel, PeerUnavailable
from pdserve.protocol.channel_auth import ChannelAuth


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiverConfig:
    window_bytes: int = 64 << 20  # unconsumed chunk bytes a peer may have in flight
    chunk_timeout_s: float = 5.0  # longest silence of a granted request's sender
    max_ttl_s: float = 60.0  # cap on how long a reservation may wait for its grant
    max_waiting: int = 64  # reservations waiting for a grant; beyond this, KVReject
    max_frame_bytes: int = 256 << 20  # larger data frames are refused
    shared_memory: bool = True  # map a same-host sender's staging ring instead of taking frames

    def __post_init__(self) -> None:
        if min(self.window_bytes, self.chunk_timeout_s, self.max_ttl_s, self.max_frame_bytes) <= 0:
            raise ValueError("ReceiverConfig sizes and timeouts must be positive")
        if self.max_waiting < 0:
            raise ValueError("ReceiverConfig.max_waiting must be >= 0")


@dataclasses.dataclass(slots=True)
class _Landing:
    """What of a granted request's KV has landed, and where."""

    num_held_blocks: int
    block_ids: torch.Tensor  # [num_send_blocks] receiver block ids, in prompt order
    landed: bytearray  # [num_layers * num_send_blocks], 1 where that layer of that block landed
    ring: memoryview | None  # the sender's shared staging ring, when chunks come through it
    direct: DirectCopy | None = None  # the one-copy path: the sender's cache is mapped here
    bytes_received: int = 0


@dataclasses.dataclass(slots=True)
class _Transfer:
    """One request's transfer: where its replies go, its deadline, and once granted what landed."""

    peer: bytes
    reserve: KVReserve
    deadline: float  # waiting: when the grant is too late (ttl); granted: by when the next message is due
    landing: _Landing | None = None  # None until the engine grants blocks


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
        auth: ChannelAuth | None = None,
    ) -> None:
        """key_caches, value_caches: per layer [num_blocks, block_size, kv_heads, head_dim].
        platform: where the caches live (None: host memory). Poll from the thread that makes the
        receiver: it binds that thread to the device and makes its copy stream. auth: the
        cluster's CURVE (None: any peer may connect)."""
        assert len(key_caches) == len(value_caches) == fingerprint.num_layers, "one K and V cache per layer"
        expected = (
            reservations.num_blocks,
            fingerprint.block_size,
            fingerprint.num_kv_heads,
            fingerprint.row_width,
        )
        assert all(tuple(c.shape) == expected for c in [*key_caches, *value_caches]), (
            "cache shape != fingerprint"
        )
        self.fingerprint = fingerprint
        self.config = config or ReceiverConfig()
        self.reservations = reservations
        self.key_caches, self.value_caches = list(key_caches), list(value_caches)
        self._channel = ListenChannel(
            address, context, self.config.max_frame_bytes, decoder=decode, auth=auth, name="kv"
        )
        self.address = self._channel.address  # resolved (tcp://host:0 gets its port)
        self.draining = False  # set_draining(): KVReject every new reservation
        self._transfers: dict[str, _Transfer] = {}  # request id -> its transfer, until it lands or fails
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
        return sum(t.landing is not None for t in self._transfers.values())

    @property
    def num_queued(self) -> int:
        """Reservations the engine has queued and not granted yet."""
        return sum(t.landing is None for t in self._transfers.values())

    @property
    def num_transfers(self) -> int:
        return len(self._transfers)

    def poll(self, timeout_s: float) -> PollResult:
        """Handle messages and deadlines until something completes or fails, or the timeout passes."""
        self._result = result = PollResult()
        deadline = time.monotonic() + timeout_s
        num_handled = 0
        while True:
            now = time.monotonic()
            self._expire(now)
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

    def stop(self, request_id: str, reason: str) -> bool:
        """The engine dropped the request (its client left, its time ran out): forget its transfer
        and tell the sender to stop. The blocks were the engine's to free. False when unknown here."""
        transfer = self._transfers.pop(request_id, None)
        if transfer is None:
            return False
        self._reply(transfer.peer, Abort(request_id=request_id, reason=reason))
        return True

    def close(self) -> None:
        """Fail every request still in transfer and close the socket."""
        for request_id in list(self._transfers):
            self._fail(request_id, KVAborted(request_id, "receiver closing"))
        self._channel.close()
        self._peers.close()

    # ----------------------------------------------------------------- messages
    def _recv(self, timeout_s: float) -> Inbound | None:
        try:
            return self._channel.recv(timeout_s)
        except ProtocolError as exc:
            self._reply(getattr(exc, "peer", b""), Error(request_id=None, code="malformed", message=str(exc)))
            return None

    def _handle(self, inbound: Inbound) -> None:
        handler = self._handlers.get(type(inbound.msg))
        if handler is None:
            self._reply(
                inbound.peer,
                Error(
                    request_id=None, code="unexpected", message=f"a receiver does not take {inbound.msg.TAG}"
                ),
            )
            return
        handler(inbound.peer, inbound.msg, inbound.frames)

    def _on_reserve(self, peer: bytes, msg: Message, frames: list[memoryview]) -> None:
        assert isinstance(msg, KVReserve)
        rid, duplicate = msg.request_id, msg.request_id in self._transfers
        problem = reserve_problem(
            msg, self.fingerprint, self.reservations.num_blocks, self.draining, duplicate
        )
        if problem is None and self.num_queued >= self.config.max_waiting:
            problem = ("receiver busy: too many reservations waiting for blocks", None)
        if problem is not None:
            reason, field = problem
            self._reply(peer, KVReject(request_id=rid, reason=reason, field=field))
            return
        ttl = min(msg.ttl_s, self.config.max_ttl_s)
        transfer = self._transfers[rid] = _Transfer(peer, msg, time.monotonic() + ttl)
        try:  # the engine grants at a later step (a pool without an engine, from inside this call)
            position = self.reservations.reserve(rid, msg.token_ids, msg.sampling_params)
        except ValueError as exc:  # the engine will never admit it
            position, reason = None, f"not admitted: {exc}"
        else:
            reason = "receiver busy: wait queue full"
        if position is None:
            del self._transfers[rid]
            self._reply(peer, KVReject(request_id=rid, reason=reason))
        elif transfer.landing is None:
            self._reply(peer, KVWait(request_id=rid, queue_position=position))

    def grant(self, reservation: Reservation) -> None:
        """The engine's scheduler granted blocks (its step result): tell the sender where its KV
        goes. Blocks nobody here waits for go back to the engine."""
        rid = reservation.request_id
        transfer = self._transfers.get(rid)
        if transfer is None or transfer.landing is not None:  # nobody here waits for them
            self.reservations.abort(rid)
            return
        msg, num_held, send_ids = transfer.reserve, reservation.num_held_blocks, list(reservation.block_ids)
        # The one-copy path writes our caches through numpy views: only for caches in host memory,
        # each one tensor (not a tensor-parallel node's ranks: tensors.HeadSplitCache)
        one_tensor = not isinstance(self.key_caches[0], tensors.HeadSplitCache)
        direct_src = self._peers.map_cache(msg) if self._copies.on_host and one_tensor else None
        ring = None if direct_src is not None else self._peers.map_ring(msg)
        landing = transfer.landing = _Landing(
            num_held,
            torch.tensor(send_ids, dtype=torch.long),
            bytearray(self.fingerprint.num_layers * len(send_ids)),
            ring,
            None if direct_src is None else DirectCopy(direct_src),
        )
        transfer.deadline = time.monotonic() + self.config.chunk_timeout_s
        grant = KVGrant(
            request_id=rid,
            num_held_blocks=num_held,
            block_ids=tuple(send_ids),
            window_bytes=self.config.window_bytes,
            shm=ring is not None,
            direct=direct_src is not None,
        )
        self._reply(transfer.peer, grant)
        if landing.direct is not None:  # copy now, while the sender hashes; KVDone only compares
            landing.direct.at_grant(
                msg.cache_block_ids, num_held, self.key_caches, self.value_caches, landing.block_ids
            )
            transfer.deadline = time.monotonic() + self.config.chunk_timeout_s

    def _on_chunk(self, peer: bytes, msg: Message, frames: list[memoryview]) -> None:
        assert isinstance(msg, KVChunk)
        transfer = self._transfers.get(msg.request_id)
        try:
            if transfer is not None and transfer.peer == peer and transfer.landing is not None:
                self._land_chunk(transfer, msg, frames)  # else a request already failed here
        finally:
            # Credit every chunk, landed or not, once its bytes are no longer read (the sender
            # reuses a shared slot on credit), so the sender's window never leaks.
            self._reply(peer, KVCredit(request_id=msg.request_id, num_bytes=sum(len(f) for f in frames)))

    def _land_chunk(self, transfer: _Transfer, msg: KVChunk, frames: list[memoryview]) -> None:
        wire, state = transfer.reserve.wire_format, transfer.landing
        assert state is not None, "chunks land only in granted blocks"
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
            wire,
            self._copies,
        )  # landed on return, also in device memory: the engine may read the blocks from now on
        first = msg.layer * len(state.block_ids) + msg.block_start
        state.landed[first : first + msg.num_blocks] = b"\x01" * msg.num_blocks
        state.bytes_received += sum(len(f) for f in frames)
        transfer.deadline = time.monotonic() + self.config.chunk_timeout_s

    def _on_done(self, peer: bytes, msg: Message, frames: list[memoryview]) -> None:
        assert isinstance(msg, KVDone)
        transfer = self._transfers.get(msg.request_id)
        state = transfer.landing if transfer is not None and transfer.peer == peer else None
        if transfer is None or state is None:
            self._reply(
                peer,
                Error(
                    request_id=msg.request_id,
                    code="unknown_request",
                    message="no transfer in progress for this id",
                ),
            )
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
        del self._transfers[msg.request_id]
        self._reply(peer, KVAck(request_id=msg.request_id))
        self._result.completed.append(
            ReceivedKV(
                msg.request_id,
                msg.first_token,
                state.num_held_blocks,
                state.bytes_received,
                msg.num_cached_tokens,
                transfer.reserve.request_meta,
                msg.first_logprobs,
                len(transfer.reserve.token_ids),
                transfer.reserve.sampling_params,
            )
        )

    def _on_abort(self, peer: bytes, msg: Message, frames: list[memoryview]) -> None:
        assert isinstance(msg, Abort)
        transfer = self._transfers.get(msg.request_id)
        if transfer is not None and transfer.peer == peer:
            self._fail(msg.request_id, KVAborted(msg.request_id, f"peer: {msg.reason}"), notify=False)

    # ----------------------------------------------------------------- deadlines and failures
    def _expire(self, now: float) -> None:
        for request_id, transfer in list(self._transfers.items()):
            if transfer.deadline > now:
                continue
            if transfer.landing is not None:
                self._fail(request_id, KVTimeout(request_id, "chunk"))
                continue
            self._reply(
                transfer.peer,
                KVReject(request_id=request_id, reason="timed out waiting for blocks", field="ttl_s"),
            )
            self._fail(request_id, KVTimeout(request_id, "grant"), notify=False)

    def _next_expiry(self) -> float:
        return min((t.deadline for t in self._transfers.values()), default=math.inf)

    def _fail(self, request_id: str, error: KVTransferError, notify: bool = True) -> None:
        """Drop the transfer, have the engine drop the request, tell the sender (``notify``)."""
        transfer = self._transfers.pop(request_id, None)
        if transfer is None:
            return
        self.reservations.abort(request_id)
        if notify:
            self._reply(transfer.peer, Abort(request_id=request_id, reason=str(error)))
        self._result.failed.append(TransferFailure(request_id, error, transfer.reserve.request_meta))

    def _reply(self, peer: bytes, msg: Message) -> None:
        if isinstance(msg, Error):
            self._result.refused.append(f"{msg.code}: {msg.message}"[:500])
        try:
            self._channel.send(peer, msg)
        except PeerUnavailable:
            pass  # a peer that does not drain its replies will hit its own deadlines
