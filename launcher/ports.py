"""Free TCP ports for servers this machine starts, chosen where no other socket will be handed them.

Asking the kernel for port 0 and closing the socket leaves a race: the port goes back to the
ephemeral range, and any outgoing connection or port-0 bind (a ZeroMQ socket, an HTTP client) may
take it before the server binds it. Ports below that range are never assigned by the kernel, so a
port chosen there, checked free, stays free until a server this machine starts asks for it.

``PDSERVE_PORT_RANGE=LOW-HIGH`` (inclusive) names the span to choose from instead: for a firewall
that opens only some ports, or for two test runs on one machine that must never pick alike
(tests/conftest.py gives each pytest-xdist worker its own slice).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import socket

_RANGE_FILE = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
RANGE_ENV = "PDSERVE_PORT_RANGE"
_SPAN = 12000  # ports chosen from the span just below the ephemeral range
_handed_out: set[int] = set()  # never the same port to two callers in this process


def _configured() -> range | None:
    """The span PDSERVE_PORT_RANGE names, or None when unset; a malformed one is an error."""
    value = os.environ.get(RANGE_ENV, "").strip()
    if not value:
        return None
    low, sep, high = value.partition("-")
    try:
        span = range(int(low), int(high) + 1)
    except ValueError:
        span = range(0)
    if not sep or not span or span.start < 1 or span.stop > 65536:
        raise ValueError(f"{RANGE_ENV}={value!r}: expected LOW-HIGH, two ports with LOW <= HIGH")
    return span


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
    machine says what that range is (else the kernel's choice); within PDSERVE_PORT_RANGE when that
    is set, and never outside it."""
    configured = _configured()
    candidates = configured if configured is not None else _below_ephemeral()
    if candidates is not None:
        for _ in range(200):
            port = random.choice(candidates)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    if configured is not None:
        raise OSError(f"no free port found in {RANGE_ENV}={configured.start}-{configured.stop - 1}")
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
