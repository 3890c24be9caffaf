"""What the node's KV connector asks of its offload tiers: is a block there, fetch these ahead of
their request's admission, keep these. A device pool may have a host tier in front
(engine/offload/host.py); the disk does its I/O (engine/offload/disk.py) on two background
threads, so no step waits for it:

    save:      a finished or preempted sequence's full blocks, copied out of the pool by the
               engine thread ─► the host tier, whose evictions go on to the disk, where there
               is one; or ─► pending (served from memory, bounded by ``max_pending_bytes``:
               past it a block is not kept) ─► the writer thread ─► the folder
    prefetch:  a waiting request's blocks past the pool's hit ─► the reader thread loads and
               checks them ─► staged, until the request is admitted (its blocks are filled from
               them before the step computes) or its deadline passes (then it recomputes)

A block being written is served from its pending copy, never from a half-written file; a block the
reader has staged is a copy, so nothing the tier does pins a pool block.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

import torch

from pdserve.engine.offload.disk import DiskCounts, DiskTier, StoredBlock
from pdserve.engine.offload.host import HostTier

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 64 << 20  # blocks copied out of the pool and not yet on disk
PREFETCH_TIMEOUT_S = 5.0  # a request waits this long for its blocks, then recomputes them
MAX_QUEUED_PREFETCHES = 256  # prefetches waiting for the reader (past it: recompute)


@dataclasses.dataclass(slots=True)
class Prefetch:
    """One waiting sequence's blocks on their way from the tier."""

    first_block: int  # the sequence's block index the run starts at
    entries: list[tuple[int, tuple[int, ...]]]  # (block hash, token ids), in order
    deadline: float  # time.monotonic() past which the sequence stops waiting for it
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    # filled by the reader: the leading entries' payloads that loaded and checked (a failure ends it)
    payloads: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.done.is_set() or time.monotonic() > self.deadline


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadStats:
    """The tier's counts since start, for a node's status record and /metrics."""

    disk_blocks: int  # blocks in the folder now
    disk_bytes: int  # their bytes, within the budget
    stored_blocks: int  # written
    loaded_blocks: int  # read back into the pool (hits)
    skipped_saves: int  # not kept: the pending copies were at their bound
    corrupt_blocks: int  # failed a check: deleted and recomputed, never served
    timed_out_prefetches: int  # a request stopped waiting and recomputed
    evicted_blocks: int  # removed for the folder's budget
    host_blocks: int  # blocks in the host tier now (a device pool's; 0 without one)
    host_bytes: int  # their bytes, within its budget
    load_us: int  # microseconds the reader spent loading and checking blocks (its speed: a router's)
    read_blocks: int  # blocks the reader loaded in that time

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class KVOffload:
    def __init__(
        self,
        disk: DiskTier | None,
        host: HostTier | None = None,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        prefetch_timeout_s: float = PREFETCH_TIMEOUT_S,
    ) -> None:
        assert disk is not None or host is not None, "an offload tier needs a folder or host memory"
        self.disk, self.host = disk, host
        self.max_pending_bytes = max_pending_bytes
        self.prefetch_timeout_s = prefetch_timeout_s
        self._lock = threading.Lock()
        self._pending: dict[int, StoredBlock] = {}  # block hash -> its copy, until it is on disk
        self._pending_bytes = 0
        self._saves: queue.SimpleQueue[StoredBlock | None] = queue.SimpleQueue()
        self._prefetches: queue.Queue[Prefetch | None] = queue.Queue(MAX_QUEUED_PREFETCHES)
        self.skipped_saves = 0
        self.timed_out = 0
        self.loaded = 0
        self.load_seconds = 0.0  # the reader's time loading (and checking) blocks
        self.read_blocks = 0  # ... and the blocks it read in it
        self._threads = [
            threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True),
            threading.Thread(target=self._read_loop, name="kv-offload-reader", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ the engine thread's
    def contains(self, block_hash: int) -> bool:
        with self._lock:
            if block_hash in self._pending:
                return True
        return (self.host is not None and block_hash in self.host) or (
            self.disk is not None and block_hash in self.disk
        )

    def prefetch(self, first_block: int, entries: list[tuple[int, tuple[int, ...]]]) -> Prefetch | None:
        """Start loading ``entries`` (consecutive blocks from ``first_block``); None when the
        reader's queue is full (the request recomputes them)."""
        job = Prefetch(first_block, entries, time.monotonic() + self.prefetch_timeout_s)
        try:
            self._prefetches.put_nowait(job)
        except queue.Full:
            return None
        return job

    def save(self, blocks: list[StoredBlock]) -> None:
        """Keep these blocks (copies): in the host tier, whose evictions go to the disk, or served
        from memory at once and written in the background. Past the bound on pending bytes a
        block is not kept (counted), and nothing waits."""
        if self.host is not None:
            blocks = [old for block in blocks for old in self.host.put(block)]  # its evictions
            if self.disk is None:
                return
        for block in blocks:
            size = block.payload.numel() * block.payload.element_size()
            with self._lock:
                if block.block_hash in self._pending:
                    continue
                if self._pending_bytes + size > self.max_pending_bytes:
                    self.skipped_saves += 1
                    continue
                self._pending[block.block_hash] = block
                self._pending_bytes += size
            self._saves.put(block)

    def loaded_into_pool(self, prefetch: Prefetch, num_blocks: int) -> None:
        """``num_blocks`` of the prefetch were used: their recency is touched (once per request)."""
        self.loaded += num_blocks
        used = [h for h, _ in prefetch.entries[:num_blocks]]
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.touch(used)

    def note_timed_out(self) -> None:
        self.timed_out += 1

    def stats(self) -> OffloadStats:
        c = self.disk.counts if self.disk is not None else DiskCounts()
        return OffloadStats(
            disk_blocks=0 if self.disk is None else self.disk.num_blocks,
            disk_bytes=0 if self.disk is None else self.disk.num_bytes,
            stored_blocks=c.stored,
            loaded_blocks=self.loaded,
            skipped_saves=self.skipped_saves,
            corrupt_blocks=c.corrupt,
            timed_out_prefetches=self.timed_out,
            evicted_blocks=c.evicted,
            load_us=int(self.load_seconds * 1e6),
            read_blocks=self.read_blocks,
            host_blocks=0 if self.host is None else self.host.num_blocks,
            host_bytes=0 if self.host is None else self.host.num_bytes,
        )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every pending block is on disk (tests, and a node that stops); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.005)
        return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is pending (within ``timeout_s``), stop the threads, let go of the folder."""
        self.flush(timeout_s)
        self._saves.put(None)
        try:
            self._prefetches.put(None, timeout=1.0)
        except queue.Full:
            pass
        for thread in self._threads:
            thread.join(timeout=2.0)
        if self.disk is not None:
            self.disk.close()

    # ------------------------------------------------------------------ background threads
    def _write_loop(self) -> None:
        while (block := self._saves.get()) is not None:
            assert self.disk is not None, "only a disk tier queues writes"
            try:
                self.disk.store(block)
            except OSError as exc:  # a full or failing disk: the block is simply not kept
                log.warning("kv offload: storing a block failed: %s", exc)
            with self._lock:
                self._pending.pop(block.block_hash, None)
                self._pending_bytes -= block.payload.numel() * block.payload.element_size()

    def _read_loop(self) -> None:
        while (job := self._prefetches.get()) is not None:
            for block_hash, tokens in job.entries:
                if time.monotonic() > job.deadline:
                    break
                payload = self._lookup(block_hash, tokens)
                if payload is None:
                    break
                job.payloads.append(payload)
            job.done.set()

    def _lookup(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """A block's payload from the nearest tier that holds it: host, pending, disk."""
        payload = None if self.host is None else self.host.get(block_hash, tokens)
        if payload is not None:
            return payload
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None and pending.token_ids == tokens:
            return pending.payload
        return None if self.disk is None else self._load(block_hash, tokens)

    def _load(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        assert self.disk is not None
        start = time.perf_counter()
        try:
            payload = self.disk.load(block_hash, tokens)
        except OSError as exc:
            log.warning("kv offload: loading a block failed: %s", exc)
            return None
        self.load_seconds += time.perf_counter() - start
        self.read_blocks += payload is not None
        return payload
