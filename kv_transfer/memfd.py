"""Anonymous shared memory for same-host peers: a memfd, its pages reserved up front.

A memfd has no name in /dev/shm, so it is not bound by that mount's size (64 MB in a default
Docker container) and nothing leaks when its process dies, even by kill -9. A peer maps it read-only
through ``/proc/<pid>/fd/<fd>``; one in another PID namespace or under another user cannot, and
takes the socket path instead.
"""

from __future__ import annotations

import mmap
import os


def create(name: str, num_bytes: int) -> tuple[int, mmap.mmap]:
    """(fd, writable mapping) of ``num_bytes`` of shared memory. The pages are allocated now, so a
    shortage is an OSError here and never a SIGBUS on first touch later."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
        return fd, mmap.mmap(fd, num_bytes)
    except BaseException:
        os.close(fd)
        raise


def attach(pid: int, fd: int, num_bytes: int) -> mmap.mmap:
    """A read-only mapping of a peer's memfd; OSError when it cannot be opened or its size differs."""
    peer_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    try:
        size = os.fstat(peer_fd).st_size
        if size != num_bytes:
            raise OSError(f"peer memory is {size} bytes, expected {num_bytes}")
        return mmap.mmap(peer_fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(peer_fd)


def identity(pid: int, fd: int) -> tuple[int, int]:
    """(device, inode) of the file a peer's descriptor names now; OSError when it cannot be seen.
    A (pid, fd) pair alone does not name one memfd for ever: a process that closes one and makes
    another often gets the same descriptor number back."""
    st = os.stat(f"/proc/{pid}/fd/{fd}")
    return st.st_dev, st.st_ino
