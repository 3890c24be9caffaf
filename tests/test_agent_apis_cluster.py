"""OpenAI's Responses API and Anthropic's Messages API end to end, through the official clients,
on the shared API-surface cluster (tests/conftest.py's ``api_cluster``): the P→D router, the
decode-only router and a colocated node's router. Requests run concurrently and mixed (lengths,
streaming on and off, greedy and seeded, logprobs); every text equals what chat completions gives
for the same messages and sampling on the same router, every response says where it ran, and bad
input is refused in each API's own error shape."""

from __future__ import annotations

import concurrent.futures
import json

import anthropic
import openai
import pytest

from tests import web

pytestmark = pytest.mark.usefixtures("processes")
ROUTERS = ("pd", "decode_only", "colocated")
EXPECTED_PATH = {"pd": "disaggregated", "decode_only": "local-prefill", "colocated": "colocated"}
WORDS = "the sea is wide and grey and the long waves roll in over the sand where gulls cry".split()
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
    },
}


def _text(num_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed + 3 * i) % len(WORDS)] for i in range(num_words))


def _openai(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _anthropic(router) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=120)


def _chat(router, model, messages: list[dict], max_tokens: int, sampling: dict, **extra) -> dict:
    body = {"model": model.name, "messages": messages, "max_tokens": max_tokens, **sampling, **extra}
    reply = web.post(router.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _sampling(i: int) -> dict:
    """Greedy, or seeded sampling (chat's first sample draws with the seed itself)."""
    return {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i, "top_p": 0.9}


def _responses_text(router, model, text: str, instructions: str | None, sampling: dict, stream: bool) -> str:
    client = _openai(router)
    kwargs = {
        "model": model.name,
        "input": text,
        "max_output_tokens": 12,
        "temperature": sampling["temperature"],
    }
    kwargs |= {"instructions": instructions} if instructions else {}
    kwargs |= {"top_p": sampling["top_p"]} if "top_p" in sampling else {}
    extra = {"ignore_eos": True} | ({"seed": sampling["seed"]} if "seed" in sampling else {})
    if not stream:
        return client.responses.create(**kwargs, extra_body=extra).output_text
    events = list(client.responses.create(**kwargs, extra_body=extra, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens ended it (ignore_eos)
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text
    return deltas


@pytest.mark.parametrize("router_name", ROUTERS)
def test_responses_equal_chat_completions_concurrently_streamed_or_not(api_cluster, router_name):
    model, routers, _ = api_cluster
    router = routers[router_name]
    jobs = [
        (_text(n, i), "Answer in one line." if i % 3 == 0 else None, _sampling(i), i % 2 == 1)
        for i, n in enumerate((3, 40, 12, 90, 25, 60))
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda j: _responses_text(router, model, *j), jobs))
    for (text, instructions, sampling, _), got in zip(jobs, texts, strict=True):
        messages = [{"role": "system", "content": instructions}] if instructions else []
        messages.append({"role": "user", "content": text})
        chat = _chat(router, model, messages, 12, sampling, ignore_eos=True)
        assert got == chat["choices"][0]["message"]["content"], (text, sampling)


@pytest.mark.parametrize("router_name", ROUTERS)
def test_every_response_says_where_it_ran(api_cluster, router_name):
    model, routers, nodes = api_cluster
    router = routers[router_name]
    text = _text(60, 7)  # long enough to disaggregate on the P→D router
    raw = _openai(router).responses.with_raw_response.create(
        model=model.name, input=text, max_output_tokens=2
    )
    msg = web.post(
        router.url + "/v1/messages",
        json={
            "model": model.name,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": text + " again"}],
        },
        timeout=120,
    )
    for headers in (raw.headers, msg.headers):
        assert headers["x-pdserve-path"] == EXPECTED_PATH[router_name]
        assert ("x-pdserve-prefill-node" in headers) == (router_name == "pd")
        if router_name == "decode_only":
            assert headers["x-pdserve-path-reason"] == "short-prompt"  # its threshold: 100,000 tokens
    metrics = web.get(router.url + "/metrics", timeout=10).text
    assert f'pdserve_request_paths_total{{path="{EXPECTED_PATH[router_name]}"' in metrics


def test_responses_function_tools_and_previous_response_id_continue_as_chat_would(api_cluster):
    model, routers, _ = api_cluster
    for name in ROUTERS:
        client = _openai(routers[name])
        first = client.responses.create(
            model=model.name,
            input="What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=40,
        )
        (call,) = [item for item in first.output if item.type == "function_call"]
        assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
        second = client.responses.create(
            model=model.name,
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
            temperature=0,
            max_output_tokens=8,
        )
        history = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [_chat_call(call)]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
        ]
        chat = _chat(routers[name], model, history, 8, {"temperature": 0})
        assert second.output_text == chat["choices"][0]["message"]["content"]
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
        assert client.responses.retrieve(first.id).id == first.id
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):  # its conversation is gone with it
            client.responses.create(model=model.name, previous_response_id=second.id, input="and?")


def _chat_call(call) -> dict:
    return {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def test_responses_json_schema_and_logprobs_equal_chats(api_cluster):
    model, routers, _ = api_cluster
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    router = routers["pd"]
    client = _openai(router)
    reply = client.responses.create(
        model=model.name,
        input="Give me a number.",
        text={"format": {"type": "json_schema", "name": "number", "schema": schema}},
        temperature=0,
        max_output_tokens=16,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    chat = _chat(
        router,
        model,
        [{"role": "user", "content": "Give me a number."}],
        16,
        {"temperature": 0},
        response_format={"type": "json_schema", "json_schema": {"name": "number", "schema": schema}},
        logprobs=True,
        top_logprobs=2,
    )
    assert reply.output_text == chat["choices"][0]["message"]["content"]
    (part,) = reply.output[0].content
    assert [lp.token for lp in part.logprobs] == [
        c["token"] for c in chat["choices"][0]["logprobs"]["content"]
    ]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)


def _messages_text(
    router, model, text: str, system: str | None, sampling: dict, stream: bool
) -> tuple[str, str]:
    client = _anthropic(router)
    kwargs = {"model": model.name, "max_tokens": 12, "messages": [{"role": "user", "content": text}]}
    kwargs |= {"system": system} if system else {}
    extra = dict(sampling)  # the SDK has no sampling arguments: extra body fields
    if not stream:
        message = client.messages.create(**kwargs, extra_body=extra)
        return "".join(b.text for b in message.content if b.type == "text"), message.stop_reason
    with client.messages.stream(**kwargs, extra_body=extra) as events:
        kinds = [event.type for event in events]
        final = events.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    return "".join(b.text for b in final.content if b.type == "text"), final.stop_reason


@pytest.mark.parametrize("router_name", ROUTERS)
def test_anthropic_messages_equal_chat_completions_concurrently_streamed_or_not(api_cluster, router_name):
    model, routers, _ = api_cluster
    router = routers[router_name]
    jobs = [
        (_text(n, i + 5), "You are terse." if i % 2 == 0 else None, _sampling(i), i % 3 != 0)
        for i, n in enumerate((4, 50, 15, 80))
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda j: _messages_text(router, model, *j), jobs))
    for (text, system, sampling, _), (got, stop_reason) in zip(jobs, replies, strict=True):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": text})
        choice = _chat(router, model, messages, 12, sampling)["choices"][0]
        assert got == choice["message"]["content"], (text, sampling)
        assert stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]


def test_anthropic_tools_tool_results_and_count_tokens(api_cluster):
    model, routers, _ = api_cluster
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER["parameters"],
    }
    for name in ROUTERS:
        client = _anthropic(routers[name])
        ask = [{"role": "user", "content": "Weather in Oslo?"}]
        first = client.messages.create(
            model=model.name,
            max_tokens=40,
            messages=ask,
            tools=[tool],
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": 0},
        )
        (use,) = first.content
        assert use.type == "tool_use" and use.name == "get_weather" and first.stop_reason == "tool_use"
        turn = [
            *ask,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "snow"}]},
        ]
        second = client.messages.create(
            model=model.name,
            max_tokens=6,
            messages=turn,
            tools=[tool],
            tool_choice={"type": "none"},
            extra_body={"temperature": 0},
        )
        chat_messages = [
            *ask,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "snow"},
        ]
        chat_tools = [
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool["description"],
                    "parameters": tool["input_schema"],
                },
            }
        ]
        chat = _chat(
            routers[name], model, chat_messages, 6, {"temperature": 0}, tools=chat_tools, tool_choice="none"
        )
        assert (
            "".join(b.text for b in second.content if b.type == "text")
            == chat["choices"][0]["message"]["content"]
        )
        counted = client.messages.count_tokens(model=model.name, messages=turn, tools=[tool])
        assert counted.input_tokens == chat["usage"]["prompt_tokens"]
        assert (
            second.usage.input_tokens + second.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
        )


def test_bad_input_is_refused_in_each_apis_own_shape(api_cluster):
    model, routers, _ = api_cluster
    router = routers["pd"]
    oai = _openai(router)
    for kwargs, param in (
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            oai.responses.create(model=model.name, **kwargs)
        assert info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=model.name, input="x", previous_response_id="resp_unknown")
    claude = _anthropic(router)
    for kwargs, named in (
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"extra_body": {"temperature": -1}}, "temperature"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
    ):
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(
                model=model.name, max_tokens=4, messages=[{"role": "user", "content": "x"}], **kwargs
            )
        body = err.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert named in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"
