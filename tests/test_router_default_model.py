"""The default model (SmolLM2-135M-Instruct) served disaggregated: router + prefill + decode + Redis,
asked through the official openai client; its answer must equal Hugging Face ``generate``."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.engine_helpers import hf_model

pytestmark = pytest.mark.usefixtures("processes")


@pytest.fixture(scope="module")
def cluster(default_model_cluster):
    """tests/conftest.py: the default model on 1 prefill + 1 decode node; its router that sends
    every prompt through the prefill node."""
    routers, nodes = default_model_cluster
    return routers["pd"], (nodes["prefill"], nodes["decode"])


def test_default_model_chat_through_the_cluster_equals_hf(cluster, default_model_dir):
    router, (prefill, decode) = cluster
    shipped, adopted = len(prefill.events("kv_shipped")), len(decode.events("kv_adopted"))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(
        model=default_model_dir.name, messages=messages, max_tokens=24, temperature=0.0
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        ref = (
            hf_model(str(default_model_dir))
            .generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=2)[0, len(ids) :]
            .tolist()
        )
    assert answer.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(ref)
    # it really went P -> D
    assert (len(prefill.events("kv_shipped")), len(decode.events("kv_adopted"))) == (shipped + 1, adopted + 1)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("stop", "min_tokens", "text", "tokens"),
    [
        ([" of", "capital"], 0, "The ", 2),  # matched at the token that completes it
        (["capital"], 4, "The ", 4),  # seen at token 2, honoured at min_tokens, still cut at it
    ],
)
def test_stop_strings_with_min_tokens_end_where_the_offline_engine_ends(
    cluster, default_model_dir, stream, stop, min_tokens, text, tokens
):
    """One stop-string rule (detok.StopStrings) for the router and the engine: the cluster's
    answer is the offline LLM's (tests/test_engine_default_model.py pins the same figures)."""
    router, _ = cluster
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    request = dict(
        model=default_model_dir.name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0.0,
        stop=stop,
        extra_body={"min_tokens": min_tokens},
    )
    if stream:
        chunks = list(
            client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
        )
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
    else:
        answer = client.chat.completions.create(**request)
        content, finish, usage = (
            answer.choices[0].message.content,
            [answer.choices[0].finish_reason],
            answer.usage,
        )
    assert (content, finish, usage.completion_tokens) == (text, ["stop"], tokens)
