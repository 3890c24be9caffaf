"""Router HTTP API without nodes: validation errors, auth, unknown model, context length, models,
health, metrics, and that the router never imports torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from pdserve.router.tokenizer import Tokenizer
from tests.test_router_support import config_for, node_info, running_app


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


def _post(tokenizer, default_model_dir, path, body, records=(), headers=None, **config):
    async def go():
        async with running_app(config_for(default_model_dir, **config), tokenizer, records) as h:
            return await h.client.post(path, json=body, headers=headers or {})

    return asyncio.run(go())


def _assert_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    return error


CHAT = {"messages": [{"role": "user", "content": "hi"}]}

BAD_FIELDS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": 1 << 63}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -(1 << 63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "maybe"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream": 2}, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "temperature": "nan"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": "2.5"}, "n"),
    ("/v1/completions", {"prompt": ["1", 2]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": ["5"]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True, "extra": 1}},
        "stream_options.extra",
    ),
    ("/v1/completions", {"prompt": "x", "temprature": 0.5}, "temprature"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": "maybe"}, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "top_k": 5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "temperature": 0.7}, "temperature"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stop": "y"}, "stop"),
    ("/v1/completions", {"prompt": "x", "length_penalty": 0.5}, "length_penalty"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "early_stopping": True},
        "early_stopping",
    ),
    ("/v1/completions", {"prompt": "x", "priority": False}, "priority"),
    ("/v1/completions", {"prompt": "x", "min_characters": 5}, "min_characters"),
    ("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", {"prompt": "x", "priority": 3}, "priority"),
    ("/v1/completions", {"prompt": "x", "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[.*"}}, "structured_outputs.regex"),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"regex": {"a": 1}}},
        "structured_outputs.regex",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"json": {"type": "wat"}}},
        "structured_outputs.json",
    ),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {}}, "structured_outputs"),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs.choice",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"whitespace_pattern": " "}},
        "structured_outputs.whitespace_pattern",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"regex": "a"}, "guided_regex": "b"},
        "structured_outputs.regex",
    ),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),  # past --max-logprobs
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "logprob_token_ids": []}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "logprob_token_ids": [10**9]}, "logprob_token_ids"),
    (
        "/v1/completions",
        {"prompt": "x", "logprobs": 1, "logprob_token_ids": [5], "echo": True, "max_tokens": 0},
        "logprob_token_ids",
    ),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 10**9}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "truncation_side": "left"}, "truncation_side"),
    (
        "/v1/completions",
        {"prompt": "x", "truncate_prompt_tokens": 3, "truncation_side": "middle"},
        "truncation_side",
    ),
    ("/v1/completions", {"prompt": "x", "messages": []}, "messages"),
    ("/v1/completions", {"prompt": [1, 99999999]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": 7}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, "continue_final_message"),
    (
        "/v1/chat/completions",
        {**CHAT, "continue_final_message": True, "add_generation_prompt": False},
        "messages",
    ),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "store": True}, "store"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("/v1/chat/completions", {**CHAT, "prompt": "x"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    (
        "/v1/chat/completions",
        {**CHAT, "stream_options": {"include_usage": "sometimes"}},
        "stream_options.include_usage",
    ),
    ("/v1/chat/completions", {**CHAT, "logprobs": "maybe"}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "min_characters": 5}, "min_characters"),
    (
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"min_characters": 5}},
        "stream_options.min_characters",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "min_characters": 5}},
        "stream_options.min_characters",
    ),
    ("/v1/chat/completions/batch", {"messages": [CHAT["messages"], []]}, "messages.1"),
    ("/v1/chat/completions/batch", {"messages": CHAT["messages"]}, "messages.0"),
    ("/v1/chat/completions/batch", {"messages": [CHAT["messages"]], "stream": True}, "stream"),
    (
        "/v1/chat/completions/batch",
        {"messages": [CHAT["messages"]], "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
    ),
    (
        "/v1/chat/completions/batch",
        {
            "messages": [CHAT["messages"], [{"role": "user", "content": "a"}]],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        "messages.0",
    ),
    ("/invocations", {"input": "embed me"}, "input"),
    ("/invocations", {"temperature": 0.5}, None),
    ("/invocations", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/invocations", {"prompt": "x", "seed": 1 << 63}, "seed"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), BAD_FIELDS, ids=[f"{p[4:]}-{f}" for p, _, f in BAD_FIELDS]
)
def test_invalid_field_is_400_naming_it(tokenizer, default_model_dir, path, body, param):
    error = _assert_error(_post(tokenizer, default_model_dir, path, body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_is_400(tokenizer, default_model_dir):
    async def go():
        async with running_app(config_for(default_model_dir), tokenizer) as h:
            return await h.client.post(
                "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
            )

    _assert_error(asyncio.run(go()), 400, None)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}])
def test_missing_or_wrong_api_key_is_401(tokenizer, default_model_dir, headers):
    response = _post(
        tokenizer, default_model_dir, "/v1/completions", {"prompt": "x"}, headers=headers, api_key="secret"
    )
    assert _assert_error(response, 401, None)["type"] == "authentication_error"


def test_right_api_key_passes_auth(tokenizer, default_model_dir):
    response = _post(
        tokenizer,
        default_model_dir,
        "/v1/completions",
        {"prompt": "x", "top_p": 5},
        headers={"Authorization": "Bearer secret"},
        api_key="secret",
    )
    _assert_error(response, 400, "top_p")


@pytest.mark.parametrize("metrics_auth", [False, True])
def test_metrics_stay_open_unless_metrics_auth_asks_for_the_key(tokenizer, default_model_dir, metrics_auth):
    async def go():
        config = config_for(default_model_dir, api_key="secret", metrics_auth=metrics_auth)
        async with running_app(config, tokenizer, ()) as h:
            bare = await h.client.get("/metrics")
            keyed = await h.client.get("/metrics", headers={"Authorization": "Bearer secret"})
            health = await h.client.get("/health")
            return bare, keyed, health

    bare, keyed, health = asyncio.run(go())
    assert keyed.status_code == 200 and "pdserve_requests_total" in keyed.text
    assert health.status_code != 401  # /health answers probes without the key either way
    if metrics_auth:
        assert _assert_error(bare, 401, None)["type"] == "authentication_error"
    else:
        assert bare.status_code == 200


def test_unknown_model_is_404(tokenizer, default_model_dir):
    response = _post(tokenizer, default_model_dir, "/v1/completions", {"prompt": "x", "model": "gpt-9"})
    assert _assert_error(response, 404, "model")["code"] == "model_not_found"


def test_prompt_over_node_context_is_400_context_length_exceeded(tokenizer, default_model_dir):
    records = [node_info("d0", "decode", max_model_len=32), node_info("p0", "prefill", max_model_len=32)]
    body = {"prompt": list(range(30)), "max_tokens": 3}
    error = _assert_error(
        _post(tokenizer, default_model_dir, "/v1/completions", body, records), 400, "prompt"
    )
    assert error["code"] == "context_length_exceeded"
    assert "32" in error["message"]


def test_chat_over_model_context_is_400(tokenizer, default_model_dir):
    body = {"messages": [{"role": "user", "content": "word " * 9000}]}
    error = _assert_error(_post(tokenizer, default_model_dir, "/v1/chat/completions", body), 400, "messages")
    assert error["code"] == "context_length_exceeded"


def test_body_over_limit_is_413(tokenizer, default_model_dir):
    response = _post(
        tokenizer, default_model_dir, "/v1/completions", {"prompt": "x" * 2000}, max_body_bytes=1000
    )
    _assert_error(response, 413, None)


def test_no_nodes_is_503_with_retry_after(tokenizer, default_model_dir):
    response = _post(tokenizer, default_model_dir, "/v1/completions", {"prompt": "hello"})
    _assert_error(response, 503, None)
    assert response.headers["retry-after"] == "1"


def test_models_health_and_metrics(tokenizer, default_model_dir):
    records = [
        node_info("d0", "decode", num_blocks_free=60, num_blocks_cached=10),
        node_info("p0", "prefill"),
    ]

    async def go():
        async with running_app(config_for(default_model_dir), tokenizer) as h:
            unhealthy = await h.client.get("/health")
            h.registry.records = records
            await asyncio.sleep(0.15)
            return (
                unhealthy,
                await h.client.get("/health"),
                await h.client.get("/v1/models"),
                await h.client.get("/metrics"),
            )

    unhealthy, healthy, models, metrics = asyncio.run(go())
    assert unhealthy.status_code == 503
    assert healthy.status_code == 200 and healthy.json()["num_decode"] == 1
    assert healthy.json()["status"] == "ok" and healthy.json()["num_pairs"] == 1
    card = models.json()["data"][0]
    assert card["id"] == default_model_dir.name and card["max_model_len"] == 512
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'pdserve_node_kv_blocks_used{node_id="d0",role="decode"} 40' in metrics.text
    assert 'pdserve_node_kv_blocks_cached{node_id="d0",role="decode"} 10' in metrics.text


@pytest.mark.usefixtures("processes")
def test_router_app_never_imports_torch(default_model_dir):
    code = (
        "import sys, asyncio\n"
        "from pdserve.router.app import create_app\n"
        "from pdserve.router.config import RouterConfig\n"
        f"app = create_app(RouterConfig(model={str(default_model_dir)!r}, decode_addrs=('tcp://127.0.0.1:1',)))\n"
        "async def go():\n"
        "    async with app.router.lifespan_context(app):\n"
        "        pass\n"
        "asyncio.run(go())\n"
        "import pdserve.cli.main\n"
        "pdserve.cli.main.build_parser()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_cluster_of_decode_nodes_alone_is_healthy_and_says_so(tokenizer, default_model_dir):
    async def go():
        async with running_app(config_for(default_model_dir), tokenizer) as h:
            h.registry.records = [node_info("d0", "decode")]
            await asyncio.sleep(0.15)
            return await h.client.get("/health")

    health = asyncio.run(go())
    assert health.status_code == 200  # it serves: the decode node prefills every prompt itself
    assert health.json()["status"] == "decode_only" and health.json()["num_pairs"] == 0


def test_every_bad_logit_bias_key_is_named(tokenizer, default_model_dir):
    body = {"prompt": "x", "logit_bias": {"5": 1.0, "abc": 1.0, "99999999": 2.0, "-3": 1.0}}
    error = _assert_error(_post(tokenizer, default_model_dir, "/v1/completions", body), 400, "logit_bias")
    assert (
        all(repr(k) in error["message"] for k in ("abc", "99999999", "-3")) and "'5'" not in error["message"]
    )
    body = {"prompt": "x", "logit_bias": {"5": 101.0, "6": -300.0, "7": 3.0}}
    error = _assert_error(_post(tokenizer, default_model_dir, "/v1/completions", body), 400, "logit_bias")
    assert "101.0" in error["message"] and "-300.0" in error["message"] and "3.0 " not in error["message"]


def test_several_unknown_fields_are_all_named(tokenizer, default_model_dir):
    body = {"prompt": "x", "temprature": 0.5, "guided_regexp": "a"}
    error = _assert_error(_post(tokenizer, default_model_dir, "/v1/completions", body), 400, "temprature")
    assert "temprature" in error["message"] and "guided_regexp" in error["message"]


@pytest.mark.parametrize("prompt", [{"prompt": None, "prompt_embeds": []}, {"prompt": ""}, {}])
def test_an_empty_prompt_is_refused_in_vllms_words(tokenizer, default_model_dir, prompt):
    error = _assert_error(_post(tokenizer, default_model_dir, "/v1/completions", prompt), 400, "prompt")
    assert error["message"] == "Either prompt or prompt_embeds must be provided and non-empty."


@pytest.mark.parametrize(
    ("seed", "kind", "bound"),
    [
        (1 << 63, "less_than_equal", "'le': 9223372036854775807"),
        (-(1 << 63) - 1, "greater_than_equal", "'ge': -9223372036854775808"),
        ("-9223372036854775809", "greater_than_equal", "'ge': -9223372036854775808"),
    ],
)
def test_a_seed_outside_int64_gets_vllms_validation_message_word_for_word(
    tokenizer, default_model_dir, seed, kind, bound
):
    """vLLM's handler writes the count, then pydantic's error with its loc dotted and its input as
    text (vllm/entrypoints/serve/exception_handling/handlers/validation.py)."""
    words = {
        "le": "less than or equal to 9223372036854775807",
        "ge": "greater than or equal to -9223372036854775808",
    }
    expected = (
        f"1 validation error:\n  {{'type': '{kind}', 'loc': 'body.seed', "
        f"'msg': 'Input should be {words[bound[1:3]]}', 'input': '{seed}', 'ctx': {{{bound}}}}}"
    )
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)):
        error = _assert_error(_post(tokenizer, default_model_dir, path, {**body, "seed": seed}), 400, "seed")
        assert error["message"] == expected
    invoked = _post(tokenizer, default_model_dir, "/invocations", {"prompt": "x", "seed": seed})
    assert _assert_error(invoked, 400, "seed")["message"] == expected.replace("'body.seed'", "'seed'")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": [5, 99999999, 7, 88888888]}, "prompt", "Token id 99999999 is out of vocabulary"),
        ({"prompt": [[5], [6, 77777777]]}, "prompt", "Token id 77777777 is out of vocabulary"),
        (
            {"prompt": "x", "stop_token_ids": [5, 99999999, -1]},
            "stop_token_ids",
            "token_id(s) [99999999, -1] in stop_token_ids contain out-of-vocab token ids. "
            "Vocabulary size: 49152",
        ),
        (
            {"prompt": "x", "logit_bias": {"5": 1.0, "99999999": 2.0}},
            "logit_bias",
            "token_id(s) [99999999] in logit_bias contain out-of-vocab token ids. Vocabulary size: 49152",
        ),
        (
            {"prompt": "x", "logprobs": 1, "logprob_token_ids": [3, 99999999]},
            "logprob_token_ids",
            "token_id(s) [99999999] in logprob_token_ids contain out-of-vocab token ids. "
            "Vocabulary size: 49152",
        ),
        (
            {"prompt": "x", "logprobs": 1, "logprob_token_ids": []},
            "logprob_token_ids",
            "`logprob_token_ids` must not be an empty list.",
        ),
        (
            {"prompt": "x", "allowed_token_ids": [5, 99999999]},
            "allowed_token_ids",
            "allowed_token_ids contains out-of-vocab token id!",
        ),
        (
            {"prompt": "x", "allowed_token_ids": []},
            "allowed_token_ids",
            "allowed_token_ids is not None and empty!",
        ),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_in_vllms_words(
    tokenizer, default_model_dir, body, param, message
):
    """vLLM's messages, which clients match on: the prompt's largest id
    (vllm/v1/engine/input_processor.py), the rules' ids (vllm/sampling_params.py)."""
    assert tokenizer.vocab_size == 49152
    error = _assert_error(_post(tokenizer, default_model_dir, "/v1/completions", body), 400, param)
    assert error["message"] == message


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"prompt_logprobs": -1},
            "prompt_logprobs",
            "Requested prompt logprobs of 49152, which is greater than max allowed: 20",
        ),
        (
            {"prompt_logprobs": 21},
            "prompt_logprobs",
            "Requested prompt logprobs of 21, which is greater than max allowed: 20",
        ),
        ({"prompt_logprobs": -2}, "prompt_logprobs", "`prompt_logprobs` must be a positive value or -1."),
        (
            {"logprobs": -1},
            "logprobs",
            "Requested sample logprobs of 49152, which is greater than max allowed: 20",
        ),
        ({"logprobs": -3}, "logprobs", "`logprobs` must be a positive value or -1."),
    ],
)
def test_logprob_counts_past_vllms_default_max_logprobs_are_refused_in_its_words(
    tokenizer, default_model_dir, body, param, message
):
    """vLLM's --max-logprobs (20 by default) bounds every count, -1 counting as the vocabulary's
    size: completions' and chat's -1 are refused as vLLM refuses them (vllm/sampling_params.py)."""
    completion = _post(tokenizer, default_model_dir, "/v1/completions", {"prompt": "x", **body})
    assert _assert_error(completion, 400, param)["message"] == message
    chat_body = {**CHAT, **body}
    if param == "logprobs":  # chat's count of output alternatives is top_logprobs
        chat_body = {**CHAT, "logprobs": True, "top_logprobs": body["logprobs"]}
        message = message.replace("`logprobs`", "`top_logprobs`")
        param = "top_logprobs"
    chat = _post(tokenizer, default_model_dir, "/v1/chat/completions", chat_body)
    assert _assert_error(chat, 400, param)["message"] == message


def test_with_max_logprobs_minus_one_the_whole_vocabulary_is_bounded_by_entries_and_the_wire(
    tokenizer, default_model_dir
):
    """--max-logprobs -1 lets -1 through, as vLLM's does; what a response carries past 20 a position
    stays within --max-logprob-entries, and one sample's prompt log-probabilities within one node
    message (router/request_limits.py). A request that passes every check meets no node: 503."""
    whole = dict(max_logprobs=-1)
    short = {"prompt": list(range(100, 108)), "prompt_logprobs": -1, "max_tokens": 1}  # 7 x 49152
    assert _post(tokenizer, default_model_dir, "/v1/completions", short, **whole).status_code == 503
    chat = {**CHAT, "logprobs": True, "top_logprobs": -1, "max_tokens": 4}
    assert _post(tokenizer, default_model_dir, "/v1/chat/completions", chat, **whole).status_code == 503
    longer = {**short, "prompt": list(range(100, 130))}  # 29 positions: 1,425,408 entries
    error = _assert_error(
        _post(tokenizer, default_model_dir, "/v1/completions", longer, **whole), 400, "prompt_logprobs"
    )
    assert "1425408 entries" in error["message"] and "--max-logprob-entries" in error["message"]
    roomy = dict(max_logprobs=-1, max_logprob_entries=1 << 24)
    error = _assert_error(
        _post(tokenizer, default_model_dir, "/v1/completions", longer, **roomy), 400, "prompt_logprobs"
    )
    assert "one node message" in error["message"] and "MAX_HEADER_BYTES" in error["message"]
    chat = {**CHAT, "prompt_logprobs": -1, "max_tokens": 1}  # the template's prompt: 30-odd positions
    error = _assert_error(
        _post(tokenizer, default_model_dir, "/v1/chat/completions", chat, **roomy), 400, "prompt_logprobs"
    )
    assert "one node message" in error["message"]
    fewer = {**longer, "prompt_logprobs": 200}  # 201 x 29 entries a sample: within both bounds
    assert _post(tokenizer, default_model_dir, "/v1/completions", fewer, **whole).status_code == 503


def test_invocations_need_the_api_key_as_the_v1_endpoints_do(tokenizer, default_model_dir):
    response = _post(tokenizer, default_model_dir, "/invocations", {"prompt": "x"}, api_key="secret")
    assert _assert_error(response, 401, None)["type"] == "authentication_error"
