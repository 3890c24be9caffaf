"""Commit the CPU KV pool's pages in bulk, a little ahead of the blocks the engine hands out.

The pool is sized from free memory but allocated lazily (``ModelRunner._empty_cache``): the OS
commits a page when a block is first written, by a page fault inside the KV write of the step
that writes it. The block manager hands out never-used blocks in ascending order, so the written
part of the pool grows from block 0 up; past the blocks committed in bulk (``settled``: the idle
commit's, or all at start-up) it reuses a freed block before it takes a never-used one, so a
fresh engine writes only as much of the pool as its work holds at once (``fresh_limit``). On the 2-core dev VM a fault on a
fresh page costs ~8 us; the default model's offline mix spent 10% of its time in the KV write,
nearly all of it faulting, and was 7-12% faster with the pool committed beforehand.

``advance(high_water)``, called before each step (after the scheduler handed out its blocks),
keeps blocks ``[0, high_water + ahead)`` committed with one ``madvise(MADV_POPULATE_WRITE)`` per
layer's K and V range: the kernel faults the range in without changing a byte, about a quarter of
the cost of taking the faults one by one. The engine's ``ahead`` is one block a sequence (what the
next decode step can add), so each step pays for about the blocks it adds: two steps' worth of
prompt blocks ahead (384 for the default model) made the first step of a fresh node commit 283 MB,
2.8 s on a VM whose first touch of a page costs ~40 us. Memory stays what the pool has used plus
``ahead`` blocks. Linux 5.14 or later; where the
call is missing or fails, pages commit as before. ``PDSERVE_KV_PREFAULT=0`` turns it off.

Committed that way, a fresh node pays for each block the first time it hands it out; when it
handed out never-used blocks for as long as the pool had them, every step of a fresh node's
first thousands of requests on that VM was about twice as slow. ``kv_commit="idle"`` (the default) also
commits the rest of the pool while the node has nothing to do: ``idle()``, which a node's
loop calls before it waits for input, lets a thread populate the next blocks in slices of at most
``SLICE_BYTES`` a call, until ``advance`` (any write the engine is about to make) stops it. The
thread runs at ``SCHED_IDLE`` priority, so it takes only CPU time no other process wants, and it
pauses while too little memory would be left (``MEMORY_RESERVE_*``). Both the thread and
``advance`` only ever raise ``committed`` to a block they have populated up to, and populating a
page twice is harmless, so they need no lock around the madvise calls.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.machine.resources import available_memory_bytes
from pdserve.engine.machine.sizing import announce

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
PAGE = mmap.PAGESIZE
SLICE_BYTES = 256 << 10  # most one madvise of the idle commit covers: a new request waits at most that
# The idle commit pauses while less would be left available than the larger of these two: a GiB,
# or a quarter of what was available when it started (the pool was sized from a share of that).
MEMORY_RESERVE_BYTES = 1 << 30
MEMORY_RESERVE_FRACTION = 0.25
MEMORY_RECHECK_S = 5.0  # how often a paused idle commit looks at the memory again


def _madvise():
    # the C library this process already has (dlopen of the program itself): find_library("c")
    # would run ldconfig in a child process at import
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def populate(caches: list[torch.Tensor], start: int, stop: int) -> int:
    """Fault in blocks ``[start, stop)`` of each block-major cache; 0, or the errno of a failure."""
    for cache in caches:
        block_bytes = cache.stride(0) * cache.element_size()
        first = cache.data_ptr() + start * block_bytes
        aligned = first - first % PAGE
        length = cache.data_ptr() + stop * block_bytes - aligned
        if length > 0 and _MADVISE(aligned, length, MADV_POPULATE_WRITE) != 0:
            return ctypes.get_errno()
    return 0


class KVPrefault:
    def __init__(
        self, caches: list[torch.Tensor], num_blocks: int, ahead: int, idle_commit: bool = False
    ) -> None:
        """caches: every layer's K and V cache, each [num_blocks, ...] block-major; ahead: blocks
        to keep committed beyond the highest handed out (a few steps' worth); idle_commit: commit
        the rest of the pool whenever ``idle()`` says the engine has nothing to do."""
        self.caches, self.num_blocks, self.ahead = caches, num_blocks, max(1, ahead)
        self.committed = 0  # blocks [0, committed) are committed
        # blocks [0, settled) were committed in bulk (idle or at start-up), not as the work needed
        # them: the block manager hands them out before reusing blocks (engine/core/block_manager.py)
        self.settled = 0
        self.errno = 0  # of a failed madvise: no more prefaulting
        self.active = (
            os.environ.get("PDSERVE_KV_PREFAULT", "1") != "0"
            and _MADVISE is not None
            and all(c.device.type == "cpu" and c.shape[0] == num_blocks for c in caches)
        )
        self.idle_commit = idle_commit and self.active
        self._idle = threading.Event()  # set: the engine writes nothing until advance() is called
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # around the bookkeeping only, never a madvise
        self._block_bytes = [c.stride(0) * c.element_size() for c in caches]  # one block, per cache
        self._host = all(c.device.type == "cpu" for c in caches)  # a GPU pool is committed whole
        self.memory_paused = False  # the idle commit waits for memory (MEMORY_RESERVE_*)
        self._reserve = MEMORY_RESERVE_BYTES  # set when the idle commit starts

    @classmethod
    def for_engine(
        cls, kv_caches: Sequence[tuple[torch.Tensor, ...]], num_blocks: int, config: EngineConfig
    ) -> KVPrefault:
        """The engine's, for its ``EngineConfig``: a step's prompt blocks are handed out before it
        commits, and ahead of them one block a sequence (what the next decode step can add)."""
        caches = [cache for layer in kv_caches for cache in layer]
        prefault = cls(caches, num_blocks, config.max_num_seqs, config.kv_commit == "idle")
        if config.kv_commit == "startup":
            announce(prefault.commit_all())
        return prefault

    def num_committed(self, high_water: int) -> int:
        """Blocks whose memory is committed: all of a GPU pool; of a CPU pool at least those below
        the block manager's ``high_water`` (written once), where no madvise tells more."""
        return max(self.committed, high_water) if self._host else self.num_blocks

    def fresh_limit(self) -> int:
        """The block manager's ``fresh_limit``: never-used blocks below it are handed out before
        reused ones. All of a GPU pool; of a CPU pool what was committed in bulk, so that a CPU
        engine's work grows the pool (and pays its first-touch faults) only where it must."""
        return self.settled if self._host else self.num_blocks

    def idle(self) -> None:
        """The engine has nothing to write until the next ``advance``: commit the pool meanwhile."""
        if not self.idle_commit or self.committed >= self.num_blocks or self._closed.is_set():
            return
        self._idle.set()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._commit_while_idle, name="kv-idle-commit", daemon=True
            )
            self._thread.start()

    def _commit_while_idle(self) -> None:
        _lower_priority()
        self._reserve = max(
            MEMORY_RESERVE_BYTES, int((available_memory_bytes() or 0) * MEMORY_RESERVE_FRACTION)
        )
        per_call = max(1, SLICE_BYTES // max(self._block_bytes))
        while self.active and self.committed < self.num_blocks and not self._closed.is_set():
            if not self._idle.wait(timeout=1.0) or self._closed.is_set():
                continue
            start = self.committed
            stop = min(self.num_blocks, start + per_call)
            if not self._room_for(stop - start):
                self.memory_paused = True
                self._closed.wait(MEMORY_RECHECK_S)
                continue
            self.memory_paused = False
            for cache in self.caches:
                if not self._idle.is_set():  # the engine is about to write: leave the rest for later
                    break
                if errno := populate([cache], start, stop):
                    self._fail(errno)
                    return
            else:
                self._raise_to(stop)
                self.settled = max(self.settled, stop)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the idle commit (it lets go of the pool); the lazy prefault goes on."""
        self._closed.set()
        self._idle.set()  # wakes it
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._idle.clear()

    def _room_for(self, num_blocks: int) -> bool:
        available = available_memory_bytes()
        need = num_blocks * sum(self._block_bytes)
        return available is None or available - need >= self._reserve

    def _raise_to(self, stop: int) -> None:
        with self._lock:
            self.committed = max(self.committed, stop)

    def _fail(self, errno: int) -> None:
        self.active, self.errno = False, errno
        log.info("KV pool: no bulk prefault (madvise errno %d); pages commit when first written", errno)

    def advance(self, high_water: int) -> None:
        """The engine is about to write blocks below ``high_water``: commit up to ``ahead`` past it."""
        if self.idle_commit:
            self._idle.clear()
        if (
            not self.active
            or self.committed >= self.num_blocks
            or high_water + self.ahead // 2 <= self.committed
        ):
            return
        stop = min(self.num_blocks, high_water + self.ahead)
        if errno := populate(self.caches, self.committed, stop):
            self._fail(errno)
            return
        self._raise_to(stop)

    def commit_all(self) -> str:
        """The whole pool now (``kv_commit="startup"``); what it did, for the start-up line. Where
        the bulk call is unavailable, every page is written once instead (the pool is still zeros)."""
        start = time.perf_counter()
        size = sum(c.numel() * c.element_size() for c in self.caches)
        if self.active and populate(self.caches, 0, self.num_blocks) == 0:
            how = "madvise"
        else:
            for cache in self.caches:
                cache.zero_()
            how = "zero-fill"
        self.committed = self.settled = self.num_blocks
        return f"KV pool committed at start-up: {size / (1 << 20):.0f} MiB in {time.perf_counter() - start:.1f} s ({how})"


def _lower_priority() -> None:
    """This thread runs only on CPU time no other thread wants: SCHED_IDLE, else nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread (Linux)
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
