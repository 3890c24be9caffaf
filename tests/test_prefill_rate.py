"""A node's measured prefill speed, and the backlog gauge the router derives from it for autoscaling.

Chain: the engine times each step (engine.step_stats.PrefillRate), its node publishes the rate
in its NodeInfo; the router's /metrics divides each node's queued prompt tokens by it
(``pdserve_node_prefill_backlog_seconds``, deploy/k8s/README.md).
"""

from __future__ import annotations

import time

import pytest

from pdserve.engine.core.step_stats import RATE_MIN_PROMPT_TOKENS, PrefillRate, StepStats
from pdserve.protocol.registry import NodeInfo
from pdserve.router.metrics import RouterMetrics, prefill_backlog_seconds
from tests.cluster import Client, NodeProcess
from tests.test_router_support import node_info
from tests.tiny_models import make_tiny_model


def test_prefill_rate_is_none_until_a_step_computed_prompt_tokens():
    rate = PrefillRate(min_tokens=1)
    rate.observe(0, 0.5)  # a step that only decoded
    assert rate.tokens_per_s is None


def test_prefill_rate_is_the_ratio_of_decayed_token_and_second_sums():
    rate = PrefillRate(decay=0.5, min_tokens=1)
    rate.observe(100, 1.0)
    assert rate.tokens_per_s == 100.0
    rate.observe(300, 1.0)  # (100 * 0.5 + 300) / (1 * 0.5 + 1) = 350 / 1.5
    assert rate.tokens_per_s == pytest.approx(350 / 1.5)


def test_prefill_rate_leaves_out_steps_of_few_prompt_tokens():
    """A short prompt beside running decodes: the step's time is its fixed cost and the decodes,
    and counted it would put the node's speed at a small share of what its queue drains at (a
    decode node measured 225 tokens/s so, and the router shed new requests as 10 s late)."""
    stats = StepStats()
    stats.observe(20, 8, 0.09)  # 20 prompt tokens, 8 decode rows: 222 tokens/s if counted
    assert stats.prefill_rate.tokens_per_s is None
    stats.observe(RATE_MIN_PROMPT_TOKENS * 8, 8, 0.05)
    stats.observe(20, 8, 0.09)
    assert stats.prefill_rate.tokens_per_s == pytest.approx(RATE_MIN_PROMPT_TOKENS * 8 / 0.05)


def test_prefill_rate_round_trips_through_the_redis_record():
    for value in (None, 1234.5):
        info = node_info("p0", "prefill", prefill_tokens_per_s=value)
        assert NodeInfo.from_redis(info.to_redis()).prefill_tokens_per_s == value


def test_backlog_is_queued_tokens_over_speed_with_the_pool_mean_for_an_unmeasured_node():
    nodes = [
        node_info("p0", "prefill", num_queued_prefill_tokens=1000, prefill_tokens_per_s=500.0),
        node_info("p1", "prefill", num_queued_prefill_tokens=300, prefill_tokens_per_s=100.0),
        node_info("p2", "prefill", num_queued_prefill_tokens=600),  # just started: pool mean 300
        node_info("p3", "prefill", num_queued_prefill_tokens=0),
    ]
    assert [(n.node_id, s) for n, s in prefill_backlog_seconds(nodes)] == [
        ("p0", 2.0),
        ("p1", 3.0),
        ("p2", 2.0),
        ("p3", 0.0),
    ]


def test_backlog_has_no_sample_for_a_queue_when_no_node_measured_a_speed():
    nodes = [node_info("p0", "prefill", num_queued_prefill_tokens=50), node_info("p1", "prefill")]
    assert [(n.node_id, s) for n, s in prefill_backlog_seconds(nodes)] == [("p1", 0.0)]


def test_router_metrics_export_every_nodes_prefill_speed_and_the_backlog_of_prefill_nodes():
    """The speed of every node the router may have prefill (a decode node's local prefills, a
    colocated node's prompts): what it sheds by, so a 429 can be traced to the speed behind it.
    The backlog, what autoscalers scale the prefill pool by, is the prefill nodes' only."""
    nodes = [
        node_info("p0", "prefill", num_queued_prefill_tokens=250, prefill_tokens_per_s=100.0),
        node_info("d0", "decode", num_queued_prefill_tokens=80, prefill_tokens_per_s=40.0),
        node_info("d1", "decode"),  # no speed: no sample
    ]
    lines = RouterMetrics(lambda: nodes, lambda: {}).render().decode().splitlines()
    assert 'pdserve_node_prefill_tokens_per_second{node_id="p0",role="prefill"} 100.0' in lines
    assert 'pdserve_node_prefill_tokens_per_second{node_id="d0",role="decode"} 40.0' in lines
    assert 'pdserve_node_prefill_backlog_seconds{node_id="p0",role="prefill"} 2.5' in lines
    assert [line for line in lines if line.startswith("pdserve_node_prefill_") and "d1" in line] == []
    assert [line for line in lines if line.startswith("pdserve_node_prefill_backlog") and "d0" in line] == []


@pytest.mark.usefixtures("processes")
def test_nodes_publish_a_prefill_speed_from_their_first_record_then_from_their_prefills(tmp_path):
    """Each node times a prompt before it serves (its first record has a speed: a router divides
    a fresh cluster's first burst by it); then the prefill node's speed follows a prompt it
    shipped, the decode node's one it prefilled itself (the router's TTFT prediction for a local
    prefill divides by it)."""
    model = str(make_tiny_model("llama"))
    nodes = [
        NodeProcess(role, model, tmp_path, None, ["--block-size", "8", "--num-kv-blocks", "64"])
        for role in ("prefill", "decode")
    ]
    client = Client()

    def changes(node, before: float) -> float:
        deadline = time.monotonic() + 5  # the node recomputes its status record every 0.1 s
        while (speed := client.status(node)["prefill_tokens_per_s"]) == before:
            assert time.monotonic() < deadline, f"still the start-up measure, {before} tokens/s"
            time.sleep(0.05)
        return speed

    try:
        prefill, decode = (n.wait_ready() for n in nodes)
        probed = [client.status(node)["prefill_tokens_per_s"] for node in (prefill, decode)]
        assert all(speed > 0 for speed in probed), probed
        assert [n.events("prefill_speed_measured")[0]["tokens_per_s"] for n in nodes] == [
            round(speed) for speed in probed
        ]
        client.generate(
            prefill, "r0", list(range(3, 83)), {"temperature": 0.0, "max_tokens": 4}, decode=decode
        )
        assert client.collect(["r0"])["r0"]["finish"] == "length"
        assert changes(prefill, probed[0]) > 0
        # tokens r0 did not have: its prefix would come from the decode node's cache, not a prefill
        client.generate(decode, "r1", list(range(103, 183)), {"temperature": 0.0, "max_tokens": 4})
        assert client.collect(["r1"])["r1"]["finish"] == "length"
        assert changes(decode, probed[1]) > 0
    finally:
        client.close()
        for n in nodes:
            n.close()
