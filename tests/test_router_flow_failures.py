"""The router end to end against fake nodes when something fails: retries on another prefill node,
timeouts, errors before and after the first token, client disconnects, the shared retry budget,
and a sample resumed on another decode node mid-output (migration) or replayed from scratch."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest

from pdserve.protocol import messages as pm
from pdserve.router.tokenizer import Tokenizer
from tests.test_router_support import LONG_PROMPT, TEXT, FakeNode, fake_cluster, fake_pair, run_async


@pytest.fixture(scope="module")
def tokens(default_model_dir) -> list[int]:
    return Tokenizer(default_model_dir).encode(TEXT)


def test_retryable_failure_before_any_token_retries_on_another_prefill(default_model_dir, tokens):
    async def go():
        bad = FakeNode("p0", "prefill", tokens, num_queued_prefill_tokens=0)
        bad.fail_with = pm.RequestFailed(
            request_id="", node_id="p0", code="kv_transfer", message="decode refused", retryable=True
        )
        good = FakeNode("p1", "prefill", tokens, num_queued_prefill_tokens=10)
        nodes = [bad, good, FakeNode("d0", "decode", tokens)]
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 3}
            )
            metrics = (await http.get(cluster.base_url + "/metrics")).text
        return bad, good, reply, metrics

    bad, good, reply, metrics = run_async(go())
    assert reply.status_code == 200, reply.text
    assert len(bad.received) == 1 and good.received[0].request_id == bad.received[0].request_id + ".r1"
    assert "pdserve_retries_total 1" in metrics


def test_hung_prefill_times_out_and_retries_elsewhere(default_model_dir, tokens):
    async def go():
        hung = FakeNode("p0", "prefill", tokens)
        hung.silent = True
        nodes = [
            hung,
            FakeNode("p1", "prefill", tokens, num_queued_prefill_tokens=10),
            FakeNode("d0", "decode", tokens),
        ]
        async with (
            fake_cluster(default_model_dir, nodes, chunk_timeout_s=0.5) as cluster,
            httpx.AsyncClient() as http,
        ):
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2}
            )
        return hung, reply

    hung, reply = run_async(go())
    assert reply.status_code == 200, reply.text
    assert hung.aborted == [hung.received[0].request_id]


def test_non_retryable_failure_is_a_json_error_not_an_empty_200(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens)
        nodes[0].fail_with = pm.RequestFailed(
            request_id="", node_id="p0", code="bad_request", message="prompt rejected", retryable=False
        )
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            return await http.post(
                cluster.base_url + "/v1/completions",
                json={"prompt": LONG_PROMPT, "max_tokens": 2, "stream": True},
            )

    reply = run_async(go())
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "bad_request"


def test_decode_failure_mid_stream_ends_with_an_error_event(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens)
        nodes[1].fail_after = 3
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            body = {"prompt": LONG_PROMPT, "max_tokens": 8, "stream": True}
            async with http.stream("POST", cluster.base_url + "/v1/completions", json=body) as reply:
                lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
            whole = await http.post(cluster.base_url + "/v1/completions", json={**body, "stream": False})
        return reply, lines, whole

    reply, lines, whole = run_async(go())
    assert reply.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "internal"
    assert whole.status_code == 502 and whole.json()["error"]["code"] == "internal"


def test_whole_answer_is_replayed_when_decode_fails_after_the_first_token(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens)
        nodes[1].fail_after, nodes[1].fail_once = 2, True
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": len(tokens)}
            )
        return nodes, reply

    (prefill, decode), reply = run_async(go())
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == TEXT
    assert reply.json()["usage"]["completion_tokens"] == len(tokens)
    replayed = [
        r.request_id for r in prefill.received + decode.received if r.request_id.endswith(".r1")
    ]  # the one id scheme
    assert len(replayed) == 1


def test_client_disconnect_aborts_on_both_nodes_within_a_second(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens, token_delay_s=0.05)
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            body = {"prompt": LONG_PROMPT, "max_tokens": 200, "stream": True}
            async with http.stream("POST", cluster.base_url + "/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data: "):
                        break
            await asyncio.sleep(1.0)
            inflight = (await http.get(cluster.base_url + "/metrics")).text
        return nodes, inflight

    (prefill, decode), inflight = run_async(go())
    request_id = prefill.received[0].request_id
    assert prefill.aborted == [request_id] and decode.aborted == [request_id]
    assert 'pdserve_router_inflight_requests{role="decode"} 0' in inflight


def test_retries_and_replays_share_one_budget_of_max_attempts(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens)
        nodes[1].fail_after = 2  # the decode node fails every attempt after two tokens
        async with (
            fake_cluster(default_model_dir, nodes, max_attempts=3) as cluster,
            httpx.AsyncClient() as http,
        ):
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": len(tokens)}
            )
        return nodes, reply

    (prefill, decode), reply = run_async(go())
    assert reply.status_code == 502
    ids = sorted({r.request_id.rsplit("-", 1)[-1] for r in prefill.received + decode.received})
    assert ids == ["0", "0.r1", "0.r2"]  # three tries in all (the replays may prefill on the decode node)


def _streamed_token_ids(lines: list[str]) -> list[int]:
    ids = []
    for line in lines:
        if line.startswith("data: {") and '"choices"' in line:
            for choice in json.loads(line[6:])["choices"]:
                ids += [
                    int(t.removeprefix("token_id:")) for t in (choice["logprobs"] or {}).get("tokens", [])
                ]
    return ids


@pytest.mark.parametrize("stream", [True, False])
def test_a_sample_whose_decode_node_fails_mid_output_resumes_elsewhere_with_no_gap(
    default_model_dir, tokens, stream
):
    async def go():
        prefill, bad = fake_pair(tokens)
        bad.fail_after, bad.fail_once = 4, True
        good = FakeNode("d1", "decode", tokens)
        good.info = dataclasses.replace(good.info, num_blocks_free=1)  # routed to d0 first
        async with (
            fake_cluster(default_model_dir, [prefill, bad, good]) as cluster,
            httpx.AsyncClient() as http,
        ):
            body = {
                "prompt": LONG_PROMPT,
                "max_tokens": len(tokens),
                "stream": stream,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                "stream_options": {"include_usage": True} if stream else None,
            }
            if stream:
                async with http.stream("POST", cluster.base_url + "/v1/completions", json=body) as reply:
                    lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
                usage = json.loads(lines[-2][6:])["usage"]
                ids = _streamed_token_ids(lines)
            else:
                reply = await http.post(cluster.base_url + "/v1/completions", json=body)
                usage = reply.json()["usage"]
                ids = [
                    int(t.removeprefix("token_id:")) for t in reply.json()["choices"][0]["logprobs"]["tokens"]
                ]
            metrics = (await http.get(cluster.base_url + "/metrics")).text
        return prefill, bad, good, reply, ids, usage, metrics

    prefill, bad, good, reply, ids, usage, metrics = run_async(go())
    assert reply.status_code == 200
    assert ids == tokens  # every token once, in order: none lost, none repeated
    assert usage["completion_tokens"] == len(tokens)
    (resumed,) = good.received  # the migrated attempt went to the healthy decode node alone
    assert resumed.request_id.endswith(".r1") and resumed.decode_addr is None
    assert list(resumed.output_token_ids) == tokens[:4]  # the first token (prefill) + 3 from d0
    assert "pdserve_migrations_total 1" in metrics


def test_with_migration_off_a_stream_fails_and_a_whole_answer_replays_from_scratch(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens)
        nodes[1].fail_after, nodes[1].fail_once = 3, True
        async with (
            fake_cluster(default_model_dir, nodes, migrate=False) as cluster,
            httpx.AsyncClient() as http,
        ):
            body = {"prompt": LONG_PROMPT, "max_tokens": len(tokens), "stream": True}
            async with http.stream("POST", cluster.base_url + "/v1/completions", json=body) as reply:
                lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
            nodes[1].fail_after, nodes[1].fail_once = 3, True
            whole = await http.post(cluster.base_url + "/v1/completions", json={**body, "stream": False})
        return nodes, lines, whole

    (prefill, decode), lines, whole = run_async(go())
    assert json.loads(lines[-2][6:])["error"]["code"] == "internal"
    assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == TEXT
    assert all(not r.output_token_ids for r in prefill.received + decode.received)


def test_a_sample_with_no_node_left_waits_its_reroute_time_then_fails_with_503(default_model_dir, tokens):
    """Its only decode node hangs: the retry finds no usable node, waits --reroute-wait-s for one,
    and then the client gets a 503 naming why; the wait is counted as given up on /metrics."""

    async def go():
        hung = FakeNode("d0", "decode", tokens)
        hung.silent = True
        async with (
            fake_cluster(default_model_dir, [hung], chunk_timeout_s=0.5, reroute_wait_s=0.6) as cluster,
            httpx.AsyncClient() as http,
        ):
            started = time.monotonic()
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}
            )
            took = time.monotonic() - started
            scraped = (await http.get(cluster.base_url + "/metrics")).text
        return reply, took, scraped

    reply, took, scraped = run_async(go())
    assert reply.status_code == 503 and "no usable decode node" in reply.json()["error"]["message"], (
        reply.text
    )
    assert took >= 0.5 + 0.6  # the reply timeout, then the whole reroute wait
    assert 'pdserve_node_waits_total{outcome="gave_up"} 1.0' in scraped
    assert 'pdserve_node_waits_total{outcome="found"} 0.0' in scraped
