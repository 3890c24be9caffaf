"""Node process options: CLI flags map one to one onto NodeOptions and EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import uuid

from engine.config import ATTENTION_BACKENDS, DTYPE_CHOICES, KV_COMMIT_CHOICES, EngineConfig
from protocol.addresses import advertised_host
from protocol.model_digest import model_digest
from protocol.registry import Role


@dataclasses.dataclass(frozen=True, slots=True)
class NodeOptions:
    role: Role
    host: str  # bind address
    port: int  # control socket port (0: any free port)
    kv_port: int  # decode nodes: KV receiver port (0: any free port)
    advertise_host: str  # the address peers use to reach this node
    redis_url: str | None  # register in Redis; None: static mode (router is given the address)
    heartbeat_interval_s: float  # how often the Redis record is refreshed
    heartbeat_ttl_s: float  # how long the record outlives a silent node
    # A loop that made no progress for this long is stuck: its record expires then, whatever the
    # heartbeat thread does. Longer than the slowest engine step (a full prefill token budget).
    stall_timeout_s: float
    request_ttl_s: float  # longest a request may live on this node without finishing
    drain_timeout_s: float  # SIGTERM: longest wait for in-flight work before exiting
    node_id: str  # unique per process
    model_id: str  # the model's content digest (protocol.model_digest): part of the KV fingerprint

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # ValueError names a role that is none
        if not 0 < self.heartbeat_interval_s < self.heartbeat_ttl_s:
            raise ValueError("heartbeat interval must be positive and shorter than the ttl")
        if min(self.request_ttl_s, self.drain_timeout_s) <= 0:
            raise ValueError("request_ttl_s and drain_timeout_s must be positive")
        if self.stall_timeout_s < self.heartbeat_interval_s:
            raise ValueError("stall timeout must be at least the heartbeat interval")

    @property
    def control_addr(self) -> str:
        return f"tcp://{self.host}:{self.port}"


_ENGINE = EngineConfig(model="")  # the defaults every engine flag shows


def add_node_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="control port (0: a free port)")
    parser.add_argument("--kv-port", type=int, default=0, help="decode: KV receiver port (0: a free port)")
    parser.add_argument(
        "--advertise-host",
        default=None,
        help="address other nodes and the router use (default: --host, or this "
        "machine's hostname when binding 0.0.0.0)",
    )
    parser.add_argument("--redis", default=os.environ.get("PDSERVE_REDIS"), help="Redis URL for the registry")
    parser.add_argument("--heartbeat-interval", type=float, default=0.5)
    parser.add_argument("--heartbeat-ttl", type=float, default=3.0)
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=10.0,
        help="seconds without progress of the engine loop after which the node's record expires "
        "(it leaves the pool until the loop moves again); above the longest engine step",
    )
    parser.add_argument("--request-ttl", type=float, default=600.0)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--node-id", default=None)
    parser.add_argument(
        "--ready-file", default=None, help="write the node's addresses here (JSON) once serving"
    )
    engine = parser.add_argument_group("engine")  # defaults: engine.config.EngineConfig's, the one source
    engine.add_argument(
        "--dtype", default=_ENGINE.dtype, choices=DTYPE_CHOICES, help="auto: bfloat16 on CUDA, float32 on CPU"
    )
    engine.add_argument("--device", default=_ENGINE.device, help="auto, cpu, cuda or cuda:N (default: auto)")
    engine.add_argument("--block-size", type=int, default=_ENGINE.block_size)
    engine.add_argument("--kv-cache-memory-mb", type=int, default=_ENGINE.kv_cache_memory_mb)
    engine.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=_ENGINE.kv_cache_memory_fraction,
        help="share of available memory the KV pool takes when neither of the two above is given",
    )
    engine.add_argument("--num-kv-blocks", type=int, default=_ENGINE.num_kv_blocks)
    engine.add_argument("--max-num-batched-tokens", type=int, default=_ENGINE.max_num_batched_tokens)
    engine.add_argument(
        "--max-step-seconds",
        type=float,
        default=_ENGINE.max_step_s,
        help="step-time target: each step's token budget shrinks so that a step takes about this "
        "long at the measured speed (prefill chunks get smaller on a slow or loaded machine); "
        "default: the full budget's time at the speed of the first prefill steps, at most 1 s",
    )
    engine.add_argument("--max-num-seqs", type=int, default=_ENGINE.max_num_seqs)
    engine.add_argument("--max-model-len", type=int, default=_ENGINE.max_model_len)
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--max-waiting", type=int, default=_ENGINE.max_waiting)
    engine.add_argument(
        "--threads", type=int, default=_ENGINE.num_threads, help="torch threads for this process"
    )
    engine.add_argument(
        "--max-threads",
        type=int,
        default=_ENGINE.max_threads,
        help="without --threads: at most this many torch threads, fewer while other processes load the CPUs",
    )
    engine.add_argument(
        "--kv-commit",
        default=_ENGINE.kv_commit,
        choices=KV_COMMIT_CHOICES,
        help="lazy: commit the KV pool's memory as blocks are first used; idle: that, and the rest "
        "while the node is idle; startup: all of it before serving",
    )
    engine.add_argument(
        "--debug-checks", action="store_true", help="check the block pool's integrity every step"
    )
    engine.add_argument(
        "--attention-backend",
        default=_ENGINE.attention_backend,
        choices=ATTENTION_BACKENDS,
        help="auto: Triton on CUDA, the CPU kernels on CPU; triton on CPU runs Triton's interpreter",
    )
    engine.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=_ENGINE.gpu_memory_utilization,
        help="CUDA: share of the GPU's memory this node holds; the KV pool gets what weights and "
        "the profile run leave of it",
    )
    engine.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode-only steps"
    )


def options_from_args(role: Role, args: argparse.Namespace) -> tuple[NodeOptions, EngineConfig]:
    advertise = advertised_host(args.host, args.advertise_host)
    node = NodeOptions(
        role=role,
        host=args.host,
        port=args.port,
        kv_port=args.kv_port,
        advertise_host=advertise,
        redis_url=args.redis,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_ttl_s=args.heartbeat_ttl,
        stall_timeout_s=args.stall_timeout,
        request_ttl_s=args.request_ttl,
        drain_timeout_s=args.drain_timeout,
        node_id=args.node_id or f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        model_id=model_digest(args.model),
    )
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory_mb=args.kv_cache_memory_mb,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        num_kv_blocks=args.num_kv_blocks,
        kv_commit=args.kv_commit,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_step_s=args.max_step_seconds,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        max_waiting=args.max_waiting,
        num_threads=args.threads,
        max_threads=args.max_threads,
        device=args.device,
        debug_checks=args.debug_checks,
        attention_backend=args.attention_backend,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
    )
    return node, engine
