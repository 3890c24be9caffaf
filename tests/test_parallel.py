"""engine/executor/parallel.py: a node's tensor-parallel ranks over torch.distributed (gloo on the CPU), in
real worker processes: the collectives, and the timeouts that turn a missing or hung rank into an
error within the group's deadline."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from pdserve.engine.executor.parallel import SINGLE, ParallelState, close_parallel, init_parallel
from pdserve.launcher.ports import free_port

CONTEXT = multiprocessing.get_context("spawn")  # a fresh interpreter per rank, as a node starts them


def test_one_rank_has_no_group_and_every_collective_returns_its_input():
    x = torch.arange(6.0).view(2, 3)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x and SINGLE.broadcast(x) is x
    assert SINGLE.shard(12, "rows") == (0, 12)
    with pytest.raises(AssertionError):
        ParallelState(tp_size=2, rank=0, group=None)


def _collectives(rank: int, port: int, results) -> None:
    state = init_parallel(2, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=30)
    try:
        x = torch.full((2, 3), float(rank + 1))
        summed = state.all_reduce(x.clone())
        gathered = state.all_gather(torch.full((2, 1), float(rank)), dim=1)
        sent = state.broadcast(torch.full((3,), 7.0 if rank == 0 else -1.0))
        results.put((rank, summed.tolist(), gathered.tolist(), sent.tolist(), state.shard(8, "rows")))
    finally:
        close_parallel(state)


def _run(target, *args, ranks: int = 2, timeout_s: float = 60):
    results = CONTEXT.Queue()
    procs = [CONTEXT.Process(target=target, args=(rank, *args, results)) for rank in range(ranks)]
    for proc in procs:
        proc.start()
    try:
        return sorted(results.get(timeout=timeout_s) for _ in range(ranks))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


@pytest.mark.usefixtures("processes")
def test_two_ranks_sum_gather_and_broadcast_in_rank_order():
    (r0, r1) = _run(_collectives, free_port())
    for rank, summed, gathered, sent, shard in (r0, r1):
        assert summed == [[3.0] * 3] * 2  # 1 + 2
        assert gathered == [[0.0, 1.0]] * 2  # rank 0's column, then rank 1's
        assert sent == [7.0] * 3
        assert shard == (4 * rank, 4)


def _lonely(rank: int, port: int, results) -> None:
    start = time.monotonic()
    try:
        init_parallel(2, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=3)
        results.put((rank, "joined", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 - the group's own error, whatever its type
        results.put((rank, type(exc).__name__, time.monotonic() - start))


@pytest.mark.usefixtures("processes")
def test_a_rank_that_never_joins_fails_the_others_start_within_the_timeout():
    ((rank, outcome, seconds),) = _run(_lonely, free_port(), ranks=1)
    assert outcome != "joined" and seconds < 20, (outcome, seconds)


def _one_hangs(rank: int, port: int, results) -> None:
    state = init_parallel(2, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=3)
    if rank == 1:
        time.sleep(30)  # hung inside a step: never reaches the collective
        return
    start = time.monotonic()
    try:
        state.all_reduce(torch.ones(4))
        results.put((rank, "reduced", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001
        results.put((rank, type(exc).__name__, time.monotonic() - start))


@pytest.mark.usefixtures("processes")
def test_a_collective_with_a_hung_rank_raises_within_the_groups_timeout():
    results = CONTEXT.Queue()
    port = free_port()
    procs = [CONTEXT.Process(target=_one_hangs, args=(rank, port, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        rank, outcome, seconds = results.get(timeout=60)
        assert rank == 0 and outcome != "reduced" and seconds < 20, (outcome, seconds)
    finally:
        for proc in procs:
            proc.kill()
            proc.join(timeout=10)
