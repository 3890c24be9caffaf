"""What `pdserve up` starts: one frozen plan, validated on construction."""

from __future__ import annotations

import dataclasses
import os
import pathlib

from pdserve.launcher.gpus import GpuLayout


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterPlan:
    model: str  # local Hugging Face folder every process loads
    num_prefill: int  # prefill node processes
    num_decode: int  # decode node processes
    host: str  # router's HTTP bind address
    port: int  # router's HTTP port
    redis_url: str | None  # an existing registry; None: start a private one if possible
    use_redis: bool  # False: static addresses even when a redis-server is installed
    threads_per_node: int  # torch threads in each node process
    log_dir: pathlib.Path  # one log (and ready file) per child
    node_args: tuple[str, ...] = ()  # extra flags passed to every node (engine sizes etc.)
    num_colocated: int = 0  # node processes that prefill and decode (`pdserve decode --colocated`)
    router_args: tuple[
        str, ...
    ] = ()  # extra flags for the router (--disagg-threshold N, --no-prefix-routing)
    start_timeout_s: float = 120.0  # longest wait for any one stage of start-up
    # True (--threads given): every node runs exactly threads_per_node. False: that is each node's
    # ceiling (--max-threads), and a node of more than one thread takes fewer while other processes
    # (the router, a client, another node) load its CPUs.
    fixed_threads: bool = False
    stop_timeout_s: float = 20.0  # SIGTERM, then this long, then SIGKILL
    max_nodes: int = 0  # nodes the cluster may grow to (--autoscale): threads and memory are shared by them
    # tensor-parallel ranks of each prefill node, and of each decode or colocated node; each rank
    # runs threads_per_node threads (a node of N ranks: N processes, engine/executor/executor.py)
    prefill_tp: int = 1
    decode_tp: int = 1
    # each node keeps KV blocks in a folder of its own under this one (its child name: a restarted
    # cluster's nodes find theirs); None: no offload tier
    kv_offload_dir: pathlib.Path | None = None
    kv_offload_disk_mb: int | None = None  # each folder's budget (None: the nodes' default)
    # each node's GPUs where the nodes compute on CUDA (launcher/gpus.py); None: every node gets
    # the --device of node_args as it is
    gpu_layout: GpuLayout | None = None

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_colocated) < 0:
            raise ValueError("node counts must be >= 0")
        # The router is healthy with one prefill and one decode node, or with one colocated node.
        if self.num_colocated == 0 and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError(
                "need at least one prefill and one decode node (--prefill N --decode M), "
                "or a colocated one (--colocated N)"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.threads_per_node < 1:
            raise ValueError("threads_per_node must be >= 1")
        if min(self.prefill_tp, self.decode_tp) < 1:
            raise ValueError("tensor-parallel sizes must be >= 1")
        if min(self.start_timeout_s, self.stop_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")
        if self.kv_offload_disk_mb is not None and (
            self.kv_offload_dir is None or self.kv_offload_disk_mb <= 0
        ):
            raise ValueError("--kv-offload-disk-mb takes a positive budget, with --kv-offload-dir")

    @property
    def num_nodes(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    def tp_of(self, role: str) -> int:
        """The tensor-parallel size of a node of ``role`` (prefill, decode or colocated)."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def ordinal(self, role: str, index: int) -> int:
        """Where node ``index`` of ``role`` comes in the start order: prefill, decode, colocated."""
        before = {"prefill": 0, "decode": self.num_prefill, "colocated": self.num_prefill + self.num_decode}
        return before[role] + index

    @property
    def num_ranks(self) -> int:
        """Processes that compute: every node's ranks."""
        return self.num_prefill * self.prefill_tp + (self.num_decode + self.num_colocated) * self.decode_tp

    @property
    def node_budget(self) -> int:
        """The most nodes that run at once: what threads, KV pools and GPU memory are split by."""
        return max(self.num_nodes, self.max_nodes)

    def describe(self) -> str:
        """The node pools in words: "1 prefill + 1 decode", "2 colocated", ..."""
        counts = (
            ("prefill", self.num_prefill),
            ("decode", self.num_decode),
            ("colocated", self.num_colocated),
        )
        return " + ".join(f"{num} {role}" for role, num in counts if num)

    @property
    def url(self) -> str:
        """Where clients reach the router (a wildcard bind is reached over loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


LOCAL_KV_SHARE = 0.5  # of the available memory, for all of a one-machine cluster's KV pools


def kv_fraction_per_node(num_nodes: int, default: float = 0.25) -> float | None:
    """Each node's share of available memory for its KV pool, where ``default`` (the engine's own
    kv_cache_memory_fraction, sized as if the node were alone) would let the pools together pass
    LOCAL_KV_SHARE; None where the default fits. The nodes start together and each sees all of
    the free memory, and a pool commits its pages as it is used, so an oversized one fails late:
    under load, not at start-up."""
    share = LOCAL_KV_SHARE / max(1, num_nodes)
    return share if share < default else None


LOCAL_GPU_SHARE = 0.9  # of one GPU's memory, for all the nodes a one-machine cluster starts on it


def node_flag(node_args: tuple[str, ...] | list[str], flag: str, default: str = "auto") -> str:
    """The value the nodes get for ``flag`` from ``node_args`` (the last one wins, as argparse has it)."""
    value = default
    for i, arg in enumerate(node_args):
        if arg == flag and i + 1 < len(node_args):
            value = node_args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def node_device(node_args: tuple[str, ...] | list[str]) -> str:
    """The --device the nodes get from ``node_args``."""
    return node_flag(node_args, "--device")


def gpu_share_per_node(node_args: tuple[str, ...] | list[str], nodes_per_gpu: int) -> float | None:
    """Each node's --gpu-memory-utilization where ``nodes_per_gpu`` nodes compute on one CUDA
    device, so that together they hold LOCAL_GPU_SHARE of it; None off CUDA, for a node alone on
    its GPU (the engine's own default), or where the flags already set a share."""
    if (
        not node_device(node_args).startswith("cuda")
        or nodes_per_gpu <= 1
        or any(a.startswith("--gpu-memory-utilization") for a in node_args)
    ):
        return None
    return LOCAL_GPU_SHARE / nodes_per_gpu


def threads_per_node(num_cores: int, num_nodes: int) -> int:
    """Each node gets an equal share of the cores, at least one thread; the router and Redis
    are light and share whatever is left."""
    return max(1, num_cores // max(1, num_nodes))
