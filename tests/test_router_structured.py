"""Structured-output fields at the router, without nodes: every constraint that cannot run is a
400 naming the field that carried it, and tool replies parse into OpenAI tool_calls."""

from __future__ import annotations

import pytest

from pdserve.router.structured import ToolCallPlan, tool_calls
from pdserve.router.tokenizer import Tokenizer
from tests.test_router_api import CHAT, _assert_error, _post


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PERSON}}


def _schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


BAD = [
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": _schema_format({"type": "objekt"})},
        "response_format",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "response_format": _schema_format({"type": "objekt"})},
        "response_format",
    ),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "objekt"}}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_regex": r"[^\s\S]"}, "guided_regex"),  # matches nothing
    ("/v1/completions", {"prompt": "x", "guided_regex": ""}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= nowhere"}, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a", ""]}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [99999999]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "bad_words": [" "]}, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL]}, "tool_choice"),  # the default is "auto"
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), BAD, ids=[f"{p[4:]}-{f}-{i}" for i, (p, _, f) in enumerate(BAD)]
)
def test_a_constraint_that_cannot_run_is_400_naming_its_field(
    tokenizer, default_model_dir, path, body, param
):
    error = _assert_error(_post(tokenizer, default_model_dir, path, body), 400, param)
    assert error["type"] == "invalid_request_error"


VLLM_AUTO = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": PERSON}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": PERSON}


@pytest.mark.parametrize("choice", [{}, {"tool_choice": "auto"}])
def test_tool_choice_auto_says_why_in_vllms_words_and_what_to_send_instead(
    tokenizer, default_model_dir, choice
):
    """ "auto" (the default with tools) needs a tool-call parser, as in vLLM, whose refusal agent
    clients match on to fall back; each API names its own alternatives."""
    message = _assert_error(
        _post(tokenizer, default_model_dir, "/v1/chat/completions", {**CHAT, "tools": [TOOL], **choice}),
        400,
        "tool_choice",
    )["message"]
    assert VLLM_AUTO in message and '"required" or {"type": "function", "function": {"name": ...}}' in message
    body = {"input": "hi", "tools": [RESPONSES_TOOL], **choice}
    message = _assert_error(_post(tokenizer, default_model_dir, "/v1/responses", body), 400, "tool_choice")[
        "message"
    ]
    assert VLLM_AUTO in message and '"required" or {"type": "function", "name": ...}' in message


@pytest.mark.parametrize("choice", [{}, {"tool_choice": {"type": "auto"}}])
def test_anthropic_auto_tool_choice_is_refused_in_its_terms_and_count_tokens_still_counts(
    tokenizer, default_model_dir, choice
):
    """Anthropic's default with tools is auto, which vLLM serves only with a tool-call parser
    (vllm/entrypoints/anthropic/serving.py turns it into chat's "auto"): a 400 in Anthropic's shape
    saying why and what to send; count_tokens, whose prompt is the same whatever the choice, counts."""
    messages = [{"role": "user", "content": "Weather?"}]
    body = {"model": default_model_dir.name, "max_tokens": 4, "messages": messages, "tools": [ANTHROPIC_TOOL]}
    reply = _post(tokenizer, default_model_dir, "/v1/messages", {**body, **choice})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    message = reply.json()["error"]["message"]
    assert VLLM_AUTO in message and '{"type": "any"} or {"type": "tool", "name": ...}' in message
    assert 'tool_choice {"type": "auto"}' in message and '{"type": "none"} for text' in message
    del body["max_tokens"]
    counted = _post(tokenizer, default_model_dir, "/v1/messages/count_tokens", {**body, **choice})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_required_tool_reply_parses_into_calls_and_a_named_one_keeps_its_arguments():
    calls = tool_calls(ToolCallPlan(None), '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{}}]')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"a": 1}'),
        ("g", "{}"),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    named = tool_calls(ToolCallPlan("f"), '{"a":1}')
    assert named[0]["function"] == {"name": "f", "arguments": '{"a":1}'}
    assert tool_calls(ToolCallPlan("f"), '{"a":') is None  # cut short by max_tokens
