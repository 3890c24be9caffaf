"""Structured outputs on the default model through a real cluster (redis-server, 1 prefill + 1 decode
node, two routers: one that disaggregates every request, one that never does), asked with the
official ``openai`` client, streamed and not: every reply follows its schema, regex or choice,
and equals the offline engine's output for the same token ids."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.protocol.sampling_params import GuidedDecoding
from pdserve.router.tokenizer import Tokenizer
from tests.cluster import Client
from tests.structured_cases import CHOICE_CASES, REGEX_CASES, json_schema_cases

pytestmark = pytest.mark.usefixtures("processes")
MAX_TOKENS = {"json": 150, "regex": 60, "choice": 20, "plain": 24}
PLAIN_QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Why is the sea salty?",
    "Say hello.",
]


@pytest.fixture(scope="module")
def cluster(default_model_cluster):
    return default_model_cluster  # tests/conftest.py: the default model, 1P+1D, routers pd and decode_only


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(router, model: str, question: str, stream: bool, **kwargs) -> tuple[str, str]:
    """(text, finish_reason) of one greedy chat request."""
    messages = [{"role": "user", "content": question}]
    reply = _client(router).chat.completions.create(
        model=model, messages=messages, temperature=0.0, stream=stream, **kwargs
    )
    if not stream:
        choice = reply.choices[0]
        if kwargs.get("logprobs"):
            assert len(choice.logprobs.content) == reply.usage.completion_tokens
            assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        return choice.message.content, choice.finish_reason
    text, finish, num_logprobs = "", None, 0
    for chunk in reply:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            num_logprobs += len(choice.logprobs.content) if choice.logprobs else 0
    assert (num_logprobs > 0) == bool(kwargs.get("logprobs"))
    return text, finish


def _requests() -> list[tuple[str, str, dict, GuidedDecoding]]:
    """(kind, question, request fields, the same constraint for the offline engine)."""
    out = []
    for question, schema in json_schema_cases(20):
        fields = {
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        }
        out.append(("json", question, fields, GuidedDecoding.json_schema(schema)))
    for question, pattern in REGEX_CASES:
        out.append(
            ("regex", question, {"extra_body": {"guided_regex": pattern}}, GuidedDecoding.regex(pattern))
        )
    for question, choices in CHOICE_CASES:
        out.append(
            ("choice", question, {"extra_body": {"guided_choice": choices}}, GuidedDecoding.choice(choices))
        )
    return out


def _offline(default_model_dir, requests) -> list[tuple[str, str]]:
    tokenizer = Tokenizer(default_model_dir)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for _, q, _, _ in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[kind], guided_decoding=spec)
        for kind, _, _, spec in requests
    ]
    llm = LLM(str(default_model_dir), kv_cache_memory_mb=128)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]


def _check(kind: str, fields: dict, text: str) -> None:
    if kind == "plain":
        return
    if kind == "json":
        jsonschema.validate(json.loads(text), fields["response_format"]["json_schema"]["schema"])
    elif kind == "regex":
        assert re.fullmatch(fields["extra_body"]["guided_regex"].replace(r"\d", "[0-9]"), text), text
    else:
        assert text in fields["extra_body"]["guided_choice"]


def test_json_schema_regex_and_choice_replies_validate_and_equal_offline_on_both_paths(
    cluster, default_model_dir
):
    routers, nodes = cluster
    requests = _requests()
    model = default_model_dir.name
    # JSON through P -> D; regex and choice by turns through P -> D and decode-only; streamed by turns
    jobs = [
        (i, "pd" if kind == "json" or i % 4 < 2 else "decode_only", i % 2 == 0)
        for i, (kind, *_) in enumerate(requests)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {
            job: pool.submit(
                _chat,
                routers[job[1]],
                model,
                requests[job[0]][1],
                job[2],
                max_tokens=MAX_TOKENS[requests[job[0]][0]],
                **requests[job[0]][2],
            )
            for job in jobs
        }
        concurrent.futures.wait(futures.values())
    offline = _offline(default_model_dir, requests)
    failures = []  # every request's problem, not only the first one's
    for (i, path, stream), future in futures.items():
        kind, _, fields, _ = requests[i]
        try:
            text, finish = future.result()
            assert finish == "stop" or kind == "plain", f"finish {finish}: {text!r}"
            _check(kind, fields, text)
            assert (text, finish) == offline[i], f"{text!r} {finish} differs from offline {offline[i]}"
        except Exception as exc:
            failures.append(f"request {i} ({kind}, {path}, stream={stream}): {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)
    assert nodes["prefill"].events("kv_shipped") and nodes["decode"].events("kv_adopted")
    _assert_no_block_held(nodes)


def _assert_no_block_held(nodes) -> None:
    client = Client()
    try:
        for node in nodes.values():
            info = client.wait_idle(node.addrs)
            assert info["num_blocks_free"] == info["num_blocks_total"], node.role
    finally:
        client.close()


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a timezone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _tool_calls(router, model: str, tool_choice, stream: bool) -> tuple[list[tuple[str, str]], str]:
    """[(function name, arguments)], finish_reason."""
    messages = [{"role": "user", "content": "What is the weather in Paris? Call get_weather."}]
    reply = _client(router).chat.completions.create(
        model=model,
        messages=messages,
        temperature=0.0,
        max_tokens=80,
        tools=TOOLS,
        tool_choice=tool_choice,
        stream=stream,
    )
    if not stream:
        message = reply.choices[0].message
        assert message.content is None
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert all(c.type == "function" and c.id for c in message.tool_calls)
        return calls, reply.choices[0].finish_reason
    calls, finish = {}, None
    for chunk in reply:
        for choice in chunk.choices:
            assert not choice.delta.content
            for call in choice.delta.tool_calls or ():
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (
                    name + (call.function.name or ""),
                    args + (call.function.arguments or ""),
                )
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    ("tool_choice", "path", "stream"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, "pd", False),
        ({"type": "function", "function": {"name": "get_time"}}, "decode_only", True),
        ("required", "pd", True),
        ("required", "decode_only", False),
    ],
)
def test_tool_calls_are_valid_json_for_their_function(cluster, default_model_dir, tool_choice, path, stream):
    routers, _ = cluster
    calls, finish = _tool_calls(routers[path], default_model_dir.name, tool_choice, stream)
    assert finish == "tool_calls" and calls
    for name, arguments in calls:
        if isinstance(tool_choice, dict):
            assert name == tool_choice["function"]["name"]
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _completion_ids(router, model: str, prompt: str, max_tokens: int, **extra) -> tuple[list[int], str]:
    reply = _client(router).completions.create(
        model=model,
        prompt=prompt,
        temperature=0.0,
        max_tokens=max_tokens,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, **extra},
    )
    choice = reply.choices[0]
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens], choice.text


def test_logit_bias_allowed_token_ids_and_bad_words_through_both_paths(cluster, default_model_dir):
    routers, _ = cluster
    model, prompt = default_model_dir.name, "The capital of France is"
    tokenizer = Tokenizer(default_model_dir)
    plain, plain_text = _completion_ids(routers["pd"], model, prompt, 6)
    assert "Paris" in plain_text
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    for path in ("pd", "decode_only"):
        ids, _ = _completion_ids(routers[path], model, prompt, 4, logit_bias={str(forced): 100})
        assert ids == [forced] * 4
        ids, _ = _completion_ids(routers[path], model, prompt, 4, logit_bias={str(plain[0]): -100})
        assert ids[0] != plain[0]
        allowed = tokenizer.encode(" yes no maybe.", add_special_tokens=False)
        ids, _ = _completion_ids(routers[path], model, prompt, 6, allowed_token_ids=allowed)
        assert ids and set(ids) <= set(allowed)
        _, text = _completion_ids(routers[path], model, prompt, 6, bad_words=["Paris"])
        assert "Paris" not in text


def test_a_schema_that_cannot_finish_in_max_tokens_ends_with_length(cluster, default_model_dir):
    routers, nodes = cluster
    question, schema = json_schema_cases(1)[0]
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    for stream in (False, True):
        text, finish = _chat(routers["pd"], default_model_dir.name, question, stream, max_tokens=3, **fields)
        assert finish == "length" and text.startswith("{")
    _assert_no_block_held(nodes)
