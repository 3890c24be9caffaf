"""Faults caused for real on a node or Redis under a steady mixed load (streamed and not, logprobs
on and off, prompts that go through a prefill node and ones that prefill on the decode node).

After each: every request ended within its deadline, complete and equal to Hugging Face or with a
clear error (a stream only after it had sent a token: before, the router retries it); the surviving
nodes kept serving; every node's used KV blocks went back to 0 (read through /metrics); a restarted
node rejoins and takes traffic. ``@pytest.mark.chaos`` cases run in ``make chaos`` only."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import re
import signal
import time

import pytest

from tests import web
from tests.chaos.harness import STALL_TIMEOUT_S, Cluster, main_thread_frozen
from tests.chaos.load import (
    Expected,
    LoadGenerator,
    Spec,
    check_outcomes,
    make_specs,
    prompts,
    request_once,
    write_report_row,
)

pytestmark = pytest.mark.usefixtures("processes")
STEADY_S = 1.5  # load before the fault


@pytest.fixture(
    scope="session",
    # `make chaos` only: the default suite's kill -9 cases are tests/test_migration.py (a decode node
    # mid-output) and tests/test_router_failover.py; a stalled loop's expiry, tests/test_node_liveness.py
    params=[pytest.param("redis", marks=pytest.mark.chaos), pytest.param("static", marks=pytest.mark.chaos)],
)
def cluster(request):
    """Each fault on both registry modes: Redis, and static addresses (``pdserve up --no-redis``)."""
    return request.getfixturevalue(f"{request.param}_cluster")


AFTER_S = 3.5  # load after it: retries, and the survivors serving new requests


def _new_node_takes_traffic(cluster: Cluster, node, expected: Expected, seed: int) -> None:
    """Rounds of concurrent distinct long prompts (ties between idle nodes go by node id, so one at
    a time could all go to the old one) until the new node shows it took some."""
    event = "request_added" if node.role == "prefill" else "kv_adopted"
    deadline = time.monotonic() + 30
    for attempt in itertools.count():
        specs = [
            Spec(p + (7,) * 100, 8, stream=False, logprobs=True) for p in prompts(seed * 1000 + attempt, 8)
        ]
        with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
            outcomes = list(
                pool.map(lambda s: request_once(cluster.router.url, cluster.model.name, s), specs)
            )
        for outcome in outcomes:
            assert outcome.kind == "complete", outcome
            expected.check(outcome)
        if node.events(event) or node.events("request_added"):
            return
        assert time.monotonic() < deadline, f"the restarted {node.role} node took no request"


def run_fault(
    cluster: Cluster,
    expected: Expected,
    *,
    fault: str,
    where: str,
    inject,
    recover=None,
    allowed: frozenset = frozenset({"sse_error"}),
    seed: int = 0,
    long_output: bool = True,
    concurrency: int = 8,
    down_until_recovered: bool = False,
) -> dict:
    """Load, ``inject()``, more load, ``recover()``; then the checks every fault ends with. Requests
    sent 3 s after the fault (after ``recover()`` when ``down_until_recovered``: the router itself
    was down) must all complete."""
    specs = make_specs(seed, long_output=long_output)
    for spec in specs:
        expected.tokens(spec)  # the oracle runs before the clock does
    with LoadGenerator(cluster.router.url, cluster.model.name, specs, concurrency, seed) as load:
        time.sleep(STEADY_S)
        fault_at = time.monotonic()
        inject()
        time.sleep(AFTER_S)
        recovered_at = time.monotonic()
        if recover is not None:
            recover()
            recovered_at = time.monotonic()
            time.sleep(1.0)
        outcomes = load.stop()
    counts = check_outcomes(outcomes, expected, set(allowed))
    serving_from = recovered_at if down_until_recovered else fault_at + 3.0
    late = [o for o in outcomes if o.started > serving_from and o.kind != "complete"]
    assert not late, f"requests sent after the fault was noticed failed: {late[:3]}"
    used = cluster.wait_idle()
    assert used and not any(used.values()), f"blocks still held: {used}"
    row = {
        "fault": fault + (" (static addresses)" if cluster.static else ""),
        "where": where,
        "requests": len(outcomes),
        "in_flight": load.in_flight_at(fault_at),
        "outcomes": counts,
        "blocks_leaked": sum(used.values()),
    }
    write_report_row(row)
    return row


_RUNNING_RE = re.compile(
    r'^pdserve_node_running_requests\{node_id="([^"]+)",role="\w+"\} (\d+)(?:\.0)?$', re.M
)
_STATUS_AT_RE = re.compile(
    r'^pdserve_node_status_timestamp_seconds\{node_id="([^"]+)",role="\w+"\} (\S+)$', re.M
)


def _busiest(cluster: Cluster, role: str, timeout_s: float = 15.0):
    """The live node of ``role`` running the most requests now, by its /metrics gauge. It waits
    (up to ``timeout_s``) for one whose status, at most a second old, shows two requests running:
    a status lags by a heartbeat, and a fault meant to land mid-decode must find decoding (with
    one, that request may finish in the lag: a loaded full-suite run killed a node holding none)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = web.get(cluster.router.url + "/metrics", timeout=5).text
        running = {node: int(num) for node, num in _RUNNING_RE.findall(text)}
        fresh = {node for node, at in _STATUS_AT_RE.findall(text) if time.time() - float(at) < 1.0}
        busiest = max(cluster.live(role), key=lambda n: running.get(n.addrs["node_id"], 0))
        node_id = busiest.addrs["node_id"]
        if (running.get(node_id, 0) >= 2 and node_id in fresh) or time.monotonic() > deadline:
            return busiest
        time.sleep(0.05)


def _kill_and_replace(cluster: Cluster, role: str, expected: Expected, seed: int, **kw) -> None:
    victims = []

    def inject() -> None:  # the busiest one: the kill lands mid-decode
        victims.append(_busiest(cluster, role))
        victims[0].kill()

    try:
        run_fault(cluster, expected, inject=inject, seed=seed, **kw)
    finally:  # the cases share the cluster: the next one finds it whole even when this one failed
        new = cluster.replace(victims[0]) if victims else None
    cluster.wait_members(2, 2)
    _new_node_takes_traffic(cluster, new, expected, seed)


def _moved(cluster: Cluster) -> int:
    """Samples retried before their first token or migrated after it, so far."""
    text = web.get(cluster.router.url + "/metrics", timeout=5).text
    return sum(map(int, re.findall(r"^pdserve_(?:retries|migrations)_total (\d+)", text, re.M)))


def test_kill_9_of_a_decode_node_mid_decode_loses_no_request(cluster, expected):
    """Every request the dead node held goes on on the other decode node: retried before its first
    token, migrated after it (equal to HF, usage counted once); none ends with an error."""
    before = _moved(cluster)
    _kill_and_replace(
        cluster, "decode", expected, 1, fault="kill -9 decode", where="mid-decode", allowed=frozenset()
    )
    assert _moved(cluster) > before, "the killed node held no request"


@pytest.mark.chaos
def test_kill_9_of_a_prefill_node_under_load(cluster, expected):
    _kill_and_replace(
        cluster, "prefill", expected, 2, fault="kill -9 prefill", where="prefill, reservation, transfer"
    )


@pytest.mark.chaos
def test_sigstop_of_a_prefill_node_then_sigcont(cluster, expected):
    victim = cluster.live("prefill")[0]
    run_fault(
        cluster,
        expected,
        fault="SIGSTOP prefill (then SIGCONT)",
        where="prefill, before the reservation",
        inject=lambda: os.kill(victim.proc.pid, signal.SIGSTOP),
        recover=lambda: os.kill(victim.proc.pid, signal.SIGCONT),
        seed=3,
    )
    cluster.wait_members(2, 2)


@pytest.mark.chaos
def test_sigstop_of_a_decode_node_then_sigcont(cluster, expected):
    victim = cluster.live("decode")[0]
    run_fault(
        cluster,
        expected,
        fault="SIGSTOP decode (then SIGCONT)",
        where="reservation grant, mid-decode",
        inject=lambda: os.kill(victim.proc.pid, signal.SIGSTOP),
        recover=lambda: os.kill(victim.proc.pid, signal.SIGCONT),
        seed=4,
        allowed=frozenset(),  # its streams migrate
    )
    cluster.wait_members(2, 2)


def _stuck_loop(cluster: Cluster, expected: Expected, role: str, seed: int) -> None:
    """Freeze only the node's main thread (its engine loop): heartbeat and ZeroMQ threads run on,
    so only a heartbeat tied to the loop's progress lets the router see it."""
    victim = cluster.live(role)[0]
    num_prefill, num_decode = len(cluster.live("prefill")), len(cluster.live("decode"))
    frozen_at: list[float] = []  # wall clock, as the router's log
    stack = contextlib.ExitStack()

    def inject() -> None:
        stack.enter_context(main_thread_frozen(victim.proc.pid))
        frozen_at.append(time.time())
        gone = (num_prefill - (role == "prefill"), num_decode - (role == "decode"))
        cluster.wait_members(*gone, timeout_s=STALL_TIMEOUT_S + 5)

    run_fault(
        cluster,
        expected,
        fault=f"engine loop of a {role} node stuck (its main thread ptrace-stopped)",
        where="prefill compute" if role == "prefill" else "mid-decode",
        inject=inject,
        recover=stack.close,
        seed=seed,
    )
    # The record expires STALL_TIMEOUT_S after the loop's last progress; the router's next poll
    # drops the node (its log says when: /health answers late on 2 busy cores).
    expired = re.findall(
        rf"^(\d+\.\d+) WARNING .*node {victim.addrs['node_id']} \(\w+\) expired", cluster.router.log(), re.M
    )
    left_after = [float(t) - frozen_at[0] for t in expired if float(t) > frozen_at[0]]
    assert left_after and left_after[0] < STALL_TIMEOUT_S + 1.0, left_after
    cluster.wait_members(num_prefill, num_decode)


def test_a_decode_node_whose_engine_loop_is_stuck_leaves_the_pool(cluster, expected):
    _stuck_loop(cluster, expected, "decode", 1)  # the seed of the other default cases: one oracle run


@pytest.mark.chaos
def test_a_prefill_node_whose_engine_loop_is_stuck_leaves_the_pool(cluster, expected):
    _stuck_loop(cluster, expected, "prefill", 6)


def _sigterm(cluster: Cluster, expected: Expected, role: str, seed: int) -> None:
    """Scale-down: SIGTERM under load loses no request (only complete outcomes are allowed)."""
    victim = cluster.live(role)[0]
    run_fault(
        cluster,
        expected,
        fault=f"SIGTERM {role} (scale-down)",
        where="every stage: queued, prefill, transfer, decode",
        inject=lambda: victim.proc.send_signal(signal.SIGTERM),
        allowed=frozenset(),
        seed=seed,
    )
    assert victim.proc.wait(30) == 0
    new = cluster.replace(victim)
    cluster.wait_members(2, 2)
    _new_node_takes_traffic(cluster, new, expected, seed)


@pytest.mark.chaos
def test_sigterm_of_a_decode_node_under_load_loses_no_request(cluster, expected):
    _sigterm(cluster, expected, "decode", 7)


@pytest.mark.chaos
def test_sigterm_of_a_prefill_node_under_load_loses_no_request(cluster, expected):
    _sigterm(cluster, expected, "prefill", 8)
