"""Random request bodies never get a 5xx (other than 503 "no nodes") from the router's API."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router.tokenizer import Tokenizer
from tests.test_router_support import config_for, running_app

FIELDS = [
    "prompt",
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "echo",
    "stream",
    "stream_options",
    "user",
    "ignore_eos",
    "return_tokens_as_token_ids",
    "best_of",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "suffix",
    "min_tokens",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
        "content": st.one_of(st.text(max_size=30), values),
    }
)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8).flatmap(
    lambda d: st.one_of(
        st.just(d),
        st.just({**d, "prompt": "hello"}),
        st.lists(message, max_size=3).map(lambda m: {**d, "messages": m}),
    )
)


@pytest.fixture(scope="module")
def app_client(default_model_dir):
    loop = asyncio.new_event_loop()
    ctx = running_app(config_for(default_model_dir), Tokenizer(default_model_dir))
    handle = loop.run_until_complete(ctx.__aenter__())
    yield loop, handle.client
    loop.run_until_complete(ctx.__aexit__(None, None, None))
    loop.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_random_bodies_get_a_client_error_never_a_server_error(app_client, path, body):
    loop, client = app_client
    response = loop.run_until_complete(client.post(path, json=body))
    assert response.status_code in (400, 404, 413, 429, 503), (response.status_code, body, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}


NON_STANDARD_JSON = [
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "top_p": Infinity}',
    b'{"prompt": "x", "max_tokens": -Infinity}',
    b'{"prompt": NaN}',
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    raw=st.one_of(st.binary(max_size=200), st.sampled_from(NON_STANDARD_JSON)),
)
def test_raw_bytes_get_a_client_error(app_client, path, raw):
    loop, client = app_client
    response = loop.run_until_complete(
        client.post(path, content=raw, headers={"content-type": "application/json"})
    )
    assert response.status_code in (400, 413, 503), (response.status_code, raw, response.text)
