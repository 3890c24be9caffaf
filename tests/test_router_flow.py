"""The router end to end against fake nodes (real sockets, real uvicorn, no model): routing,
streaming, n > 1, stop strings, logprobs, usage, failover, timeouts, disconnects, admission."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import openai
import pytest

from protocol import messages as pm
from router.tokenizer import Tokenizer
from tests.test_router_support import FakeNode, fake_cluster

TEXT = " The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def tokens(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT)


def _pair(tokens, **decode_fields):
    return [
        FakeNode("p0", "prefill", tokens, num_cached_tokens=4),
        FakeNode("d0", "decode", tokens, **decode_fields),
    ]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


LONG_PROMPT = "Tell me a story about a fox and a dog, please."  # over the test threshold of 4 tokens


def test_completion_goes_prefill_then_decode_with_exact_usage(default_model_dir, tokenizer, tokens):
    async def go():
        nodes = _pair(tokens)
        async with fake_cluster(default_model_dir, nodes) as cluster:
            client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x")
            cluster.closers.append(client)
            done = await client.completions.create(
                model=default_model_dir.name, prompt=LONG_PROMPT, max_tokens=len(tokens), temperature=0
            )
        return nodes, done

    (prefill, decode), done = _run(go())
    request = prefill.received[0]
    assert request.decode_addr == decode.info.kv_addr and decode.received == []
    assert request.sampling_params.n == 1 and request.sampling_params.temperature == 0
    assert list(request.token_ids) == tokenizer.encode(LONG_PROMPT)
    assert done.choices[0].text == TEXT and done.choices[0].finish_reason == "length"
    usage = done.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(request.token_ids), len(tokens))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 4


def test_short_prompt_goes_to_the_decode_node_alone(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens)
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}
            )
        return nodes, reply

    (prefill, decode), reply = _run(go())
    assert reply.status_code == 200, reply.text
    assert prefill.received == [] and decode.received[0].decode_addr is None


def test_streamed_text_equals_whole_text_for_chat_and_completions(default_model_dir, tokens):
    async def go():
        async with fake_cluster(default_model_dir, _pair(tokens)) as cluster:
            client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x")
            cluster.closers.append(client)
            model = default_model_dir.name
            whole = await client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=7)
            parts = [
                c
                async for c in await client.completions.create(
                    model=model,
                    prompt=LONG_PROMPT,
                    max_tokens=7,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            ]
            messages = [{"role": "user", "content": "Say something."}]
            chat = await client.chat.completions.create(model=model, messages=messages, max_tokens=7)
            chat_parts = [
                c
                async for c in await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=7, stream=True
                )
            ]
        return whole, parts, chat, chat_parts

    whole, parts, chat, chat_parts = _run(go())
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == 7
    assert parts[-2].choices[0].finish_reason == "length"
    assert chat_parts[0].choices[0].delta.role == "assistant"
    streamed = "".join(p.choices[0].delta.content or "" for p in chat_parts)
    assert streamed == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"


def test_n_samples_are_split_with_distinct_ids_and_seeds(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens)
        async with fake_cluster(default_model_dir, nodes) as cluster:
            client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x")
            cluster.closers.append(client)
            done = await client.completions.create(
                model=default_model_dir.name, prompt=LONG_PROMPT, max_tokens=3, n=3, seed=7
            )
        return nodes, done

    (prefill, _), done = _run(go())
    requests = sorted(prefill.received, key=lambda r: r.request_id)
    assert [r.request_id.rsplit("-", 1)[1] for r in requests] == ["0", "1", "2"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in requests)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert done.usage.prompt_tokens == len(requests[0].token_ids) and done.usage.completion_tokens == 9


def test_stop_string_cuts_the_text_and_aborts_the_node(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens, token_delay_s=0.02)
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            body = {"prompt": LONG_PROMPT, "max_tokens": 50, "stop": ["fox j", "nothing"]}
            reply = await http.post(cluster.base_url + "/v1/completions", json=body)
            await asyncio.sleep(0.2)
        return nodes, reply

    (_, decode), reply = _run(go())
    choice = reply.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" The quick brown ", "stop")
    assert len(decode.aborted) == 1


def test_logprobs_in_completions_and_chat_shapes(default_model_dir, tokenizer, tokens):
    async def go():
        async with fake_cluster(default_model_dir, _pair(tokens)) as cluster, httpx.AsyncClient() as http:
            completion = await http.post(
                cluster.base_url + "/v1/completions",
                json={
                    "prompt": LONG_PROMPT,
                    "max_tokens": 2,
                    "logprobs": 2,
                    "return_tokens_as_token_ids": True,
                },
            )
            chat = await http.post(
                cluster.base_url + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi there, how are you?"}],
                    "max_tokens": 2,
                    "logprobs": True,
                    "top_logprobs": 1,
                },
            )
        return completion.json(), chat.json()

    completion, chat = _run(go())
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{tokens[0]}", f"token_id:{tokens[1]}"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {f"token_id:{tokens[0]}": -0.5, f"token_id:{tokens[1]}": -1.5}
    content = chat["choices"][0]["logprobs"]["content"]
    first = tokenizer.token_text(tokens[0])
    assert content[0]["token"] == first and content[0]["bytes"] == list(first.encode())
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5]


def test_retryable_failure_before_any_token_retries_on_another_prefill(default_model_dir, tokens):
    async def go():
        bad = FakeNode("p0", "prefill", tokens, num_queued_prefill_tokens=0)
        bad.fail_with = pm.RequestFailed("", "p0", "kv_transfer", "decode refused", True)
        good = FakeNode("p1", "prefill", tokens, num_queued_prefill_tokens=10)
        nodes = [bad, good, FakeNode("d0", "decode", tokens)]
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 3}
            )
            metrics = (await http.get(cluster.base_url + "/metrics")).text
        return bad, good, reply, metrics

    bad, good, reply, metrics = _run(go())
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

    hung, reply = _run(go())
    assert reply.status_code == 200, reply.text
    assert hung.aborted == [hung.received[0].request_id]


def test_non_retryable_failure_is_a_json_error_not_an_empty_200(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens)
        nodes[0].fail_with = pm.RequestFailed("", "p0", "bad_request", "prompt rejected", False)
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            return await http.post(
                cluster.base_url + "/v1/completions",
                json={"prompt": LONG_PROMPT, "max_tokens": 2, "stream": True},
            )

    reply = _run(go())
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "bad_request"


def test_decode_failure_mid_stream_ends_with_an_error_event(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens)
        nodes[1].fail_after = 3
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            body = {"prompt": LONG_PROMPT, "max_tokens": 8, "stream": True}
            async with http.stream("POST", cluster.base_url + "/v1/completions", json=body) as reply:
                lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
            whole = await http.post(cluster.base_url + "/v1/completions", json={**body, "stream": False})
        return reply, lines, whole

    reply, lines, whole = _run(go())
    assert reply.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "internal"
    assert whole.status_code == 502 and whole.json()["error"]["code"] == "internal"


def test_whole_answer_is_replayed_when_decode_fails_after_the_first_token(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens)
        nodes[1].fail_after, nodes[1].fail_once = 2, True
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": len(tokens)}
            )
        return nodes, reply

    (prefill, decode), reply = _run(go())
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == TEXT
    assert reply.json()["usage"]["completion_tokens"] == len(tokens)
    replayed = [
        r.request_id for r in prefill.received + decode.received if r.request_id.endswith(".r1")
    ]  # the one id scheme
    assert len(replayed) == 1


def test_decode_chunks_that_overtake_the_first_token_are_put_back_in_order(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens)
        nodes[0].late_first_token = True
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            return await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": len(tokens)}
            )

    assert _run(go()).json()["choices"][0]["text"] == TEXT


def test_client_disconnect_aborts_on_both_nodes_within_a_second(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens, token_delay_s=0.05)
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            body = {"prompt": LONG_PROMPT, "max_tokens": 200, "stream": True}
            async with http.stream("POST", cluster.base_url + "/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data: "):
                        break
            await asyncio.sleep(1.0)
            inflight = (await http.get(cluster.base_url + "/metrics")).text
        return nodes, inflight

    (prefill, decode), inflight = _run(go())
    request_id = prefill.received[0].request_id
    assert prefill.aborted == [request_id] and decode.aborted == [request_id]
    assert 'pdserve_router_inflight_requests{role="decode"} 0' in inflight


def test_over_admission_limit_is_429_with_retry_after(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens, token_delay_s=0.05)
        async with (
            fake_cluster(default_model_dir, nodes, max_inflight_decode=2) as cluster,
            httpx.AsyncClient() as http,
        ):
            url = cluster.base_url + "/v1/completions"
            slow = asyncio.create_task(http.post(url, json={"prompt": LONG_PROMPT, "max_tokens": 20, "n": 2}))
            await asyncio.sleep(0.3)
            shed = await http.post(url, json={"prompt": LONG_PROMPT, "max_tokens": 2})
            return shed, await slow

    shed, slow = _run(go())
    assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
    assert shed.json()["error"]["type"] == "rate_limit_error"
    assert slow.status_code == 200


def test_echo_puts_the_prompt_before_the_output(default_model_dir, tokens):
    async def go():
        async with fake_cluster(default_model_dir, _pair(tokens)) as cluster, httpx.AsyncClient() as http:
            return await http.post(
                cluster.base_url + "/v1/completions",
                json={"prompt": LONG_PROMPT, "max_tokens": 2, "echo": True},
            )

    text = _run(go()).json()["choices"][0]["text"]
    assert text == LONG_PROMPT + " The quick"


def test_retries_and_replays_share_one_budget_of_max_attempts(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens)
        nodes[1].fail_after = 2  # the decode node fails every attempt after two tokens
        async with (
            fake_cluster(default_model_dir, nodes, max_attempts=3) as cluster,
            httpx.AsyncClient() as http,
        ):
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": len(tokens)}
            )
        return nodes, reply

    (prefill, decode), reply = _run(go())
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
        prefill, bad = _pair(tokens)
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

    prefill, bad, good, reply, ids, usage, metrics = _run(go())
    assert reply.status_code == 200
    assert ids == tokens  # every token once, in order: none lost, none repeated
    assert usage["completion_tokens"] == len(tokens)
    (resumed,) = good.received  # the migrated attempt went to the healthy decode node alone
    assert resumed.request_id.endswith(".r1") and resumed.decode_addr is None
    assert list(resumed.output_token_ids) == tokens[:4]  # the first token (prefill) + 3 from d0
    assert "pdserve_migrations_total 1" in metrics


def test_with_migration_off_a_stream_fails_and_a_whole_answer_replays_from_scratch(default_model_dir, tokens):
    async def go():
        nodes = _pair(tokens)
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

    (prefill, decode), lines, whole = _run(go())
    assert json.loads(lines[-2][6:])["error"]["code"] == "internal"
    assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == TEXT
    assert all(not r.output_token_ids for r in prefill.received + decode.received)
