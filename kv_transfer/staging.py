"""Sender-side staging ring: where chunks are packed before they travel, sized by the credit window.

    ring  [ ....... | chunk 3 | chunk 4 | chunk 5 | ........ ]
                    ^ oldest unacknowledged       ^ head: next chunk goes here (or wraps to 0)

A chunk's slot is reused only after the receiver's KVCredit for it (credits come back in send
order), so the ring is the sender's only chunk memory and in-flight bytes never exceed it.
Reusing the same pages avoids the page faults of a fresh allocation per chunk. When the ring is
shared memory (a memfd, made only for a peer whose address is on this machine) and the receiver
runs on the same host, chunks do not travel over the socket at all: the header names the slot
offset and the receiver reads the slot (still checksummed). No shared memory to be had: a private
ring, a log line, and the socket path.

When the KV cache is in device memory the ring is the platform's host buffer (pinned on CUDA, so
the device-to-host copies into it are asynchronous) and never shared: chunks go on the socket.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import mmap
import os
import socket
from collections import deque

import torch

from pdserve.kv_transfer import memfd
from pdserve.kv_transfer.messages import RingRef
from pdserve.kv_transfer.tensors import DevicePlatform

log = logging.getLogger(__name__)


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
    request_id: str  # whose chunk: a credit frees the oldest slot only when it is that request's


class StagingRing:
    def __init__(self, num_bytes: int, shared: bool, platform: DevicePlatform | None = None) -> None:
        """platform: where the cache lives (None: host memory); one that keeps it apart from host
        memory gets a private ring from ``platform.host_empty`` (pinned), whatever ``shared`` says."""
        on_device = platform is not None and platform.separate_host
        self.ref: RingRef | None = None  # set when the ring is shared memory
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        if shared and not on_device:
            try:
                self._fd, self._map = memfd.create("pdserve-kv-ring", num_bytes)
                self.ref = RingRef(pid=os.getpid(), fd=self._fd, num_bytes=num_bytes)
            except OSError as exc:
                log.warning("staging ring in private memory, chunks go over the socket: %s", exc)
        self.buffer = (
            torch.frombuffer(self._map, dtype=torch.uint8)
            if self._map is not None
            else platform.host_empty((num_bytes,), torch.uint8)
            if platform is not None and on_device
            else torch.empty(num_bytes, dtype=torch.uint8)
        )  # [num_bytes] uint8
        self.buffer.fill_(0)  # touch every page now, not on the first transfer
        self._in_flight: deque[_Slot] = deque()

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    @property
    def in_flight_bytes(self) -> int:
        return sum(s.size for s in self._in_flight)

    def try_alloc(self, size: int, request_id: str) -> int | None:
        """Offset of a free slot of ``size`` bytes, or None until credits free one."""
        if size > self.capacity:
            raise ValueError(f"chunk of {size} bytes exceeds the staging ring ({self.capacity})")
        offset: int | None
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
            self._in_flight.append(_Slot(offset, size, request_id))
        return offset

    def release_oldest(self, request_id: str) -> bool:
        """A credit of ``request_id`` came back: the oldest chunk's slot is free, if it is that
        request's. Credits come in send order, so any other credit is a late one of a request
        whose slots a ``reset`` already forgot, and must not free the next request's slot."""
        if self._in_flight and self._in_flight[0].request_id == request_id:
            self._in_flight.popleft()
            return True
        return False

    def reset(self) -> None:
        """Forget every in-flight slot (the peer stopped answering; checksums catch any overlap)."""
        self._in_flight.clear()

    def close(self) -> None:
        if self._map is not None:
            assert self._fd is not None  # made with the map
            del self.buffer
            self._map.close()
            os.close(self._fd)
            self._map, self._fd, self.ref = None, None, None


def attach(ref: RingRef) -> mmap.mmap:
    """Map a sender's ring on the receiver, read-only; the sender stays its owner."""
    return memfd.attach(ref.pid, ref.fd, ref.num_bytes)


def peer_is_local(address: str) -> bool:
    """Whether a ZeroMQ address names this machine (loopback, ipc, or an address of our own
    interfaces): only then can the peer map our memory, so only then is a shared ring worth making."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    # an IPv6 address is (int, bytes), not a host string, where Python was built without IPv6
    return any(_is_own_address(family, addr[0]) for family, *_, addr in infos if isinstance(addr[0], str))


def _is_own_address(family: int, ip: str) -> bool:
    if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        return True
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((ip, 0))  # binding works only to an address of one of our interfaces
        return True
    except OSError:
        return False
