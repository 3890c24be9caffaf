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


def test_tool_choice_auto_says_what_to_use_instead(tokenizer, default_model_dir):
    body = {**CHAT, "tools": [TOOL], "tool_choice": "auto"}
    message = _assert_error(
        _post(tokenizer, default_model_dir, "/v1/chat/completions", body), 400, "tool_choice"
    )["message"]
    assert '"auto" is not supported' in message and '"required"' in message


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
