"""Where each request ran, on the response: the x-pdserve-* headers, the last stream chunk's
``pdserve_route`` when the route changed after the headers, the paths counter in /metrics, and
the idle-prefill-pool warning. The real router against fake nodes (tests/test_router_support.py),
so failures before and after the first token happen on cue."""

from __future__ import annotations

import dataclasses
import json
import logging

import httpx
import pytest

from pdserve.protocol import messages as pm
from pdserve.protocol.registry import Role
from pdserve.router import route_trail
from pdserve.router.policy import Placement, Route
from pdserve.router.tokenizer import Tokenizer
from tests.test_router_support import (
    LONG_PROMPT,
    TEXT,
    FakeNode,
    fake_cluster,
    fake_pair,
    node_info,
    run_async,
)


@pytest.fixture(scope="module")
def tokens(default_model_dir) -> list[int]:
    return Tokenizer(default_model_dir).encode(TEXT)


def _route(placement: Placement, prefill: bool = False) -> Route:
    decode = node_info("d0", "decode")
    return Route(decode, node_info("p0", "prefill") if prefill else None, (), 1, placement)


def test_each_placement_maps_to_its_path_and_reason():
    cases = [
        (_route(Placement.PREFILL_NODE, prefill=True), False, ("disaggregated", None, "p0")),
        (_route(Placement.COLOCATED), False, ("colocated", None, None)),
        (_route(Placement.SHORT), False, ("local-prefill", "short-prompt", None)),
        (_route(Placement.BACKED_UP), False, ("local-prefill", "prefill-backed-up", None)),
        (_route(Placement.NO_PREFILL_NODE), False, ("local-prefill", "no-prefill-node", None)),
        (_route(Placement.NO_PREFILL_NODE), True, ("local-prefill", "prefill-retry", None)),
        (_route(Placement.SHORT), True, ("local-prefill", "short-prompt", None)),
    ]
    for route, after_failure, (path, reason, prefill) in cases:
        leg = route_trail.leg_of(route, after_failure)
        assert (leg.path, leg.reason, leg.prefill_node, leg.decode_node) == (path, reason, prefill, "d0")


def test_headers_list_one_entry_per_sample_and_the_optional_ones_only_when_set():
    disagg, local = route_trail.RouteTrail(), route_trail.RouteTrail()
    disagg.sent(_route(Placement.PREFILL_NODE, prefill=True), resumed=False)
    disagg.first_output()
    assert route_trail.headers([disagg]) == {
        "x-pdserve-path": "disaggregated",
        "x-pdserve-prefill-node": "p0",
        "x-pdserve-decode-node": "d0",
    }
    local.sent(_route(Placement.PREFILL_NODE, prefill=True), resumed=False)
    local.sent(_route(Placement.NO_PREFILL_NODE), resumed=False)  # the prefill attempt failed
    local.first_output()
    assert route_trail.headers([disagg, local]) == {
        "x-pdserve-path": "disaggregated, local-prefill",
        "x-pdserve-path-reason": "-, prefill-retry",
        "x-pdserve-prefill-node": "p0, -",
        "x-pdserve-decode-node": "d0, d0",
        "x-pdserve-retries": "0, 1",
    }


def _metric(metrics: str, path: str, reason: str) -> float:
    line = f'pdserve_request_paths_total{{path="{path}",reason="{reason}"}}'
    return float(next(x for x in metrics.splitlines() if x.startswith(line)).split()[-1])


def test_disaggregated_and_short_prompts_say_where_they_ran_and_count_in_metrics(default_model_dir, tokens):
    async def go():
        async with fake_cluster(default_model_dir, fake_pair(tokens)) as cluster, httpx.AsyncClient() as http:
            url = cluster.base_url + "/v1/completions"
            long = await http.post(url, json={"prompt": LONG_PROMPT, "max_tokens": 3})
            short = await http.post(url, json={"prompt": "Hi", "max_tokens": 3})
            body = {"prompt": "Once more: " + LONG_PROMPT, "max_tokens": 3, "stream": True}
            async with http.stream("POST", url, json=body) as streamed:
                lines = [line async for line in streamed.aiter_lines() if line.startswith("data: {")]
            metrics = (await http.get(cluster.base_url + "/metrics")).text
        return long, short, streamed, lines, metrics

    long, short, streamed, lines, metrics = run_async(go())
    for reply in (long, streamed):
        assert reply.headers["x-pdserve-path"] == "disaggregated"
        assert reply.headers["x-pdserve-prefill-node"] == "p0"
        assert reply.headers["x-pdserve-decode-node"] == "d0"
        assert "x-pdserve-path-reason" not in reply.headers and "x-pdserve-retries" not in reply.headers
    assert short.headers["x-pdserve-path"] == "local-prefill"
    assert short.headers["x-pdserve-path-reason"] == "short-prompt"
    assert "x-pdserve-prefill-node" not in short.headers
    assert not any("pdserve_route" in json.loads(line[6:]) for line in lines)  # nothing changed
    assert _metric(metrics, "disaggregated", "none") == 2
    assert _metric(metrics, "local-prefill", "short-prompt") == 1
    assert _metric(metrics, "local-prefill", "no-prefill-node") == 0


def test_a_prefill_failure_retried_locally_says_prefill_retry_and_warns_of_the_idle_pool(
    default_model_dir, tokens, caplog
):
    async def go():
        prefill, decode = fake_pair(tokens)
        prefill.fail_with = pm.RequestFailed(
            request_id="", node_id="p0", code="kv_transfer", message="lost", retryable=True
        )
        async with fake_cluster(default_model_dir, [prefill, decode]) as cluster, httpx.AsyncClient() as http:
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2}
            )
            metrics = (await http.get(cluster.base_url + "/metrics")).text
        return reply, metrics

    with caplog.at_level(logging.WARNING, logger="pdserve.router.route_trail"):
        reply, metrics = run_async(go())
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-pdserve-path"] == "local-prefill"
    assert reply.headers["x-pdserve-path-reason"] == "prefill-retry"
    assert reply.headers["x-pdserve-retries"] == "1"
    assert _metric(metrics, "local-prefill", "prefill-retry") == 1
    assert any("prefill pool idle" in r.getMessage() and "p0" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("stream", [True, "usage", False])
def test_a_migration_after_the_headers_is_told_in_the_last_chunk_or_the_whole_answers_headers(
    default_model_dir, tokens, stream
):
    async def go():
        prefill, bad = fake_pair(tokens, token_delay_s=0.05)  # the stream starts before d0 fails
        bad.fail_after = 4
        good = FakeNode("d1", "decode", tokens)
        good.info = dataclasses.replace(good.info, num_blocks_free=1)  # routed to d0 first
        body = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": len(tokens)}
        async with (
            fake_cluster(default_model_dir, [prefill, bad, good]) as cluster,
            httpx.AsyncClient() as http,
        ):
            url = cluster.base_url + "/v1/chat/completions"
            if not stream:
                return await http.post(url, json=body), []
            streamed = {**body, "stream": True}
            if stream == "usage":
                streamed["stream_options"] = {"include_usage": True}
            async with http.stream("POST", url, json=streamed) as reply:
                return reply, [line async for line in reply.aiter_lines() if line.startswith("data: ")]

    reply, lines = run_async(go())
    assert reply.status_code == 200
    if not stream:  # written at the end: exact, the migration included
        assert reply.headers["x-pdserve-decode-node"] == "d0>d1"
        assert reply.headers["x-pdserve-migrations"] == "1"
        return
    assert (
        reply.headers["x-pdserve-path"] == "disaggregated" and reply.headers["x-pdserve-decode-node"] == "d0"
    )
    # what the headers said when the stream started (a heavy load may let the migration begin first)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    if stream == "usage":  # the usage chunk, which has no choices, carries it
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(tokens)
    else:  # every chunk has a choice (clients read choices[0]); the finish chunk carries it
        assert all(len(c["choices"]) == 1 for c in chunks)
        last = chunks[-1]
        assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last
    assert last["object"] == "chat.completion.chunk"
    assert [c for c in chunks if "pdserve_route" in c] == [last]
    assert last["pdserve_route"] == [
        {
            "path": "disaggregated",
            "reason": None,
            "prefill_node": "p0",
            "decode_nodes": ["d0", "d1"],
            "retries": 0,
            "migrations": 1,
        }
    ]


def test_the_idle_warning_skips_short_prompts_and_busy_pools():
    leg = route_trail.leg_of(_route(Placement.SHORT), False)
    busy = node_info("p0", "prefill", num_queued_prefill_tokens=100)
    route = _route(Placement.NO_PREFILL_NODE)
    idle = node_info("p1", "prefill")
    assert idle.role is Role.PREFILL
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("pdserve.router.route_trail")
    logger.addHandler(handler)
    try:
        route_trail.warn_if_prefill_idle(route, leg, 100, [idle])  # short: by design, no warning
        route_trail.warn_if_prefill_idle(route, route_trail.leg_of(route, False), 100, [busy])
    finally:
        logger.removeHandler(handler)
    assert records == []
