"""kill -9 of a tensor-parallel node's worker rank under the steady mixed load of the node faults,
on a cluster of 2 prefill and 2 decode nodes of two ranks each (a registry): the node whose rank
died leaves the pool at once (it never serves on part of the model), its requests end as a whole
node kill's do (retried before their first token, migrated after it, equal to HF), no block is
held afterwards, and a new node takes its place. ``make chaos`` only."""

from __future__ import annotations

import os
import signal

import pytest

from tests.chaos.harness import Cluster
from tests.chaos.test_chaos_node_faults import _busiest, _moved, _new_node_takes_traffic, run_fault
from tests.test_tensor_parallel_cluster import _worker_pid

pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.chaos]


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory, model):
    c = Cluster(tmp_path_factory.mktemp("chaos-tp"), model, tp=2)
    try:
        yield c
    finally:
        c.close()


def _kill_a_rank(cluster: Cluster, role: str, expected, seed: int, **kw) -> None:
    victims = []

    def inject() -> None:
        node = _busiest(cluster, role)
        victims.append(node)
        os.kill(_worker_pid(node.proc.pid), signal.SIGKILL)
        assert node.proc.wait(timeout=30) != 0  # the node went with its rank
        (fatal,) = node.events("integrity_failed")
        assert "rank 1 exited (-9)" in fatal["error"]

    try:
        run_fault(cluster, expected, inject=inject, seed=seed, **kw)
    finally:
        new = cluster.replace(victims[0]) if victims else None
    cluster.wait_members(2, 2)
    _new_node_takes_traffic(cluster, new, expected, seed)


def test_kill_9_of_a_decode_nodes_rank_mid_decode_loses_no_request(tp_cluster, expected):
    before = _moved(tp_cluster)
    _kill_a_rank(
        tp_cluster,
        "decode",
        expected,
        11,
        fault="kill -9 decode rank 1",
        where="mid-decode",
        allowed=frozenset(),
    )
    assert _moved(tp_cluster) > before, "the node whose rank died held no request"


def test_kill_9_of_a_prefill_nodes_rank_under_load(tp_cluster, expected):
    _kill_a_rank(
        tp_cluster, "prefill", expected, 12, fault="kill -9 prefill rank 1", where="prefill, transfer"
    )
