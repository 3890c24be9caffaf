"""Which address a process tells its peers, given the address it binds."""

from __future__ import annotations

import ipaddress
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


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a socket on this machine (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or a wildcard: reachable from elsewhere


def key_needed(what: str, host: str) -> str:
    """Why a process that binds ``host`` beyond loopback must not start without a cluster key."""
    return (
        f"{what} binds {host}, beyond loopback, without a cluster key: anyone who reaches it could "
        "join or feed the cluster. Give every process of the cluster the same key with "
        "--cluster-key-file PATH (PDSERVE_CLUSTER_KEY_FILE in a container); make one with "
        "`python -c 'import secrets; print(secrets.token_hex(32))' > PATH`, kept out of images"
    )
