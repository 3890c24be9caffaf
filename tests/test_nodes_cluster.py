"""Two prefill and two decode nodes found through Redis: spread, exactness, prefix reuse, drain."""

from __future__ import annotations

import signal
import time

import pytest

from pdserve.protocol.registry import list_nodes
from tests.cluster import Client, NodeProcess, RedisServer
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("processes")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    model = str(make_tiny_model("qwen2"))
    redis = RedisServer(tmp)
    extra = ["--block-size", "8", "--num-kv-blocks", "96"]
    procs = [
        NodeProcess(role, model, tmp, redis.url, extra) for role in ("prefill", "prefill", "decode", "decode")
    ]
    try:
        for p in procs:
            p.wait_ready()
        yield model, redis, procs
    finally:
        for p in procs:
            p.close()
        redis.stop()


def _discover(redis) -> tuple[list[dict], list[dict]]:
    nodes = list_nodes(redis.client)
    as_addrs = [{"control_addr": n.control_addr, "kv_addr": n.kv_addr, "node_id": n.node_id} for n in nodes]
    return (
        [a for a, n in zip(as_addrs, nodes, strict=True) if n.role == "prefill"],
        [a for a, n in zip(as_addrs, nodes, strict=True) if n.role == "decode"],
    )


def test_requests_spread_over_both_pools_and_all_match_hf(cluster):
    model, redis, procs = cluster
    prefills, decodes = _discover(redis)
    assert len(prefills) == 2 and len(decodes) == 2
    client = Client()
    try:
        prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(8)]
        for i, p in enumerate(prompts):
            client.generate(
                prefills[i % 2], f"s{i}", p, {**GREEDY, "max_tokens": 6}, decode=decodes[(i // 2) % 2]
            )
        results = client.collect([f"s{i}" for i in range(8)])
        for i, p in enumerate(prompts):
            assert results[f"s{i}"]["tokens"] == hf_greedy(model, p, 6)
        for proc in procs:
            kind = "request_added" if proc.role == "prefill" else "kv_adopted"
            assert len(proc.events(kind)) >= 2, f"{proc.role} node got no share"
        for node in prefills + decodes:
            info = client.wait_idle(node)
            assert info["num_blocks_free"] == info["num_blocks_total"]
    finally:
        client.close()


def test_same_system_prompt_reuses_prefix_on_both_nodes(cluster):
    model, redis, procs = cluster
    prefills, decodes = _discover(redis)
    system = list(range(100, 140))  # five full blocks of 8
    client = Client()
    try:
        client.generate(
            prefills[0], "sys-1", system + [7, 8, 9], {**GREEDY, "max_tokens": 4}, decode=decodes[0]
        )
        first = client.collect(["sys-1"])["sys-1"]
        client.generate(
            prefills[0], "sys-2", system + [9, 8, 7, 6], {**GREEDY, "max_tokens": 4}, decode=decodes[0]
        )
        second = client.collect(["sys-2"])["sys-2"]
        assert first["chunks"][0][1].num_cached_tokens == 0
        assert second["chunks"][0][1].num_cached_tokens == 40  # prefill computed only the new part
        assert second["tokens"] == hf_greedy(model, system + [9, 8, 7, 6], 4)
        prefill_proc = next(
            p for p in procs if p.role == "prefill" and p.addrs["node_id"] == prefills[0]["node_id"]
        )
        shipped = {e["request_id"]: e for e in prefill_proc.events("kv_shipped")}
        assert shipped["sys-1"]["blocks_reused"] == 0
        assert shipped["sys-2"]["blocks_reused"] == 5  # the decode node already held the system prompt
        assert shipped["sys-2"]["blocks_sent"] < shipped["sys-1"]["blocks_sent"]
    finally:
        client.close()


def test_draining_decode_node_finishes_in_flight_requests_and_leaves(cluster):
    model, redis, procs = cluster
    prefills, decodes = _discover(redis)
    victim = next(p for p in procs if p.role == "decode" and p.addrs["node_id"] == decodes[1]["node_id"])
    client = Client()
    try:
        # 200 tokens: on an idle machine 60 took ~60 ms, too short a window to see all three running.
        for i in range(3):
            client.generate(
                prefills[0], f"drain-{i}", [3 + i] * 20, {**GREEDY, "max_tokens": 200}, decode=decodes[1]
            )
        deadline = time.monotonic() + 20
        while client.status(decodes[1])["num_running"] < 3:  # all three decoding on the victim
            assert time.monotonic() < deadline
            time.sleep(0.01)
        victim.proc.send_signal(signal.SIGTERM)
        results = client.collect([f"drain-{i}" for i in range(3)])
        assert victim.proc.wait(30) == 0
        for i in range(3):
            assert results[f"drain-{i}"]["failed"] is None
            assert results[f"drain-{i}"]["tokens"] == hf_greedy(model, [3 + i] * 20, 200)
        assert decodes[1]["node_id"] not in {n.node_id for n in list_nodes(redis.client)}
    finally:
        client.close()
