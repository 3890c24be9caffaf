"""Which address a process tells its peers, given the address it binds."""

from __future__ import annotations

import socket

WILDCARD_HOSTS = ("0.0.0.0", "::", "*")


def advertised_host(bind_host: str, advertise_host: str | None = None) -> str:
    """``advertise_host`` when given; else the bind host, or this machine's hostname when binding
    every interface (a container's hostname resolves for its peers on the compose network)."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if bind_host in WILDCARD_HOSTS else bind_host


def zmq_host(host: str) -> str:
    """A host as it goes into a ZeroMQ tcp:// endpoint (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
