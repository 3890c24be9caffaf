"""Faults on Redis and the router under a steady mixed load (see test_chaos_node_faults.py for the
checks). Redis down: the router serves with the membership it last saw (asking the nodes directly
how they are) and follows Redis again when it returns. Router down: its clients get a connection
error, the nodes free what those requests held, and a restarted router serves."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve.protocol.registry import KEY_PREFIX
from tests.chaos.harness import restart_redis
from tests.chaos.test_chaos_node_faults import run_fault

pytestmark = pytest.mark.usefixtures("processes")


def _registered(cluster) -> int:
    return len(list(cluster.redis.client.scan_iter(match=KEY_PREFIX + "*")))


def test_kill_9_of_redis_the_router_serves_on_and_follows_it_again(cluster, expected):
    def recover():
        restart_redis(cluster.redis, cluster.tmp)

    run_fault(
        cluster,
        expected,
        fault="kill -9 Redis (restarted empty after 4 s)",
        where="registry, under load",
        inject=cluster.redis.proc.kill,
        recover=recover,
        seed=1,  # the seed of the other default cases: one oracle run
    )
    deadline = time.monotonic() + 10
    while _registered(cluster) < 4:  # the nodes publish again at their next heartbeat
        assert time.monotonic() < deadline, "nodes did not register again"
        time.sleep(0.1)
    cluster.wait_members(2, 2)
    # Redis is the source again: a node that leaves it (SIGTERM, drained) leaves the router's pool.
    leaving = cluster.live("decode")[0]
    assert leaving.terminate() == 0
    cluster.wait_members(2, 1, timeout_s=10)
    cluster.replace(leaving)
    cluster.wait_members(2, 2)


@pytest.mark.chaos
def test_sigstop_of_redis_the_router_serves_on(cluster, expected):
    run_fault(
        cluster,
        expected,
        fault="SIGSTOP Redis (SIGCONT after 4 s)",
        where="registry, under load",
        inject=lambda: os.kill(cluster.redis.proc.pid, signal.SIGSTOP),
        recover=lambda: os.kill(cluster.redis.proc.pid, signal.SIGCONT),
        seed=12,
    )
    cluster.wait_members(2, 2)


@pytest.mark.chaos
def test_kill_9_of_the_router_its_clients_get_connection_errors_and_a_new_router_serves(cluster, expected):
    def recover():
        cluster.router.start()  # same port: the clients' URL works again
        cluster.router.wait_healthy()

    row = run_fault(
        cluster,
        expected,
        fault="kill -9 router (restarted)",
        where="router, mid-stream and before tokens",
        inject=cluster.router.kill,
        recover=recover,
        allowed=frozenset({"connection_error", "sse_error"}),
        seed=13,
        down_until_recovered=True,
    )
    assert row["outcomes"].get("connection_error", 0) > 0
    cluster.wait_members(2, 2)
