"""Ships held prompt KV to decode nodes: one worker thread and one KVSender per decode node.

The engine loop hands over a ``Shipment`` (the request's block table stays held in the
engine until the worker reports back), so compute of other requests overlaps the transfer.
Queues are bounded; a full queue refuses the shipment and the request fails cleanly.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import torch

from kv_transfer.errors import KVTransferError
from kv_transfer.messages import CacheRef, KVFingerprint, TokenLogprobs
from kv_transfer.sender import KVSender, SenderConfig, TransferStats


@dataclasses.dataclass(frozen=True, slots=True)
class Shipment:
    request_id: str
    decode_addr: str  # the decode node's KV receiver
    token_ids: tuple[int, ...]  # the prompt
    block_table: tuple[int, ...]  # this node's blocks holding the prompt's KV (held until the outcome)
    first_token: int  # sampled here
    num_cached_tokens: int  # usage: prompt tokens from this node's prefix cache
    sampling_params: dict  # for the decode node's sequence
    request_meta: dict  # opaque to kv_transfer: reply address, ttl, timings
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked for logprobs


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    request_id: str
    stats: TransferStats | None  # None on failure
    error: str | None  # why it failed


class Shipper:
    def __init__(self, fingerprint: KVFingerprint, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                 config: SenderConfig | None = None, queue_limit: int = 256, max_peers: int = 64,
                 cache_ref: CacheRef | None = None) -> None:
        self.cache_ref = cache_ref  # the caches in shared memory: offered for one-copy transfers
        self.fingerprint = fingerprint
        self.key_caches, self.value_caches = key_caches, value_caches
        self.config = config or SenderConfig()
        self.queue_limit = queue_limit
        self.max_peers = max_peers
        self.outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._queues: dict[str, queue.Queue[Shipment | None]] = {}
        self._threads: list[threading.Thread] = []
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, shipment: Shipment) -> bool:
        """Queue a transfer; False when the decode node's queue (or the peer table) is full."""
        q = self._queues.get(shipment.decode_addr)
        if q is None:
            if len(self._queues) >= self.max_peers:
                return False
            q = self._queues[shipment.decode_addr] = queue.Queue(self.queue_limit)
            thread = threading.Thread(target=self._work, args=(shipment.decode_addr, q), daemon=True,
                                      name=f"ship-{shipment.decode_addr}")
            thread.start()
            self._threads.append(thread)
        try:
            q.put_nowait(shipment)
            return True
        except queue.Full:
            return False

    def cancel(self, request_id: str) -> None:
        """Skip a queued shipment (one already sending runs to its end or deadline)."""
        with self._lock:
            self._cancelled.add(request_id)

    @property
    def num_pending(self) -> int:
        return sum(q.qsize() for q in self._queues.values())

    def close(self, timeout_s: float = 5.0) -> None:
        for q in self._queues.values():
            try:
                q.put_nowait(None)
            except queue.Full:
                pass
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _work(self, addr: str, q: queue.Queue) -> None:
        sender = KVSender(addr, self.fingerprint, self.config, cache_ref=self.cache_ref)
        try:
            while (job := q.get()) is not None:
                with self._lock:
                    cancelled = job.request_id in self._cancelled
                    self._cancelled.discard(job.request_id)
                if cancelled:
                    self.outcomes.put(Outcome(job.request_id, None, "aborted"))
                    continue
                self.outcomes.put(self._ship(sender, job))
        finally:
            sender.close()

    def _ship(self, sender: KVSender, job: Shipment) -> Outcome:
        try:
            stats = sender.transfer(job.request_id, job.token_ids, self.key_caches, self.value_caches,
                                    job.block_table, job.first_token, job.num_cached_tokens,
                                    job.sampling_params, job.request_meta, job.first_logprobs)
            return Outcome(job.request_id, stats, None)
        except KVTransferError as exc:
            return Outcome(job.request_id, None, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug must fail the request, not kill the worker
            return Outcome(job.request_id, None, f"unexpected {type(exc).__name__}: {exc}")
