"""Sender-side staging ring: where chunks are packed before they travel, sized by the credit window.

    ring  [ ....... | chunk 3 | chunk 4 | chunk 5 | ........ ]
                    ^ oldest unacknowledged       ^ head: next chunk goes here (or wraps to 0)

A chunk's slot is reused only after the receiver's KVCredit for it (credits come back in send
order), so the ring is the sender's only chunk memory and in-flight bytes never exceed it.
Reusing the same pages avoids the page faults of a fresh allocation per chunk. When the ring is
shared memory and the receiver runs on the same host, chunks do not travel over the socket at
all: the header names the slot offset and the receiver reads the slot (still checksummed).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import socket
import uuid
from collections import deque
from multiprocessing import shared_memory

import torch

SHM_PREFIX = "pdserve-kv-"


def host_id() -> str:
    """Same value in every process of one host (boot) only: shared memory is offered on a match."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


@dataclasses.dataclass(slots=True)
class _Slot:
    offset: int
    size: int


class StagingRing:
    def __init__(self, num_bytes: int, shared: bool) -> None:
        self.shm = (
            shared_memory.SharedMemory(SHM_PREFIX + uuid.uuid4().hex, True, num_bytes) if shared else None
        )
        raw = (
            torch.frombuffer(self.shm.buf, dtype=torch.uint8)
            if self.shm
            else torch.empty(num_bytes, dtype=torch.uint8)
        )
        self.buffer = raw  # [num_bytes] uint8
        self.buffer.fill_(0)  # touch every page now, not on the first transfer
        self._in_flight: deque[_Slot] = deque()

    @property
    def shm_name(self) -> str | None:
        return self.shm.name if self.shm else None

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    @property
    def in_flight_bytes(self) -> int:
        return sum(s.size for s in self._in_flight)

    def try_alloc(self, size: int) -> int | None:
        """Offset of a free slot of ``size`` bytes, or None until credits free one."""
        if size > self.capacity:
            raise ValueError(f"chunk of {size} bytes exceeds the staging ring ({self.capacity})")
        if not self._in_flight:
            offset = 0
        else:
            first, last = self._in_flight[0], self._in_flight[-1]
            head = last.offset + last.size
            wrapped = last.offset < first.offset  # free space is [head, first) only
            if wrapped:
                offset = head if head + size <= first.offset else None
            elif head + size <= self.capacity:
                offset = head
            else:
                offset = 0 if size <= first.offset else None
        if offset is not None:
            self._in_flight.append(_Slot(offset, size))
        return offset

    def release_oldest(self) -> None:
        """A credit came back: the oldest chunk's slot is free."""
        if self._in_flight:
            self._in_flight.popleft()

    def reset(self) -> None:
        """Forget every in-flight slot (the peer stopped answering; checksums catch any overlap)."""
        self._in_flight.clear()

    def close(self) -> None:
        if self.shm is not None:
            del self.buffer
            self.shm.close()
            self.shm.unlink()
            self.shm = None


def attach(name: str) -> mmap.mmap:
    """Map a sender's ring on the receiver (Linux /dev/shm); the sender stays its owner and unlinks it.

    Not through ``SharedMemory(name)``: on Python < 3.13 that registers the segment with this
    process's resource tracker, which would unlink the sender's ring when we exit.
    """
    if not name.startswith(SHM_PREFIX) or "/" in name:
        raise ValueError(f"not a kv staging segment: {name!r}")
    fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
