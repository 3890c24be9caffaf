"""The router end to end against fake nodes (real sockets, real uvicorn, no model): routing,
streaming, n > 1, stop strings, logprobs, usage, chunk order, admission, echo. Failures, retries,
timeouts, disconnects and migration are in test_router_flow_failures.py."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pdserve.router.tokenizer import Tokenizer
from tests.test_router_support import LONG_PROMPT, TEXT, fake_cluster, fake_pair, run_async


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def tokens(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT)


def test_completion_goes_prefill_then_decode_with_exact_usage(default_model_dir, tokenizer, tokens):
    async def go():
        nodes = fake_pair(tokens)
        async with fake_cluster(default_model_dir, nodes) as cluster:
            client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x")
            cluster.closers.append(client)
            done = await client.completions.create(
                model=default_model_dir.name, prompt=LONG_PROMPT, max_tokens=len(tokens), temperature=0
            )
        return nodes, done

    (prefill, decode), done = run_async(go())
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
        nodes = fake_pair(tokens)
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            reply = await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}
            )
        return nodes, reply

    (prefill, decode), reply = run_async(go())
    assert reply.status_code == 200, reply.text
    assert prefill.received == [] and decode.received[0].decode_addr is None


def test_streamed_text_equals_whole_text_for_chat_and_completions(default_model_dir, tokens):
    async def go():
        async with fake_cluster(default_model_dir, fake_pair(tokens)) as cluster:
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

    whole, parts, chat, chat_parts = run_async(go())
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == 7
    assert parts[-2].choices[0].finish_reason == "length"
    assert chat_parts[0].choices[0].delta.role == "assistant"
    streamed = "".join(p.choices[0].delta.content or "" for p in chat_parts)
    assert streamed == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"


def test_n_samples_are_split_with_distinct_ids_and_seeds(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens)
        async with fake_cluster(default_model_dir, nodes) as cluster:
            client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x")
            cluster.closers.append(client)
            done = await client.completions.create(
                model=default_model_dir.name, prompt=LONG_PROMPT, max_tokens=3, n=3, seed=7
            )
        return nodes, done

    (prefill, _), done = run_async(go())
    requests = sorted(prefill.received, key=lambda r: r.request_id)
    assert [r.request_id.rsplit("-", 1)[1] for r in requests] == ["0", "1", "2"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in requests)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert done.usage.prompt_tokens == len(requests[0].token_ids) and done.usage.completion_tokens == 9


def test_stop_string_cuts_the_text_and_aborts_the_node(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens, token_delay_s=0.02)
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            body = {"prompt": LONG_PROMPT, "max_tokens": 50, "stop": ["fox j", "nothing"]}
            reply = await http.post(cluster.base_url + "/v1/completions", json=body)
            await asyncio.sleep(0.2)
        return nodes, reply

    (_, decode), reply = run_async(go())
    choice = reply.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" The quick brown ", "stop")
    assert len(decode.aborted) == 1


def test_logprobs_in_completions_and_chat_shapes(default_model_dir, tokenizer, tokens):
    async def go():
        async with fake_cluster(default_model_dir, fake_pair(tokens)) as cluster, httpx.AsyncClient() as http:
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

    completion, chat = run_async(go())
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{tokens[0]}", f"token_id:{tokens[1]}"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {f"token_id:{tokens[0]}": -0.5, f"token_id:{tokens[1]}": -1.5}
    content = chat["choices"][0]["logprobs"]["content"]
    first = tokenizer.token_text(tokens[0])
    assert content[0]["token"] == first and content[0]["bytes"] == list(first.encode())
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5]


def test_decode_chunks_that_overtake_the_first_token_are_put_back_in_order(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens)
        nodes[0].late_first_token = True
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            return await http.post(
                cluster.base_url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": len(tokens)}
            )

    assert run_async(go()).json()["choices"][0]["text"] == TEXT


def test_over_admission_limit_is_429_with_retry_after(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens, token_delay_s=0.05)
        async with (
            fake_cluster(default_model_dir, nodes, max_inflight_decode=2) as cluster,
            httpx.AsyncClient() as http,
        ):
            url = cluster.base_url + "/v1/completions"
            slow = asyncio.create_task(http.post(url, json={"prompt": LONG_PROMPT, "max_tokens": 20, "n": 2}))
            deadline = asyncio.get_running_loop().time() + 10
            while 'role="decode"} 2' not in (await http.get(cluster.base_url + "/metrics")).text:
                assert asyncio.get_running_loop().time() < deadline, "the slow request was never admitted"
                await asyncio.sleep(0.02)  # its two samples hold both slots (no fixed sleep: loaded CI)
            shed = await http.post(url, json={"prompt": LONG_PROMPT, "max_tokens": 2})
            return shed, await slow

    shed, slow = run_async(go())
    assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
    assert shed.json()["error"]["type"] == "rate_limit_error"
    assert slow.status_code == 200


def test_echo_puts_the_prompt_before_the_output(default_model_dir, tokens):
    async def go():
        async with fake_cluster(default_model_dir, fake_pair(tokens)) as cluster, httpx.AsyncClient() as http:
            return await http.post(
                cluster.base_url + "/v1/completions",
                json={"prompt": LONG_PROMPT, "max_tokens": 2, "echo": True},
            )

    text = run_async(go()).json()["choices"][0]["text"]
    assert text == LONG_PROMPT + " The quick"


def test_chunks_are_relayed_by_their_output_position_and_repeats_dropped():
    """Each chunk says where its tokens start: early ones wait for those before them, whatever
    node sent them, and a chunk seen already is dropped (a migrated attempt starts past 0)."""
    import types

    from pdserve.protocol import messages as pm
    from pdserve.router.generation import _in_order

    def chunk(position: int, *ids: int, finish=None) -> pm.TokenChunk:
        return pm.TokenChunk(
            request_id="r",
            node_id="d0",
            token_ids=ids,
            logprobs=(),
            finish_reason=finish,
            num_prompt_tokens=3,
            num_cached_tokens=0,
            position=position,
        )

    async def order(start: int, chunks: list[pm.TokenChunk]) -> list[tuple[int, ...]]:
        queue: asyncio.Queue = asyncio.Queue()
        for c in chunks:
            queue.put_nowait(c)
        node = types.SimpleNamespace(node_id="d0")
        backend = types.SimpleNamespace(
            config=types.SimpleNamespace(chunk_timeout_s=5.0),
            registry=types.SimpleNamespace(is_alive=lambda node_id: True),
        )
        got = []
        async for msg in _in_order(
            backend, types.SimpleNamespace(prefill=node, decode=node), queue, start, 5.0
        ):
            got.append(msg.token_ids)
            if msg.finish_reason is not None:
                return got
        return got

    early = [chunk(1, 11, 12), chunk(3, 13), chunk(1, 11, 12), chunk(0, 10), chunk(4, finish="length")]
    assert run_async(order(0, early)) == [(10,), (11, 12), (13,), ()]
    resumed = [chunk(5, 15), chunk(4, 14), chunk(6, 16, finish="stop")]
    assert run_async(order(4, resumed)) == [(14,), (15,), (16,)]
