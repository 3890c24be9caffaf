"""Ships held prompt KV to decode nodes: one worker thread and one KVSender per decode node.

The engine loop hands over a ``Shipment`` (the request's block table stays held in the
engine until the worker reports back), so compute of other requests overlaps the transfer. The
worker reports ``Granted`` once the decode node holds blocks, then the ``Outcome``.
Queues are bounded; a full queue refuses the shipment and the request fails cleanly. A cancelled
shipment is skipped if queued and stopped if sending (the decode node is told); either way its
outcome comes, and nothing of it is kept after that.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable

import torch

from pdserve.engine.executor.platform import Platform
from pdserve.kv_transfer.errors import KVRejected, KVTimeout, KVTransferError
from pdserve.kv_transfer.messages import CacheRef, KVFingerprint, KVShipment
from pdserve.kv_transfer.sender import KVSender, SenderConfig, TransferStats
from pdserve.protocol.channel import PushChannels
from pdserve.protocol.channel_auth import ChannelAuth
from pdserve.protocol.messages import TokenChunk

_MAX_REPLY_CHANNELS = 16  # routers one worker talks back to at once (LRU beyond)


@dataclasses.dataclass(frozen=True, slots=True)
class FirstToken:
    """The request's first token, for the router once the decode node has granted blocks."""

    reply_addr: str  # the router's reply address
    chunk: TokenChunk  # TokenChunk(is_first=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Shipment:
    """A request's KV for one decode node: the transfer's own shipment, where it goes, and the
    first token to report once blocks are granted."""

    kv: KVShipment  # what the sender ships (its blocks are held until the outcome)
    decode_addr: str  # the decode node's KV receiver
    first: FirstToken | None = None  # sent to the router at the grant; None: the caller reports it

    @property
    def request_id(self) -> str:
        return self.kv.request_id


@dataclasses.dataclass(frozen=True, slots=True)
class Granted:
    """The decode node holds blocks for the request: its first token may go to the router."""

    request_id: str
    first_token_sent: bool = True  # False: the shipment had no first token to report (a beam search)


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    request_id: str
    stats: TransferStats | None  # None on failure
    error: str | None  # why it failed
    rejected: bool = False  # the decode node refused the reservation (draining, or no room in time)
    first_token_sent: bool = False  # the worker sent the shipment's first token to the router
    started_at: float | None = None  # wall clock when KVReserve went out; None: never sent (spans)
    granted_at: float | None = None  # wall clock when the decode node granted blocks


@dataclasses.dataclass(slots=True)
class _Peer:
    """One decode node's worker: its queue and whether it is sending right now."""

    queue: queue.Queue[Shipment | None]
    busy: bool = False  # a transfer is running (the queue may be empty meanwhile)


class Shipper:
    """Peers come and go (scaling, restarts): a worker with nothing to do for ``idle_timeout_s``
    leaves the peer table, and a full table makes room by retiring an idle worker."""

    def __init__(
        self,
        fingerprint: KVFingerprint,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        config: SenderConfig | None = None,
        queue_limit: int = 256,
        max_peers: int = 64,
        cache_ref: CacheRef | None = None,
        idle_timeout_s: float = 60.0,
        log: Callable[..., None] | None = None,
        platform: Platform | None = None,
        auth: ChannelAuth | None = None,
    ) -> None:
        self.auth = auth  # the cluster's CURVE, for the workers' sockets
        self.cache_ref = cache_ref  # the caches in shared memory: offered for one-copy transfers
        self.platform = platform or Platform()  # where the caches live: the engine's
        self.fingerprint = fingerprint
        self.key_caches, self.value_caches = key_caches, value_caches
        self.config = config or SenderConfig()
        self.queue_limit = queue_limit
        self.max_peers = max_peers
        self.idle_timeout_s = idle_timeout_s
        self._log = log or (lambda *args, **fields: None)  # the node's event log (thread-safe)
        self.outcomes: queue.SimpleQueue[Granted | Outcome] = queue.SimpleQueue()  # in order per request
        self._peers: dict[str, _Peer] = {}  # decode KV address -> its worker
        self._threads: list[threading.Thread] = []
        self._cancels: dict[str, threading.Event] = {}  # request id -> its cancel flag, until its outcome
        self._lock = threading.Lock()  # guards the peer table and the flags

    def submit(self, shipment: Shipment) -> bool:
        """Queue a transfer; False when the decode node's queue (or the peer table) is full."""
        with self._lock:
            peer = self._peers.get(shipment.decode_addr)
            if peer is None:
                if len(self._peers) >= self.max_peers and not self._retire_an_idle_peer():
                    return False
                peer = self._start_peer(shipment.decode_addr)
            try:
                peer.queue.put_nowait(shipment)
            except queue.Full:
                return False
            self._cancels[shipment.request_id] = threading.Event()
            return True

    def _start_peer(self, addr: str) -> _Peer:
        peer = self._peers[addr] = _Peer(queue.Queue(self.queue_limit))
        thread = threading.Thread(target=self._work, args=(addr, peer), daemon=True, name=f"ship-{addr}")
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        return peer

    def _retire_an_idle_peer(self) -> bool:
        """With the lock held: drop one worker with nothing queued or running (it exits)."""
        addr = next((a for a, p in self._peers.items() if not p.busy and p.queue.empty()), None)
        if addr is None:
            return False
        self._peers.pop(addr).queue.put_nowait(None)
        return True

    def cancel(self, request_id: str) -> None:
        """Skip the shipment if queued, stop it if sending; its outcome still comes (it says
        when the blocks are free). Unknown ids are ignored: nothing is remembered for them."""
        with self._lock:
            flag = self._cancels.get(request_id)
        if flag is not None:
            flag.set()

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            try:
                peer.queue.put_nowait(None)
            except queue.Full:
                pass
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _next_job(self, addr: str, peer: _Peer) -> Shipment | None:
        """The next shipment to send, or None when this worker should exit."""
        while True:
            try:
                job = peer.queue.get(timeout=self.idle_timeout_s)
            except queue.Empty:
                with self._lock:  # nothing can be queued for us while we decide
                    if peer.queue.empty() and self._peers.get(addr) is peer:
                        del self._peers[addr]
                        return None
                continue
            if job is None:
                return None
            with self._lock:
                if not self._cancels[job.request_id].is_set():
                    peer.busy = True
                    return job
            self._report(Outcome(job.request_id, None, "aborted"))

    def _report(self, outcome: Outcome) -> None:
        with self._lock:
            del self._cancels[outcome.request_id]
        self.outcomes.put(outcome)

    def _work(self, addr: str, peer: _Peer) -> None:
        self.platform.activate()  # this thread's copies go to the engine's device, not device 0
        sender = KVSender(
            addr,
            self.fingerprint,
            self.config,
            cache_ref=self.cache_ref,
            platform=self.platform,
            auth=self.auth,
        )
        replies = PushChannels(_MAX_REPLY_CHANNELS, self.auth)  # this thread's own
        try:
            while (job := self._next_job(addr, peer)) is not None:
                self._report(self._ship(sender, job, replies))
                peer.busy = False
        finally:
            sender.close()
            replies.close()

    def _granted(self, job: Shipment, replies: PushChannels) -> None:
        """Blocks are held on the decode node: the first token goes to the router now."""
        if job.first is not None:
            if replies.send(job.first.reply_addr, job.first.chunk):
                self._log("first_token_sent", job.request_id, cached_tokens=job.kv.num_cached_tokens)
            else:
                self._log("reply_dropped", job.request_id, reply_addr=job.first.reply_addr)
        self.outcomes.put(Granted(job.request_id, job.first is not None))

    def _ship(self, sender: KVSender, job: Shipment, replies: PushChannels) -> Outcome:
        granted: list[float] = []  # when the grant came (the node's spans)
        started = time.time()

        def on_granted() -> None:
            granted.append(time.time())
            self._granted(job, replies)

        def outcome(stats: TransferStats | None, error: str | None, **fields) -> Outcome:
            at = granted[0] if granted else None
            return Outcome(job.request_id, stats, error, started_at=started, granted_at=at, **fields)

        try:
            with self._lock:
                cancel = self._cancels[job.request_id]
            stats = sender.ship(job.kv, self.key_caches, self.value_caches, on_granted, cancel)
            return outcome(stats, None, first_token_sent=job.first is not None)
        except KVTransferError as exc:
            refused = isinstance(exc, KVRejected) or (isinstance(exc, KVTimeout) and exc.stage == "grant")
            return outcome(
                None,
                f"{type(exc).__name__}: {exc}",
                rejected=refused and not granted,
                first_token_sent=bool(granted) and job.first is not None,
            )
        except Exception as exc:  # a bug must fail the request, not kill the worker
            return outcome(
                None,
                f"unexpected {type(exc).__name__}: {exc}",
                first_token_sent=bool(granted) and job.first is not None,
            )
