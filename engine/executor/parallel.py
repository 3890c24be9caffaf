"""Tensor-parallel ranks of one node: which rank this process is of how many, and the collectives
the parallel layers call. At tp=1 there is no group and every collective returns its input, so a
single device's code runs unchanged (``SINGLE``).

The group is torch.distributed's, gloo on the CPU and NCCL on CUDA (``Platform.dist_backend``).
Every collective runs under the group's timeout: a rank that hangs or dies fails the others'
collective within it, and a node takes that as fatal (a group is not trusted after a timeout).
The state is passed to the layers that need it when the model is built, never held globally.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ParallelState:
    tp_size: int = 1  # ranks the node's model is split over
    rank: int = 0  # this process's among them
    group: dist.ProcessGroup | None = None  # None at tp=1

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.tp_size, (self.rank, self.tp_size)
        assert self.group is not None or self.tp_size == 1, "several ranks need a group"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (row-parallel layers' outputs)."""
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order (the LM head's logits)."""
        if self.group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place."""
        if self.group is not None:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of ``size`` rows; ValueError naming ``what``
        when ``size`` does not split evenly."""
        if size % self.tp_size:
            raise ValueError(f"{what}: {size} does not split over --tensor-parallel-size {self.tp_size}")
        length = size // self.tp_size
        return self.rank * length, length


SINGLE = ParallelState()


def init_parallel(
    tp_size: int,
    rank: int,
    init_method: str,
    backend: str,
    timeout_s: float,
    group_of_one: bool = False,
    device: torch.device | None = None,
) -> ParallelState:
    """Join the node's group (every rank calls it; it returns once all have, or raises after
    ``timeout_s``, the collectives' timeout too). ``init_method``: e.g. ``tcp://127.0.0.1:PORT``,
    rank 0 listening. ``group_of_one``: a group even for one rank, whose collectives run for real
    (the GPU one-shot's check of NCCL with one device). ``device``: this rank's, which NCCL binds
    its communicator to at once (``eager_init``)."""
    if tp_size == 1 and not group_of_one:
        return SINGLE
    if dist.is_initialized():
        # torch.distributed's default group is one per process; this process's is another engine's
        raise RuntimeError(
            "this process already holds a tensor-parallel group: another engine of "
            "tensor_parallel_size > 1 is open here; close it first (LLM.close(), the end of "
            "`with LLM(...)`, or dropping its last reference)"
        )
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=tp_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
        **eager_init(backend, device),
    )
    return ParallelState(tp_size, rank, dist.group.WORLD)


def eager_init(backend: str, device: torch.device | None) -> dict[str, Any]:
    """init_process_group's ``device_id`` for NCCL (torch 2.3 on): the communicator forms at
    once, so a rank that cannot join fails the group's start, not its first collective mid-step.
    Nothing for gloo, nor for a torch without the argument."""
    if backend != "nccl" or device is None or not _TAKES_DEVICE_ID:
        return {}
    return {"device_id": device}


_TAKES_DEVICE_ID = "device_id" in inspect.signature(dist.init_process_group).parameters


def abort_parallel(state: ParallelState) -> None:
    """Abort the group from another thread once a rank is lost (the executor's monitor). NCCL
    never notices a dead peer: rank 0 would wait in a device sync behind the collective until the
    watchdog ends the process, with no last record; aborting the communicator fails that
    collective now. A gloo collective fails on its own once the peer's socket closes. A no-op
    for a group already closed or aborted."""
    if state.group is not None and dist.is_initialized() and dist.group.WORLD is state.group:
        dist.distributed_c10d._abort_process_group(state.group)


def close_parallel(state: ParallelState) -> None:
    """Leave and destroy the group, so that another engine in this process can form its own. A
    no-op at tp=1, and for a group already destroyed: a second close of an engine closed earlier
    must not destroy the group a newer engine has formed since."""
    if state.group is not None and dist.is_initialized() and dist.group.WORLD is state.group:
        dist.destroy_process_group()
