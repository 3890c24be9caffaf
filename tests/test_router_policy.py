"""Routing policy on synthetic node records, and admission control."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pdserve.protocol.block_hash import cache_root_of, hash_full_blocks
from pdserve.router.admission import Admission, Stage, Ticket
from pdserve.router.errors import APIError
from pdserve.router.policy import PrefixMap, RoutingPolicy
from tests.test_router_support import FINGERPRINT, node_info

PROMPT = tuple(range(40))  # 10 full blocks of 4


def test_decode_with_most_free_blocks_wins():
    nodes = [node_info("d0", "decode", num_blocks_free=50), node_info("d1", "decode", num_blocks_free=80)]
    assert RoutingPolicy(disagg_threshold=1000).choose(nodes, PROMPT, 8).decode.node_id == "d1"


def test_decode_tie_on_free_blocks_goes_to_fewest_running():
    nodes = [node_info("d0", "decode", num_running=5), node_info("d1", "decode", num_running=2)]
    assert RoutingPolicy(1000).choose(nodes, PROMPT, 8).decode.node_id == "d1"


def test_outstanding_reservations_count_until_a_newer_heartbeat():
    policy = RoutingPolicy(1000)
    nodes = [node_info("d0", "decode", num_blocks_free=100), node_info("d1", "decode", num_blocks_free=95)]
    route = policy.choose(nodes, PROMPT, 8)
    assert route.decode.node_id == "d0" and route.num_blocks == 12
    policy.record("r1", route, len(PROMPT), now=10.0)
    policy.remember_prefix(route)
    other = tuple(range(100, 140))  # shares no prefix with r1
    assert policy.choose(nodes, other, 8).decode.node_id == "d1"  # 100 - 12 < 95
    fresh = [node_info("d0", "decode", num_blocks_free=100, heartbeat_time=11.0), nodes[1]]
    assert policy.choose(fresh, other, 8).decode.node_id == "d0"  # the heartbeat accounts for r1
    policy.finish("r1")
    assert policy.choose(nodes, other, 8).decode.node_id == "d0"


def test_short_prompt_prefills_on_the_decode_node():
    nodes = [node_info("d0", "decode"), node_info("p0", "prefill")]
    assert RoutingPolicy(disagg_threshold=41).choose(nodes, PROMPT, 8).prefill is None
    assert RoutingPolicy(disagg_threshold=40).choose(nodes, PROMPT, 8).prefill.node_id == "p0"


def test_failed_attempt_leaves_no_prefix_behind():
    policy = RoutingPolicy(disagg_threshold=16)
    nodes = [node_info("d0", "decode"), node_info("p0", "prefill")]
    policy.record("r1", policy.choose(nodes, PROMPT, 8), len(PROMPT), now=1.0)
    policy.finish("r1")  # no first token: nothing was computed
    assert policy.choose(nodes, PROMPT, 8).prefill is not None


def test_prompt_cached_on_the_decode_node_skips_prefill_node():
    policy = RoutingPolicy(disagg_threshold=16)
    nodes = [node_info("d0", "decode"), node_info("p0", "prefill")]
    first = policy.choose(nodes, PROMPT, 8)
    assert first.prefill is not None
    policy.record("r1", first, len(PROMPT), now=1.0)
    policy.remember_prefix(first)
    policy.finish("r1")
    assert policy.choose(nodes, PROMPT + (1, 2), 8).prefill is None  # 2 uncached tokens


def test_a_prefix_cached_under_one_salt_or_adapter_is_no_prefix_under_another():
    policy = RoutingPolicy(disagg_threshold=16)
    nodes = [node_info("d0", "decode"), node_info("p0", "prefill")]
    salted = cache_root_of(None, "a")
    first = policy.choose(nodes, PROMPT, 8, cache_root=salted)
    policy.record("r1", first, len(PROMPT), now=1.0)
    policy.remember_prefix(first)
    policy.finish("r1")
    assert policy.choose(nodes, PROMPT + (1, 2), 8, cache_root=salted).prefill is None  # cached there
    for root in (None, cache_root_of(None, "b"), cache_root_of("lora", "a")):
        assert policy.choose(nodes, PROMPT + (1, 2), 8, cache_root=root).prefill is not None


def test_prefill_with_least_queued_tokens_wins():
    nodes = [
        node_info("d0", "decode"),
        node_info("p0", "prefill", num_queued_prefill_tokens=500),
        node_info("p1", "prefill", num_queued_prefill_tokens=100),
    ]
    assert RoutingPolicy(0).choose(nodes, PROMPT, 8).prefill.node_id == "p1"


def test_prefill_cached_prefix_outweighs_a_smaller_queue():
    policy = RoutingPolicy(0)
    policy.prefill_prefixes.record(hash_full_blocks(PROMPT, 4), "p0")  # 40 cached tokens on p0
    nodes = [
        node_info("d0", "decode"),
        node_info("p0", "prefill", num_queued_prefill_tokens=150),
        node_info("p1", "prefill", num_queued_prefill_tokens=100),
    ]
    assert policy.choose(nodes, PROMPT, 8).prefill.node_id == "p1"  # 150 - 40 > 100
    less_busy = [nodes[0], node_info("p0", "prefill", num_queued_prefill_tokens=130), nodes[2]]
    assert policy.choose(less_busy, PROMPT, 8).prefill.node_id == "p0"  # 130 - 40 < 100


def test_conversation_stays_on_its_prefill_node_while_that_pays():
    policy = RoutingPolicy(0)
    nodes = [node_info("d0", "decode"), node_info("p0", "prefill"), node_info("p1", "prefill")]
    turn1 = policy.choose(nodes, PROMPT, 8)
    policy.record("t1", turn1, len(PROMPT), now=1.0)
    policy.remember_prefix(turn1)
    policy.finish("t1")
    busier = [
        nodes[0],
        *(
            node_info(n.node_id, "prefill", num_queued_prefill_tokens=20)
            if n.node_id == turn1.prefill.node_id
            else n
            for n in nodes[1:]
        ),
    ]
    assert policy.choose(busier, PROMPT + tuple(range(100, 140)), 8).prefill.node_id == turn1.prefill.node_id


def test_a_backed_up_prefill_pool_sends_the_prompt_to_the_decode_nodes_own_queue():
    # 40 prompt tokens at 100 tok/s; the margin is 1 s of waiting.
    policy = RoutingPolicy(0, local_prefill_margin_s=1.0)

    def route(prefill_queue: int, decode_queue: int, speed: float | None = 100.0):
        nodes = [
            node_info("d0", "decode", num_queued_prefill_tokens=decode_queue),
            node_info("p0", "prefill", num_queued_prefill_tokens=prefill_queue, prefill_tokens_per_s=speed),
        ]
        return policy.choose(nodes, PROMPT, 8).prefill

    assert route(100, 0).node_id == "p0"  # 1.0 s longer behind p0: not more than the margin
    assert route(101, 0) is None  # 1.01 s longer: the decode node prefills it
    nodes = [
        node_info("d0", "decode"),
        node_info("p0", "prefill", num_queued_prefill_tokens=101, prefill_tokens_per_s=100.0),
    ]
    assert policy.choose(nodes, PROMPT, 8).placement == "backed_up"
    assert policy.choose(nodes[:1], PROMPT, 8).placement == "no_prefill_node"
    assert policy.choose(nodes, PROMPT, 8, disaggregate=False).placement == "resumed"
    assert RoutingPolicy(41).choose(nodes, PROMPT, 8).placement == "short"
    assert RoutingPolicy(40).choose(nodes, PROMPT, 8).placement == "prefill_node"
    assert route(140, 40).node_id == "p0"  # the decode node's own queue counts against it
    assert route(141, 40) is None
    assert route(10_000, 0, speed=None).node_id == "p0"  # no measured speed: no guess
    assert (
        RoutingPolicy(0)
        .choose(  # the margin's default is off
            [
                node_info("d0", "decode"),
                node_info("p0", "prefill", num_queued_prefill_tokens=10_000, prefill_tokens_per_s=100.0),
            ],
            PROMPT,
            8,
        )
        .prefill.node_id
        == "p0"
    )


def test_a_busy_decode_node_prefills_locally_only_under_a_tpot_slo_its_step_target_fits():
    policy = RoutingPolicy(0, local_prefill_margin_s=1.0, tpot_slo_s=0.25)
    prefill = node_info("p0", "prefill", num_queued_prefill_tokens=10_000, prefill_tokens_per_s=100.0)

    def placement(**decode_fields) -> str:
        return policy.choose([node_info("d0", "decode", **decode_fields), prefill], PROMPT, 8).placement

    assert placement(num_running=0) == "backed_up"  # idle: nobody's time per token to protect
    assert placement(num_running=3, step_target_s=0.2) == "backed_up"  # its steps stay within the SLO
    assert placement(num_running=3, step_target_s=0.6) == "prefill_node"  # they would not
    assert placement(num_running=3) == "prefill_node"  # a target not yet known is not trusted
    no_slo = RoutingPolicy(0, local_prefill_margin_s=1.0)  # without one, no prompt slows running decodes

    def without_slo(**decode_fields) -> str:
        return no_slo.choose([node_info("d0", "decode", **decode_fields), prefill], PROMPT, 8).placement

    assert without_slo(num_running=3, step_target_s=0.05) == "prefill_node"
    assert without_slo(num_running=0) == "backed_up"  # an idle one still helps the backed-up pool


def test_the_predicted_ttft_is_the_prefilling_nodes_prompt_queue_at_its_speed():
    policy = RoutingPolicy(0)
    nodes = [
        node_info("d0", "decode", num_queued_prefill_tokens=50, prefill_tokens_per_s=200.0),
        node_info("p0", "prefill", num_queued_prefill_tokens=160, prefill_tokens_per_s=100.0),
    ]
    route = policy.choose(nodes, PROMPT, 8)
    assert route.prefill.node_id == "p0"
    assert policy.predicted_ttft_s(route, len(PROMPT)) == (160 + len(PROMPT)) / 100.0
    policy.record("r1", route, len(PROMPT), now=1.0)  # sent since p0's heartbeat: queued there too
    assert policy.predicted_ttft_s(route, len(PROMPT)) == (160 + 2 * len(PROMPT)) / 100.0
    local = RoutingPolicy(10_000).choose(nodes, PROMPT, 8)  # below the threshold: the decode node
    assert local.prefill is None and RoutingPolicy(10_000).predicted_ttft_s(local, len(PROMPT)) == (
        (50 + len(PROMPT)) / 200.0
    )
    unmeasured = [node_info("d0", "decode"), node_info("p0", "prefill")]
    cold = RoutingPolicy(0)
    first = cold.choose(unmeasured, PROMPT, 8)
    assert cold.predicted_ttft_s(first, len(PROMPT), unmeasured) is None  # an empty queue: admitted
    cold.record("r1", first, len(PROMPT), now=1.0)
    assert cold.predicted_ttft_s(first, len(PROMPT), unmeasured) == math.inf  # behind an unknown speed
    other = [
        *unmeasured,
        node_info("p1", "prefill", num_queued_prefill_tokens=999, prefill_tokens_per_s=50.0),
    ]
    assert cold.predicted_ttft_s(first, len(PROMPT), other) == 2 * len(PROMPT) / 50.0  # the pool's speed


def test_prompts_sent_since_the_heartbeat_count_in_both_queues():
    policy = RoutingPolicy(0, local_prefill_margin_s=1.0)
    nodes = [
        node_info("d0", "decode"),
        node_info("p0", "prefill", num_queued_prefill_tokens=80, prefill_tokens_per_s=100.0),
    ]
    first = policy.choose(nodes, PROMPT, 8)
    assert first.prefill.node_id == "p0"  # 0.8 s longer
    policy.record("r1", first, len(PROMPT), now=1.0)  # p0 has 40 more, not in its report yet
    second = policy.choose(nodes, tuple(range(100, 140)), 8)
    assert second.prefill is None  # 1.2 s longer now
    policy.record("r2", second, 40, now=1.0)  # and now the decode node has 40 queued itself
    assert policy.choose(nodes, tuple(range(200, 240)), 8).prefill.node_id == "p0"  # 0.8 s again


def test_only_nodes_with_the_decode_fingerprint_prefill():
    other = dataclasses.replace(FINGERPRINT, block_size=8)
    nodes = [node_info("d0", "decode"), node_info("p0", "prefill", fingerprint=other)]
    assert RoutingPolicy(0).choose(nodes, PROMPT, 8).prefill is None


def test_draining_excluded_and_too_short_nodes_are_skipped():
    nodes = [
        node_info("d0", "decode", draining=True),
        node_info("d1", "decode", max_model_len=40),
        node_info("d2", "decode", num_blocks_free=1),
    ]
    policy = RoutingPolicy(1000)
    assert policy.choose(nodes, PROMPT, 8).decode.node_id == "d2"
    assert policy.choose(nodes, PROMPT, 8, exclude=frozenset({"d2"})) is None


def test_colocated_node_prefills_even_a_long_prompt_itself_and_never_prefills_for_others():
    nodes = [
        node_info("c0", "colocated", num_blocks_free=90),
        node_info("d0", "decode", num_blocks_free=80),
        node_info("p0", "prefill"),
    ]
    to_colocated = RoutingPolicy(disagg_threshold=0).choose(nodes, PROMPT, 8)
    assert to_colocated.decode.node_id == "c0" and to_colocated.prefill is None
    assert to_colocated.placement == "colocated"
    to_decode = RoutingPolicy(disagg_threshold=0).choose(nodes, PROMPT, 8, exclude=frozenset({"c0"}))
    assert to_decode.decode.node_id == "d0" and to_decode.prefill.node_id == "p0"


def test_colocated_nodes_alone_serve_by_queued_prompt_tokens_then_free_blocks():
    nodes = [
        node_info("c0", "colocated", num_blocks_free=50),
        node_info("c1", "colocated", num_blocks_free=80),
    ]
    policy = RoutingPolicy(disagg_threshold=0)
    first = policy.choose(nodes, PROMPT, 8)
    assert first.decode.node_id == "c1" and first.prefill is None  # no queue anywhere: most free
    policy.record("r1", first, len(PROMPT), now=10.0)  # 40 prompt tokens queued on c1 since its heartbeat
    second = policy.choose(nodes, PROMPT, 8)
    assert second.decode.node_id == "c0"
    policy.record("r2", second, len(PROMPT), now=10.0)  # 40 each: free blocks decide again
    assert policy.choose(nodes, PROMPT, 8).decode.node_id == "c1"


def test_a_colocated_nodes_cache_counts_as_prompt_tokens_it_need_not_queue():
    """A cached prefix saves the node that many prompt tokens of work, and no more: a prompt goes
    to the node holding its prefix unless that node's queue is longer by more than the prefix."""
    for queued_on_c0, expected in ((39, "c0"), (41, "c1")):
        nodes = [
            node_info("c0", "colocated", num_queued_prefill_tokens=queued_on_c0),
            node_info("c1", "colocated", num_blocks_free=200),
        ]
        policy = RoutingPolicy(disagg_threshold=0)
        policy.remember_prefix(policy.choose(nodes, PROMPT, 8, exclude=frozenset({"c1"})))  # c0 caches 40
        assert policy.choose(nodes, PROMPT, 8).decode.node_id == expected


def test_without_prefix_routing_a_cached_prompt_is_routed_by_load_alone():
    nodes = [node_info("d0", "decode", num_blocks_free=50), node_info("d1", "decode", num_blocks_free=52)]
    for prefix_routing, expected in ((True, "d0"), (False, "d1")):
        policy = RoutingPolicy(1000, prefix_routing=prefix_routing)
        policy.remember_prefix(policy.choose(nodes, PROMPT, 8, exclude=frozenset({"d1"})))  # d0 caches PROMPT
        assert policy.choose(nodes, PROMPT, 8).decode.node_id == expected  # d0: 50 free + 10 cached


def test_prefix_map_matches_leading_blocks_only_and_evicts_oldest():
    prefixes = PrefixMap(capacity=3)
    prefixes.record([1, 2, 3], "a")
    assert prefixes.num_cached_blocks([1, 2, 9], "a") == 2
    assert prefixes.num_cached_blocks([9, 2, 3], "a") == 0
    prefixes.record([4], "b")
    assert prefixes.num_cached_blocks([1, 2], "a") == 0  # block 1 evicted


def test_admission_sheds_beyond_the_limit_with_retry_after():
    admission = Admission({Stage.PREFILL: 2, Stage.DECODE: 3})
    admission.admit(Stage.DECODE, 2)
    with pytest.raises(APIError) as raised:
        admission.admit(Stage.DECODE, 2)
    assert raised.value.status == 429 and raised.value.headers()["Retry-After"] == "1"
    assert admission.num_inflight[Stage.DECODE] == 2 and admission.num_rejected[Stage.DECODE] == 1
    admission.release(Stage.DECODE, 2)
    admission.admit(Stage.DECODE, 3)


def test_ticket_releases_each_role_once():
    admission = Admission({Stage.PREFILL: 1, Stage.DECODE: 1})
    admission.admit(Stage.PREFILL)
    admission.admit(Stage.DECODE)
    ticket = Ticket(admission, (Stage.PREFILL, Stage.DECODE))
    ticket.release(Stage.PREFILL)
    ticket.release(Stage.PREFILL)
    ticket.release_all()
    ticket.release_all()
    assert admission.num_inflight == {Stage.PREFILL: 0, Stage.DECODE: 0}


@pytest.mark.parametrize(
    ("predicted", "slo", "shed"),
    [
        (None, 4.0, None),  # no prediction: admitted
        (3.9, 4.0, None),
        (4.6, 4.0, ("ttft_slo", 1, "in about 4.6 s, beyond the 4 s TTFT SLO")),
        (9.2, 4.0, ("ttft_slo", 6, "in about 9.2 s, beyond the 4 s TTFT SLO")),
        (math.inf, 4.0, ("ttft_slo", 1, "after prompts whose speed no node has measured yet")),
        (59.0, None, None),  # no SLO: only what would pass the chunk timeout (60 s)
        (math.inf, None, None),  # ... and an unknown speed is no reason without an SLO
        (75.0, None, ("queue_timeout", 15, "after the router would give up waiting for it (60 s")),
    ],
)
def test_a_first_token_predicted_too_late_is_shed_with_429_and_retry_after(predicted, slo, shed):
    from prometheus_client import CollectorRegistry, Counter

    from pdserve.router.admission import shed_late_first_token

    counter = Counter("shed", "", ["reason"], registry=CollectorRegistry())
    if shed is None:
        shed_late_first_token(predicted, slo, 60.0, counter)
        return
    reason, retry_after, words = shed
    with pytest.raises(APIError) as caught:
        shed_late_first_token(predicted, slo, 60.0, counter)
    error = caught.value
    assert (error.status, error.code, error.retry_after_s) == (429, "overloaded", retry_after)
    assert words in error.message
    assert counter.labels(reason=reason)._value.get() == 1


def test_prefix_map_tells_a_nodes_pool_from_its_offload_tier_by_recency():
    prefixes = PrefixMap()
    prefixes.record([1, 2, 3], "a")  # the oldest three blocks a took
    prefixes.record([7, 8, 9, 10], "a")
    assert prefixes.cached_blocks([1, 2, 3], "a", pool_blocks=4) == (0, 3)  # past its pool: tier
    assert prefixes.cached_blocks([7, 8, 9], "a", pool_blocks=4) == (3, 0)
    assert prefixes.cached_blocks([1, 2, 3], "a", pool_blocks=None) == (3, 0)  # no tier: as before
    prefixes.record([1], "a")  # used again: back in the pool, the rest of its prompt still in the tier
    assert prefixes.cached_blocks([1, 2, 3], "a", pool_blocks=4) == (1, 2)


def test_a_prefix_in_a_nodes_offload_tier_spares_its_load_share_of_the_prompt_queue():
    """A node with a tier holds prefixes past its pool; routing counts them as cached at what
    loading them costs over computing them (its measured speeds), a node without as before."""
    block = FINGERPRINT.block_size
    prompt = list(range(3, 3 + 8 * block + 1))
    tiered = node_info(
        "p0",
        "prefill",
        num_blocks_total=4,
        prefill_tokens_per_s=100.0,
        kv_offload={"read_blocks": 10, "load_us": 10 * block * 1000},  # 1000 tokens/s: a tenth
    )
    plain = dataclasses.replace(tiered, node_id="p1", kv_offload=None)
    policy = RoutingPolicy(0)
    hashes = tuple(hash_full_blocks(prompt, block))
    for node in (tiered, plain):
        policy.prefill_prefixes.record(hashes, node.node_id)  # 8 blocks: 4 past the pool of 4
    route = policy.choose([node_info("d0", "decode"), tiered], prompt, 8)
    assert route.prefill.node_id == "p0"
    full = len(prompt)
    assert policy.predicted_ttft_s(route, full) == pytest.approx((full - 4 * block - 4 * block * 0.9) / 100.0)
    plain_route = policy.choose([node_info("d0", "decode"), plain], prompt, 8)
    assert policy.predicted_ttft_s(plain_route, full) == pytest.approx((full - 8 * block) / 100.0)
