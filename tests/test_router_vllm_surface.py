"""The vLLM surface current clients use, against fake nodes (real sockets, real uvicorn, no model):
echoed token-id prompts, lax booleans and numbers, stream_options as vLLM reads them, the usage
field for cache hits, GET /load, POST /invocations and the batched chat endpoint. The same
through a real cluster is in test_api_surface_cluster.py."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.protocol.messages import TokenLogprobs
from pdserve.router.openai_schema import reads_as
from pdserve.router.responses import LogprobFormatter
from pdserve.router.tokenizer import Tokenizer
from tests.test_router_support import LONG_PROMPT, TEXT, fake_cluster, fake_pair, run_async

CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def tokens(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT)


def _events(reply: httpx.Response) -> list[dict]:
    lines = [line[len("data: ") :] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", reply.text
    return [json.loads(line) for line in lines[:-1]]


def _requests(default_model_dir, tokens, calls, **decode_fields) -> list[httpx.Response]:
    """``calls``: (method, path, body) each, sent one after another to a fake P/D pair."""

    async def go():
        nodes = fake_pair(tokens, **decode_fields)
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient(timeout=30) as http:
            return [await http.request(m, cluster.base_url + path, json=body) for m, path, body in calls]

    return run_async(go())


def test_a_token_id_prompt_echoes_as_the_tokenizer_decodes_it_special_tokens_kept(
    default_model_dir, tokenizer, tokens
):
    body = {"prompt": [0, 0, 0, 0, 0], "echo": True, "max_tokens": 5}
    whole, streamed = _requests(
        default_model_dir,
        tokens,
        [("POST", "/v1/completions", body), ("POST", "/v1/completions", {**body, "stream": True})],
    )
    echoed = "<|endoftext|>" * 5
    assert tokenizer.decode([0] * 5, skip_special_tokens=False) == echoed
    output = tokenizer.decode(tokens[:5])
    assert whole.json()["choices"][0]["text"] == echoed + output
    assert "".join(c["text"] for e in _events(streamed) for c in e["choices"]) == echoed + output


def test_lax_booleans_and_numeric_strings_are_read_as_vllm_reads_them(default_model_dir, tokens):
    chat = {"messages": CHAT, "logprobs": "true", "top_logprobs": "2", "max_tokens": "3", "stream": "0"}
    completion = {"prompt": LONG_PROMPT, "max_tokens": 3.0, "echo": 1, "temperature": "0", "n": "2"}
    chat_reply, completion_reply = _requests(
        default_model_dir,
        tokens,
        [("POST", "/v1/chat/completions", chat), ("POST", "/v1/completions", completion)],
    )
    assert chat_reply.status_code == 200, chat_reply.text
    content = chat_reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert completion_reply.status_code == 200, completion_reply.text
    choices = completion_reply.json()["choices"]
    assert len(choices) == 2 and all(c["text"].startswith(LONG_PROMPT) for c in choices)


def test_no_op_values_of_refused_fields_coerce_like_declared_ones():
    assert reads_as("false", False) and reads_as(0, False) and reads_as("1", True)
    assert reads_as(1, 1.0) and reads_as("0", 0) and reads_as("auto", "auto")
    assert not reads_as(False, 0) and not reads_as(True, 1)  # a boolean is never a number
    assert not reads_as("yes", False) and not reads_as(2, False) and not reads_as(["text"], "text")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_are_read_as_vllm_reads_them(default_model_dir, tokens, path):
    base = {"prompt": LONG_PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    base |= {"max_tokens": 4, "stream": True}
    options = [
        {"include_usage": False, "continuous_usage_stats": True},  # vLLM: no usage at all
        {"include_usage": True, "continuous_usage_stats": True},
        {"include_usage": "true"},
    ]
    replies = _requests(
        default_model_dir, tokens, [("POST", path, {**base, "stream_options": o}) for o in options]
    )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    silent, continuous, last_only = (_events(r) for r in replies)
    assert not any("usage" in e for e in silent)
    assert all("usage" in e for e in continuous) and continuous[-1]["usage"]["completion_tokens"] == 4
    assert [("usage" in e) for e in last_only] == [False] * (len(last_only) - 1) + [True]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_usage_reports_cache_read_input_tokens_beside_cached_tokens(default_model_dir, tokens, path):
    base = {"prompt": LONG_PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    base |= {"max_tokens": 3}
    streamed = {
        **base,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    calls = [("POST", path, base), ("POST", path, streamed)]
    # both fake nodes report 4 cached prompt tokens (the repeat may run on the decode node alone)
    whole, stream = _requests(default_model_dir, tokens, calls, num_cached_tokens=4)
    usages = [whole.json()["usage"]] + [e["usage"] for e in _events(stream)]
    for usage in usages:
        assert usage["cache_read_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] == 4


def test_load_counts_the_generation_requests_under_way(default_model_dir, tokens):
    async def go():
        nodes = fake_pair(tokens, token_delay_s=0.1)
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient(timeout=30) as http:
            url = cluster.base_url
            before = (await http.get(url + "/load")).json()
            body = {"prompt": LONG_PROMPT, "max_tokens": 8, "stream": True}
            during = None
            async with http.stream("POST", url + "/v1/completions", json=body) as reply:
                async for _ in reply.aiter_lines():  # from the first event on, the request is under way
                    during = during or (await http.get(url + "/load")).json()
            after = (await http.get(url + "/load")).json()
            return before, during, after

    assert run_async(go()) == ({"server_load": 0}, {"server_load": 1}, {"server_load": 0})


def test_invocations_dispatch_by_body_shape_to_chat_or_completions(default_model_dir, tokens):
    replies = _requests(
        default_model_dir,
        tokens,
        [
            ("POST", "/invocations", {"messages": CHAT, "max_tokens": 3}),
            ("POST", "/invocations", {"prompt": LONG_PROMPT, "max_tokens": 3}),
            ("POST", "/invocations", {"prompt": LONG_PROMPT, "max_tokens": 3, "stream": True}),
            ("GET", "/ping", None),
        ],
    )
    chat, completion, streamed, ping = replies
    assert chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]
    assert completion.json()["object"] == "text_completion"
    text = completion.json()["choices"][0]["text"]
    assert "".join(c["text"] for e in _events(streamed) for c in e["choices"]) == text
    assert ping.status_code == 200


# vLLM's whole responses dump every field of its models, null when unset
# (vllm/entrypoints/openai/chat_completion/protocol.py, completion/protocol.py at 002032ee)
VLLM_CHAT_KEYS = [
    *("id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage"),
    *("prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params"),
    "metrics",
]
VLLM_COMPLETION_KEYS = [k for k in VLLM_CHAT_KEYS if not k.startswith("prompt_")]


def test_invocations_answer_with_vllms_top_level_keys_as_the_endpoints_they_stand_for(
    default_model_dir, tokens
):
    chat = {"messages": CHAT, "max_tokens": 3}
    completion = {"prompt": LONG_PROMPT, "max_tokens": 3}
    replies = _requests(
        default_model_dir,
        tokens,
        [
            ("POST", "/v1/chat/completions", chat),
            ("POST", "/invocations", chat),
            ("POST", "/v1/completions", completion),
            ("POST", "/invocations", completion),
            ("POST", "/v1/chat/completions/batch", {**chat, "messages": [CHAT]}),
            ("POST", "/invocations", {**chat, "prompt_logprobs": 1, "return_token_ids": True}),
        ],
    )
    bodies = [r.json() for r in replies]
    assert [list(b) for b in bodies[:2]] == [VLLM_CHAT_KEYS] * 2
    assert [list(b) for b in bodies[2:4]] == [VLLM_COMPLETION_KEYS] * 2
    assert list(bodies[4]) == VLLM_CHAT_KEYS
    assert {
        k: bodies[0][k] for k in ("service_tier", "system_fingerprint", "prompt_logprobs", "metrics")
    } == {
        "service_tier": None,
        "system_fingerprint": None,
        "prompt_logprobs": None,
        "metrics": None,
    }
    asked = bodies[5]
    assert list(asked) == VLLM_CHAT_KEYS and asked["prompt_token_ids"] and asked["prompt_logprobs"][0] is None


def test_batched_chat_answers_each_conversation_in_order(default_model_dir, tokenizer, tokens):
    conversations = [
        CHAT,
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, or"}],
    ]
    body = {
        "messages": conversations,
        "max_tokens": 3,
        "echo": True,
        "return_token_ids": True,
        "continue_final_message": False,
    }
    (reply,) = _requests(default_model_dir, tokens, [("POST", "/v1/chat/completions/batch", body)])
    assert reply.status_code == 200, reply.text
    done = reply.json()
    assert done["object"] == "chat.completion" and [c["index"] for c in done["choices"]] == [0, 1]
    output = tokenizer.decode(tokens[:3])
    assert [c["message"]["content"] for c in done["choices"]] == [output, "Blue, or" + output]
    prompt_ids = [tokenizer.encode_chat(c) for c in conversations]
    assert [c["prompt_token_ids"] for c in done["choices"]] == prompt_ids
    assert done["prompt_token_ids"] is None  # one per conversation, on its choice
    assert done["usage"]["prompt_tokens"] == sum(map(len, prompt_ids))
    assert done["usage"]["completion_tokens"] == 6


def test_chat_logprobs_of_chosen_ids_list_the_sampled_token_first_and_once(tokenizer):
    """logprob_token_ids in chat (single or batched): vLLM lists every entry the sampler gave the
    position, the sampled token first (column 0), then the ids asked for in their order; a
    sampled token among them is listed once. Without chosen ids the top alternatives stay as
    they are."""
    entries = {
        "outside": TokenLogprobs(
            token_id=9, logprob=-0.1, top_token_ids=(5, 17, 300), top_logprobs=(-3.0, -4.0, -5.0)
        ),
        "inside": TokenLogprobs(
            token_id=17, logprob=-0.2, top_token_ids=(5, 17, 300), top_logprobs=(-3.0, -0.2, -5.0)
        ),
    }

    def listed(formatter: LogprobFormatter, name: str) -> list[tuple[str, float]]:
        (content,) = formatter.chat([entries[name]])["content"]
        return [(t["token"], t["logprob"]) for t in content["top_logprobs"]]

    chosen = LogprobFormatter(tokenizer, 3, True, chosen=True)
    assert listed(chosen, "outside") == [
        ("token_id:9", -0.1),
        ("token_id:5", -3.0),
        ("token_id:17", -4.0),
        ("token_id:300", -5.0),
    ]
    assert listed(chosen, "inside") == [("token_id:17", -0.2), ("token_id:5", -3.0), ("token_id:300", -5.0)]
    top = LogprobFormatter(tokenizer, 2, True)
    assert listed(top, "outside") == [("token_id:5", -3.0), ("token_id:17", -4.0)]
