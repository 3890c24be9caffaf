"""Which GPUs each node of `pdserve up` computes on: ranges of their own where the host has enough,
shared GPUs where it has fewer than the nodes and each node is one rank, refused otherwise.

    4 GPUs, 1 prefill at tp 2 + 2 decode:   prefill-0 cuda:0 (its ranks on 0 and 1), decode-0 cuda:2, decode-1 cuda:3
    1 GPU, 1 prefill + 1 decode:            both on cuda:0, each with 45% of its memory
    2 GPUs, 1 prefill + 1 decode at tp 2:   refused: 4 GPUs needed

A node's rank r computes on the r-th GPU from the node's first (engine/executor/worker.py), and two
ranks of one group cannot share a GPU (NCCL refuses a duplicate device), so a node of N ranks
needs N GPUs of its own. Torch-free: `pdserve up` counts GPUs without importing torch.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

NVIDIA_GPUS = pathlib.Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver holds


def visible_gpu_count() -> int:
    """The GPUs the nodes' CUDA will see: CUDA_VISIBLE_DEVICES's list where it is set, else every
    GPU the NVIDIA driver holds (none without a driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        return len(ids[: ids.index("-1")] if "-1" in ids else ids)  # CUDA stops at an invalid id
    return len(list(NVIDIA_GPUS.glob("*"))) if NVIDIA_GPUS.is_dir() else 0


@dataclasses.dataclass(frozen=True, slots=True)
class GpuLayout:
    """Each node's first GPU, for the nodes in the order `pdserve up` starts them (prefill,
    decode, colocated; each kind by index)."""

    starts: tuple[int, ...]  # each node's first GPU index; its ranks take the ones after it
    nodes_per_gpu: int  # the most nodes that share one GPU (1: every node has its own)

    def device_of(self, ordinal: int) -> str:
        """The --device of the ``ordinal``-th node started. A node the autoscaler adds later takes
        the place of its ordinal modulo the plan's (it runs at one rank, as every node then)."""
        return f"cuda:{self.starts[ordinal % len(self.starts)]}"

    def describe(self) -> str:
        if self.nodes_per_gpu == 1:
            return f"GPUs: each node on its own, first GPUs {', '.join(f'cuda:{s}' for s in self.starts)}"
        return f"GPUs: {len(self.starts)} nodes on {len(set(self.starts))} GPU(s), up to {self.nodes_per_gpu} per GPU"


def plan_gpus(node_tps: list[int], first: int, num_gpus: int) -> GpuLayout:
    """The layout of nodes of ``node_tps`` ranks each (in start order) on GPUs ``first`` ..
    ``num_gpus - 1``; ValueError, naming what it needs and what there is, where it cannot run."""
    available = num_gpus - first
    needed = sum(node_tps)
    if needed <= available:
        starts = [first + sum(node_tps[:i]) for i in range(len(node_tps))]
        return GpuLayout(tuple(starts), 1)
    if max(node_tps) == 1 and available >= 1:
        starts = [first + i % available for i in range(len(node_tps))]
        return GpuLayout(tuple(starts), -(-len(node_tps) // available))
    ranks = " + ".join(str(tp) for tp in node_tps)
    raise ValueError(
        f"the nodes need {needed} GPUs ({ranks} ranks) from cuda:{first}, but this host has "
        f"{num_gpus} GPU(s){f', {available} from cuda:{first}' if first else ''}: a node's "
        "tensor-parallel ranks each need a GPU of their own (nodes share GPUs only at one rank "
        "each); start fewer nodes, lower --prefill-tp / --decode-tp, or use --device cpu"
    )
