"""Node process options: the flags of `pdserve prefill|decode`, declared on NodeOptions and EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import uuid

from pdserve.engine.config import EngineConfig
from pdserve.protocol.addresses import advertised_host, is_loopback, key_needed
from pdserve.protocol.model_digest import model_digest
from pdserve.protocol.registry import Role
from pdserve.protocol.settings import (
    Flag,
    cluster_key_file_setting,
    flags,
    from_args,
    otlp_traces_endpoint_setting,
    redis_password_file_setting,
    setting,
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeOptions:
    role: Role  # the command: prefill, decode, or decode --colocated
    host: str = setting("127.0.0.1", "bind address (default: loopback)")
    port: int = setting(0, "control port (0: a free port)")
    kv_port: int = setting(0, "decode: KV receiver port (0: a free port)")
    # the address peers use to reach this node; None: worked out on construction
    advertise_host: str | None = setting(
        None,
        "address other nodes and the router use (default: --host, or this machine's hostname when "
        "binding 0.0.0.0)",
    )
    # None: static mode (the router is given the address)
    redis_url: str | None = setting(
        None, "Redis URL for the registry (default: $PDSERVE_REDIS)", flag="--redis"
    )
    redis_password_file: str | None = redis_password_file_setting()
    cluster_key_file: str | None = cluster_key_file_setting()
    heartbeat_interval_s: float = setting(
        0.5, "seconds between refreshes of the node's Redis record", flag="--heartbeat-interval"
    )
    heartbeat_ttl_s: float = setting(
        3.0, "seconds the Redis record outlives a silent node", flag="--heartbeat-ttl"
    )
    # Longer than the slowest engine step (a full prefill token budget): a loop that made no
    # progress for this long is stuck, and its record expires then, whatever the heartbeat thread does.
    stall_timeout_s: float = setting(
        10.0,
        "seconds without progress of the engine loop after which the node's record expires "
        "(it leaves the pool until the loop moves again); above the longest engine step",
        flag="--stall-timeout",
    )
    request_ttl_s: float = setting(
        600.0, "seconds a request may live on this node without finishing", flag="--request-ttl"
    )
    drain_timeout_s: float = setting(
        30.0, "SIGTERM: the longest wait in seconds for in-flight work before exiting", flag="--drain-timeout"
    )
    # typed as it is once constructed: None (the default) is replaced by a made-up id then
    node_id: str = setting(None, "unique id of this process (default: role-hostname-pid-random)")
    ready_file: str | None = setting(None, "write the node's addresses here (JSON) once serving")
    otlp_traces_endpoint: str | None = otlp_traces_endpoint_setting()  # protocol/tracing.py
    model_id: str  # the model's content digest (protocol.model_digest): part of the KV fingerprint

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # ValueError names a role that is none
        object.__setattr__(self, "advertise_host", advertised_host(self.host, self.advertise_host))
        if not self.node_id:
            node_id = f"{self.role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            object.__setattr__(self, "node_id", node_id)
        if not 0 < self.heartbeat_interval_s < self.heartbeat_ttl_s:
            raise ValueError("heartbeat interval must be positive and shorter than the ttl")
        if min(self.request_ttl_s, self.drain_timeout_s) <= 0:
            raise ValueError("request_ttl_s and drain_timeout_s must be positive")
        if self.stall_timeout_s < self.heartbeat_interval_s:
            raise ValueError("stall timeout must be at least the heartbeat interval")
        if not self.cluster_key_file and not is_loopback(self.host):
            raise ValueError(key_needed(f"this {self.role} node", self.host))

    @property
    def control_addr(self) -> str:
        return f"tcp://{self.host}:{self.port}"


COLOCATED = Flag(
    "--colocated",
    dest="colocated",
    nargs=0,
    value_type=None,
    default=False,
    help="prefill every request here too: registers as a colocated node, to which the router never sends KV",
)


def node_flags(command: str) -> dict[str | None, tuple[Flag, ...]]:
    """Every flag of `pdserve prefill` or `pdserve decode`, by --help section (None: the
    command's own options); launcher/env_flags.py maps PDSERVE_* variables onto the same list."""
    own = (*flags(EngineConfig, only=("model",)), *flags(NodeOptions))
    return {
        None: (*own, COLOCATED) if command == "decode" else own,
        "engine": flags(EngineConfig, exclude=("model",)),
    }


def add_node_args(parser: argparse.ArgumentParser, command: str = "prefill") -> None:
    for section, section_flags in node_flags(command).items():
        target = parser if section is None else parser.add_argument_group(section)
        for flag in section_flags:
            flag.add_to(target)
    parser.set_defaults(redis=os.environ.get("PDSERVE_REDIS"))  # as `pdserve up` and `status` do


def options_from_args(role: Role, args: argparse.Namespace) -> tuple[NodeOptions, EngineConfig]:
    node = from_args(NodeOptions, args, role=role, model_id=model_digest(args.model))
    return node, from_args(EngineConfig, args)
