"""Prefill side of a KV transfer: reserve, stream layer chunks under a credit window, finish.

    KVReserve ──►            (wait ≤ grant_timeout_s; KVWait keeps waiting)
              ◄── KVGrant    (num_held_blocks, window_bytes)
    KVChunk × (layers × runs) ──►   never more than window_bytes unconsumed
              ◄── KVCredit   (one per chunk consumed)
    KVDone ──►
              ◄── KVAck      (wait ≤ reply_timeout_s) → the caller frees its blocks

Any failure raises a ``KVTransferError`` after a best-effort ``Abort`` to the peer; the
caller frees its blocks either way. Its settings and transfer records are in
kv_transfer/sender_records.py (imported here by their users' old name too). One ``KVSender`` talks to one decode node and may
interleave several requests from one thread.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
import zmq

from pdserve.kv_transfer import shared_cache, tensors
from pdserve.kv_transfer.errors import KVAborted, KVRejected, KVTimeout, KVTransferError
from pdserve.kv_transfer.messages import (
    Abort,
    CacheRef,
    Error,
    KVAck,
    KVChunk,
    KVCredit,
    KVDone,
    KVFingerprint,
    KVGrant,
    KVReject,
    KVReserve,
    KVShipment,
    KVWait,
    Message,
    TokenLogprobs,
    WireFormat,
    decode,
)
from pdserve.kv_transfer.sender_records import OutgoingTransfer, SenderConfig, TransferStats
from pdserve.kv_transfer.staging import StagingRing, host_id, peer_is_local
from pdserve.protocol.block_hash import cache_root_of, hash_full_blocks
from pdserve.protocol.channel import PeerChannel, PeerUnavailable
from pdserve.protocol.channel_auth import ChannelAuth
from pdserve.protocol.messages import RequestMeta
from pdserve.protocol.sampling_params import SamplingParams

# Fault injection for the chaos tests, off unless set: every Nth transfer of this process goes out
# with one checksum bit flipped, as if a byte had changed on the way; the receiver must catch it.
_CORRUPT_EVERY = int(os.environ.get("PDSERVE_FAULT_CORRUPT_KV_EVERY") or 0)
_transfer_count = itertools.count(1)
CANCEL_CHECK_S = 0.05  # how often a cancellable transfer waiting on its peer looks at its flag


def _as_corrupted(checksums: tuple[int, ...]) -> tuple[int, ...]:
    if not _CORRUPT_EVERY or next(_transfer_count) % _CORRUPT_EVERY or not checksums:
        return checksums
    return (checksums[0] ^ 1, *checksums[1:])


class KVSender:
    def __init__(
        self,
        address: str,
        fingerprint: KVFingerprint,
        config: SenderConfig | None = None,
        context: zmq.Context | None = None,
        cache_ref: CacheRef | None = None,
        platform: tensors.DevicePlatform | None = None,
        auth: ChannelAuth | None = None,
    ) -> None:
        """auth: the cluster's CURVE (protocol/channel_auth.py).
        cache_ref: this node's KV cache in shared memory (kv_transfer.shared_cache), offered to
        same-host receivers for the one-copy path; the caches passed to send calls must be it.
        platform: where the caches live (None: host memory). Caches in device memory are packed
        through a copy stream made here, and never offered in shared memory (cache_ref is dropped,
        the ring is private): peers read only host memory."""
        self.fingerprint = fingerprint
        self.config = config or SenderConfig()
        if fingerprint.dtype == "int8" and self.config.wire_format != WireFormat.NATIVE:
            raise ValueError("an int8 KV cache travels as it is: wire_format must be native")
        self._copies = tensors.DeviceCopies(platform)
        self.cache_ref = cache_ref if self.config.shared_memory and self._copies.on_host else None
        self._channel = PeerChannel(address, context, decoder=decode, auth=auth)
        self._inbox: dict[str, deque[Message]] = {}  # replies per active request, in arrival order
        self._cancels: dict[str, threading.Event] = {}  # ship()'s cancel flags, while it runs
        shared = self.config.shared_memory and peer_is_local(address)  # else nobody could map it
        self._ring = StagingRing(self.config.staging_bytes, shared, platform)
        self._window_bytes = 0  # from the latest grant

    # ----------------------------------------------------------------- per request
    def reserve(
        self,
        request_id: str,
        token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_meta: RequestMeta | None = None,
        block_table: Sequence[int] = (),
    ) -> OutgoingTransfer:
        """Ask for blocks and wait for the grant. Raises KVRejected or KVTimeout.
        ``block_table``, this node's blocks of the prompt, lets a receiver that maps our cache
        start copying at the grant (see ``transfer``)."""
        fp = self.fingerprint
        msg = KVReserve(
            request_id=request_id,
            token_ids=tuple(token_ids),
            block_hashes=tuple(
                hash_full_blocks(token_ids, fp.block_size, parent_hash=_root(sampling_params))
            ),
            fingerprint=fp,
            ttl_s=self.config.grant_timeout_s,
            wire_format=self.config.wire_format,
            sampling_params=sampling_params,
            ring_ref=self._ring.ref,
            host_id=host_id(),
            request_meta=request_meta,
            cache_ref=self.cache_ref,
            cache_block_ids=tuple(block_table) if self.cache_ref is not None else (),
        )
        self._inbox[request_id] = deque()
        started = time.monotonic()
        self._send_or_fail(request_id, msg)
        grant = self._wait_for(request_id, KVGrant, "grant", started + self.config.grant_timeout_s)
        assert isinstance(grant, KVGrant)
        self._window_bytes = grant.window_bytes
        return OutgoingTransfer(
            request_id,
            len(token_ids),
            grant.num_held_blocks,
            len(grant.block_ids),
            started,
            grant.shm,
            grant.direct and self.cache_ref is not None,
        )

    def send_layer(
        self,
        tx: OutgoingTransfer,
        layer: int,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: Sequence[int],
    ) -> None:
        """Send one layer of the blocks not held by the receiver.

        key_cache, value_cache: [num_blocks, block_size, kv_heads, head_dim], this layer's caches;
        block_table: the sender's blocks of the prompt, in token order.
        """
        fp = self.fingerprint
        assert key_cache.shape[1:] == (fp.block_size, fp.num_kv_heads, fp.row_width), (
            "cache shape != fingerprint"
        )
        assert len(block_table) == tx.num_held_blocks + tx.num_send_blocks, (
            "block table does not fit the grant"
        )
        ids = torch.tensor(block_table[tx.num_held_blocks :], dtype=torch.long)
        block_bytes = 2 * key_cache[0].numel() * key_cache.element_size()
        chunk_bytes = min(self.config.max_chunk_bytes, self._ring.capacity // 2)
        per_chunk = max(1, chunk_bytes // block_bytes)
        for start in range(0, tx.num_send_blocks, per_chunk):
            self._send_chunk(tx, layer, start, key_cache, value_cache, ids[start : start + per_chunk])

    def finish(
        self,
        tx: OutgoingTransfer,
        first_token: int,
        num_cached_tokens: int = 0,
        src_block_ids: tuple[int, ...] = (),
        layer_checksums: tuple[int, ...] = (),
        first_logprobs: TokenLogprobs | None = None,
    ) -> TransferStats:
        """Send KVDone and wait for KVAck; then the caller may free its blocks. Direct grants
        name the blocks to copy (``src_block_ids``) with a checksum per layer."""
        done = KVDone(
            request_id=tx.request_id,
            first_token=first_token,
            num_prompt_tokens=tx.num_prompt_tokens,
            num_cached_tokens=num_cached_tokens,
            src_block_ids=src_block_ids,
            layer_checksums=layer_checksums,
            first_logprobs=first_logprobs,
        )
        self._send_or_fail(tx.request_id, done)
        self._wait_for(tx.request_id, KVAck, "ack", time.monotonic() + self.config.reply_timeout_s)
        del self._inbox[tx.request_id]
        return TransferStats(
            tx.request_id,
            tx.num_held_blocks,
            tx.num_send_blocks,
            tx.bytes_sent,
            time.monotonic() - tx.started_at,
            tx.shm,
            tx.direct,
        )

    def abort(self, request_id: str, reason: str) -> None:
        """Tell the decode node to drop the request (best effort) and forget it here."""
        self._inbox.pop(request_id, None)
        try:
            self._channel.send(Abort(request_id=request_id, reason=reason))
        except PeerUnavailable:
            pass

    def ship(
        self,
        shipment: KVShipment,
        key_caches: Sequence[torch.Tensor],
        value_caches: Sequence[torch.Tensor],
        on_granted: Callable[[], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> TransferStats:
        """Reserve, send every layer, finish. Raises KVTransferError (peer told to abort).
        ``on_granted`` runs once the receiver holds the blocks, before any KV is sent. ``cancel``
        set (the request was aborted): the transfer stops within ``CANCEL_CHECK_S``, KVAborted."""
        s = shipment
        if cancel is not None:
            self._cancels[s.request_id] = cancel
        try:
            return self._ship(s, key_caches, value_caches, on_granted)
        finally:
            self._cancels.pop(s.request_id, None)

    def _ship(self, s: KVShipment, key_caches, value_caches, on_granted) -> TransferStats:
        tx = self.reserve(s.request_id, s.token_ids, s.sampling_params, s.request_meta, s.block_table)
        if on_granted is not None:
            on_granted()
        try:
            if tx.direct:
                # The receiver copies from our shared cache, starting at the grant: no chunks. We
                # hash the same blocks meanwhile, on our own core, and name them in KVDone.
                src = s.block_table[tx.num_held_blocks :]
                sums = tuple(
                    shared_cache.layer_checksum(key_caches[layer], value_caches[layer], list(src))
                    for layer in range(len(key_caches))
                )
                tx.bytes_sent = len(src) * 2 * sum(k[0].numel() * k.element_size() for k in key_caches)
                sums = _as_corrupted(sums)
                return self.finish(tx, s.first_token, s.num_cached_tokens, src, sums, s.first_logprobs)
            for layer in range(len(key_caches)):
                self.send_layer(tx, layer, key_caches[layer], value_caches[layer], s.block_table)
            return self.finish(tx, s.first_token, s.num_cached_tokens, first_logprobs=s.first_logprobs)
        except BaseException as exc:
            if s.request_id in self._inbox:  # not already settled with the peer
                self.abort(s.request_id, f"sender failed: {exc!r}")
            raise

    def transfer(
        self,
        request_id: str,
        token_ids: Sequence[int],
        key_caches: Sequence[torch.Tensor],
        value_caches: Sequence[torch.Tensor],
        block_table: Sequence[int],
        first_token: int,
        num_cached_tokens: int = 0,
        sampling_params: SamplingParams | None = None,
        request_meta: RequestMeta | None = None,
        first_logprobs: TokenLogprobs | None = None,
        on_granted: Callable[[], None] | None = None,
    ) -> TransferStats:
        """``ship`` of a shipment given field by field (benches, tests, probes)."""
        shipment = KVShipment(
            request_id,
            tuple(token_ids),
            tuple(block_table),
            first_token,
            num_cached_tokens,
            sampling_params,
            request_meta,
            first_logprobs,
        )
        return self.ship(shipment, key_caches, value_caches, on_granted)

    def close(self) -> None:
        self._channel.close()
        self._ring.close()

    # ----------------------------------------------------------------- internals
    def _send_chunk(
        self,
        tx: OutgoingTransfer,
        layer: int,
        block_start: int,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        ids: torch.Tensor,
    ) -> None:
        sizes = tensors.frame_sizes(
            tuple(key_cache.shape[1:]), key_cache.dtype, len(ids), self.config.wire_format
        )
        _, slot_bytes = tensors.frame_offsets(sizes)
        offset = self._reserve_slot(tx.request_id, slot_bytes)
        frames = tensors.pack_layer(
            key_cache,
            value_cache,
            ids,
            self.config.wire_format,
            self._ring.buffer[offset : offset + slot_bytes],
            self._copies,
        )  # complete: a device cache's copies have landed
        views = [tensors.as_frame(f) for f in frames]
        checksums = tuple(tensors.checksum(v) for v in views)
        if layer == 0 and block_start == 0:
            checksums = _as_corrupted(checksums)
        chunk = KVChunk(
            request_id=tx.request_id,
            layer=layer,
            block_start=block_start,
            num_blocks=len(ids),
            checksums=checksums,
            shm_offset=offset if tx.shm else None,  # in the shared ring the frames stay there
        )
        self._send_or_fail(tx.request_id, chunk, () if tx.shm else views)
        tx.bytes_sent += sum(sizes)

    def _reserve_slot(self, request_id: str, slot_bytes: int) -> int:
        """A ring slot for the next chunk, waiting for credits while the window or the ring is full."""
        deadline = time.monotonic() + self.config.reply_timeout_s
        self._drain(request_id)
        while True:
            in_flight = self._ring.in_flight_bytes
            # A chunk bigger than the whole window still goes alone, so a small window cannot deadlock.
            if in_flight == 0 or in_flight + slot_bytes <= self._window_bytes:
                offset = self._ring.try_alloc(slot_bytes, request_id)
                if offset is not None:
                    return offset
            self._pump(request_id, deadline, "credit")

    def _send_or_fail(self, request_id: str, msg: Message, frames: Sequence[memoryview] = ()) -> None:
        try:
            self._channel.send(msg, frames)
        except PeerUnavailable:
            self._inbox.pop(request_id, None)
            raise KVTimeout(request_id, "send") from None

    def _wait_for(self, request_id: str, kind: type[Message], stage: str, deadline: float) -> Message:
        while True:
            inbox = self._inbox[request_id]
            while inbox:
                msg = inbox.popleft()
                if isinstance(msg, kind):
                    return msg
                self._raise_if_fatal(request_id, msg)  # KVWait just keeps us waiting
            self._pump(request_id, deadline, stage)

    def _pump(self, request_id: str, deadline: float, stage: str) -> None:
        """Receive one message (or time out the request); credits apply at once. A cancellable
        transfer looks at its flag every ``CANCEL_CHECK_S`` meanwhile."""
        remaining = deadline - time.monotonic()
        wait = min(remaining, CANCEL_CHECK_S) if request_id in self._cancels else remaining
        inbound = self._channel.recv(wait) if remaining > 0 else None
        if inbound is None and time.monotonic() < deadline:
            self._drain(request_id)  # raises if it was cancelled meanwhile
            return
        if inbound is None:
            self._ring.reset()  # the peer stopped answering; its credits will not come
            self.abort(request_id, f"sender timed out waiting for {stage}")
            raise KVTimeout(request_id, stage)
        self._file(inbound.msg)
        self._drain(request_id)

    def _drain(self, request_id: str) -> None:
        """Take what already arrived without waiting; raise if this request was aborted."""
        cancel = self._cancels.get(request_id)
        if cancel is not None and cancel.is_set():
            self.abort(request_id, "the request was aborted")
            raise KVAborted(request_id, "cancelled by the sender")
        while (inbound := self._channel.recv(0)) is not None:
            self._file(inbound.msg)
        for msg in self._inbox.get(request_id, ()):
            if isinstance(msg, (Abort, Error, KVReject)):
                self._raise_if_fatal(request_id, msg)

    def _file(self, msg: Message) -> None:
        if isinstance(msg, KVCredit):
            self._ring.release_oldest(msg.request_id)  # credits come back in send order
        elif isinstance(msg, (KVGrant, KVWait, KVReject, KVAck, Abort, Error)):  # what a receiver sends
            if msg.request_id in self._inbox:  # replies to forgotten requests are dropped
                self._inbox[msg.request_id].append(msg)

    def _raise_if_fatal(self, request_id: str, msg: Message) -> None:
        error: KVTransferError | None = None
        if isinstance(msg, KVReject):
            error = KVRejected(request_id, msg.reason, msg.field)
        elif isinstance(msg, Abort):
            error = KVAborted(request_id, msg.reason)
        elif isinstance(msg, Error):
            error = KVAborted(request_id, f"{msg.code}: {msg.message}")
        if error is not None:
            self._inbox.pop(request_id, None)
            raise error


def _root(params: SamplingParams | None) -> int | None:
    """The prompt's hash chain start: its adapter's and cache salt's (protocol.block_hash)."""
    return None if params is None else cache_root_of(params.adapter, params.cache_salt)
