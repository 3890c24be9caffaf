"""Free TCP ports for servers this machine starts, chosen where no other socket will be handed them.

Asking the kernel for port 0 and closing the socket leaves a race: the port goes back to the
ephemeral range, and any outgoing connection or port-0 bind (a ZeroMQ socket, an HTTP client) may
take it before the server binds it. Ports below that range are never assigned by the kernel, so a
port chosen there, checked free, stays free until a server this machine starts asks for it.
"""

from __future__ import annotations

import contextlib
import pathlib
import random
import socket

_RANGE_FILE = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 12000  # ports chosen from the span just below the ephemeral range
_handed_out: set[int] = set()  # never the same port to two callers in this process


def _below_ephemeral() -> range | None:
    with contextlib.suppress(OSError, ValueError):
        low = int(_RANGE_FILE.read_text().split()[0])
        if low - _SPAN >= 1024:
            return range(low - _SPAN, low)
    return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on, outside the kernel's ephemeral range where the
    machine says what that range is (else the kernel's choice)."""
    candidates = _below_ephemeral()
    if candidates is not None:
        for _ in range(200):
            port = random.choice(candidates)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
