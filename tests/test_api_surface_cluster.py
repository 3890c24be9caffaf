"""The vLLM-compatible request surface end to end, fail-closed: 1 prefill + 1 decode node on a real
Redis and two routers on them, one that disaggregates every prompt of 8 tokens or more and one
that never does (the decode node prefills). Requests go concurrently, streamed and not, on both;
answers are checked against Hugging Face on the same weights (prompt logprobs against its
log_softmax, outputs against its greedy generate, chat prompts against its chat template).

``test_every_schema_field_is_honoured_or_refused_by_name`` walks the field lists of OpenAI's and
vLLM's request schemas (tests/data/request_fields.json) and asserts, for each, a 200 or a 400
whose ``param`` names it; ``test_every_agent_api_field_is_honoured_or_refused_by_name`` does the
same for the Responses and Messages APIs (OpenAI's, Anthropic's and vLLM's fields)."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import pathlib
import re

import httpx
import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.protocol.sampling_params import BeamSearch, SamplingParams
from pdserve.router.tokenizer import Tokenizer
from tests import web
from tests.engine_helpers import hf_beams, hf_greedy, hf_logits
from tests.test_cluster_concurrent import _prompts as _concurrent_prompts
from tests.test_cluster_concurrent import _stream

pytestmark = pytest.mark.usefixtures("processes")
DATA = pathlib.Path(__file__).parent / "data"
FIELDS = json.loads((DATA / "request_fields.json").read_text())
# A sample value for every field of both schemas, in one of two tables. Honoured: the request runs
# (200); refused: a 400 naming the field. The walk fails on a field in neither, so a field the
# schemas gain must be classified before it passes. (null: the walk sets the field itself.)
SAMPLES = json.loads((DATA / "request_field_samples.json").read_text())
HONOURED, REFUSED = SAMPLES["honoured"], SAMPLES["refused"]
ATOL = 1e-4  # logprobs through JSON: fp32 sums of a 49k-way softmax


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Seeded random prompts of its own: the concurrent module draws from the same generator on the
    same session cluster, and a prompt that begins as one of its would be a prefix hit here."""
    return _concurrent_prompts(10_000 + seed, lengths)


@pytest.fixture(scope="module")
def cluster(api_cluster):
    """The shared API-surface cluster (tests/conftest.py), its P/D routers and nodes."""
    model, routers, nodes = api_cluster
    pd_routers = {name: routers[name] for name in ("pd", "decode_only")}
    return model, pd_routers, {role: nodes[role] for role in ("prefill", "decode")}


@functools.cache
def _tokenizer(model: pathlib.Path) -> Tokenizer:
    return Tokenizer(model)


def _post(router, path: str, body: dict, status: int = 200) -> dict:
    reply = web.post(router.url + path, json=body, timeout=120)
    assert reply.status_code == status, reply.text
    return reply.json()


def _hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(str(model), prompt), dim=-1)  # [T, vocab]


def _check_prompt_logprobs(model, prompt: list[int], entries: list, num_top: int) -> None:
    """vLLM's shape: None first, then {token id: {logprob, rank, decoded_token}} with the prompt's
    token and the top ``num_top``; values equal HF's log_softmax of the prompt."""
    expected = _hf_logprobs(model, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        row, entry = expected[pos - 1], entries[pos]
        token = prompt[pos]
        assert str(token) in entry
        assert abs(entry[str(token)]["logprob"] - float(row[token])) < ATOL
        value = float(row[token])  # its rank, up to the logprobs within fp32 noise of it
        assert (
            int((row > value + ATOL).sum()) < entry[str(token)]["rank"] <= int((row > value - ATOL).sum()) + 1
        )
        top = row.topk(num_top)
        for rank, (value, token_id) in enumerate(
            zip(top.values.tolist(), top.indices.tolist(), strict=True), 1
        ):
            assert abs(entry[str(token_id)]["logprob"] - value) < ATOL
            given = entry[str(token_id)]["rank"]  # near-ties (the whole vocabulary has many) may swap
            assert (
                given in (rank, entry[str(token)]["rank"]) or abs(float(top.values[given - 1]) - value) < ATOL
            )
        assert len(entry) in (num_top, num_top + 1)


def _prompt_logprobs_of(router, model, prompt: list[int], stream: bool, num_top: int) -> list:
    body = {
        "model": model.name,
        "prompt": prompt,
        "max_tokens": 3,
        "temperature": 0,
        "prompt_logprobs": num_top,
    }
    if stream:
        events = _stream(router, "/v1/completions", body)
        firsts = [e["choices"][0]["prompt_logprobs"] for e in events if e["choices"]]
        assert all(f is None for f in firsts[1:])  # only the first chunk carries them
        return firsts[0]
    return _post(router, "/v1/completions", body)["choices"][0]["prompt_logprobs"]


@pytest.mark.parametrize("router_name", ["pd", "decode_only"])
def test_prompt_logprobs_equal_hf_concurrently_streamed_or_not_and_after_a_cache_hit(cluster, router_name):
    model, routers, nodes = cluster
    router = routers[router_name]
    prompts = _prompts(28, [40, 9, 130, 17, 64, 300])
    prompts.append(prompts[2][:96] + [5, 6, 7])  # shares full blocks with the 130-token prompt
    before = len(nodes["prefill"].events("request_added"))
    jobs = [(p, i % 2 == 1, (0, 1, 5)[i % 3]) for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: _prompt_logprobs_of(router, model, *j), jobs))
    for (prompt, _, num_top), entries in zip(jobs, results, strict=True):
        _check_prompt_logprobs(model, prompt, entries, num_top)
    # the repeat: cached on the node that ran it, still given (its positions are computed again)
    _check_prompt_logprobs(model, prompts[2], _prompt_logprobs_of(router, model, prompts[2], False, 2), 2)
    plain = _post(router, "/v1/completions", {"model": model.name, "prompt": prompts[2], "max_tokens": 1})
    assert plain["choices"][0]["prompt_logprobs"] is None  # the key is there, null, when not asked for
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    went_through_prefill = len(nodes["prefill"].events("request_added")) > before
    assert went_through_prefill == (router_name == "pd")
    chat = _post(
        router,
        "/v1/chat/completions",
        {
            "model": model.name,
            "messages": [{"role": "user", "content": "Hello there, friend"}],
            "prompt_logprobs": 2,
            "max_tokens": 2,
        },
    )
    ids = _tokenizer(model).encode_chat([{"role": "user", "content": "Hello there, friend"}])
    _check_prompt_logprobs(model, ids, chat["prompt_logprobs"], 2)


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object hook: a key twice in one JSON object fails (a dict would keep one)."""
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


@pytest.mark.parametrize("router_name", ["pd", "decode_only", "colocated"])
def test_a_prompt_token_that_is_the_top_one_is_listed_once_as_vllm_lists_it(api_cluster, router_name):
    """A prompt whose later tokens are the model's greedy choices: at those positions the token is
    the top-1, and its entry (rank 1) is the one listed, once, beside the other N-1, in the raw
    JSON of completions (whole and streamed) and completions' echo, on every path."""
    model, routers, _ = api_cluster
    router = routers[router_name]
    start = _prompts(91, [9])[0]
    prompt = start + hf_greedy(str(model), start, 6)
    base = {"model": model.name, "temperature": 0, "max_tokens": 1}
    replies = [
        web.post(
            router.url + "/v1/completions", json={**base, "prompt": prompt, "prompt_logprobs": 3}, timeout=120
        ),
        web.post(
            router.url + "/v1/completions",
            json={**base, "prompt": prompt, "logprobs": 3, "echo": True},
            timeout=120,
        ),
    ]
    whole, echo = (json.loads(r.text, object_pairs_hook=_no_repeated_keys)["choices"][0] for r in replies)
    streamed = [
        e["choices"][0]
        for e in _stream(router, "/v1/completions", {**base, "prompt": prompt, "prompt_logprobs": 3})
    ]
    for entries in (whole["prompt_logprobs"], streamed[0]["prompt_logprobs"]):
        for position in range(len(start), len(prompt)):  # the greedy tokens: each its position's top-1
            entry = entries[position]
            assert entry[str(prompt[position])]["rank"] == 1 and len(entry) == 3, entry
    for position in range(len(start), len(prompt)):
        top = echo["logprobs"]["top_logprobs"][position]
        assert len(top) == 3 and max(top.values()) == echo["logprobs"]["token_logprobs"][position]


def _echo_scores(router, model, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    """lm-eval's loglikelihood request (echo, logprobs 1, temperature 0)."""
    body = {
        "model": model.name,
        "prompt": [prompt],
        "max_tokens": max_tokens,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
        "seed": 1234,
    }
    if not stream:
        return _post(router, "/v1/completions", body)["choices"][0]
    merged = {
        "text": "",
        "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
    }
    for event in _stream(router, "/v1/completions", body):
        for choice in event["choices"]:
            merged["text"] += choice["text"]
            for key in merged["logprobs"]:
                merged["logprobs"][key] += (choice["logprobs"] or {}).get(key, [])
            merged["finish_reason"] = choice["finish_reason"] or merged.get("finish_reason")
    return merged


@pytest.mark.parametrize("router_name", ["pd", "decode_only"])
def test_echo_with_logprobs_scores_the_prompt_as_hf_does_for_lm_eval(cluster, router_name):
    model, routers, _ = cluster
    router = routers[router_name]
    tok = _tokenizer(model)
    prompts = _prompts(7, [12, 33, 70, 9])
    jobs = [(p, (1, 0)[i % 2], i >= 2) for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(pool.map(lambda j: _echo_scores(router, model, *j), jobs))
    for (prompt, max_tokens, _), choice in zip(jobs, choices, strict=True):
        expected = _hf_logprobs(model, prompt)
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for pos in range(1, len(prompt)):
            assert abs(lp["token_logprobs"][pos] - float(expected[pos - 1, prompt[pos]])) < ATOL
            greedy = int(expected[pos - 1].argmax()) == prompt[pos]
            # lm-eval's is_greedy: the token's logprob is exactly the best of the top entries
            assert (lp["token_logprobs"][pos] == max(lp["top_logprobs"][pos].values())) == greedy
        assert lp["tokens"][: len(prompt)] == [tok.token_text(t) for t in prompt]
        prompt_text = tok.decode(prompt)
        assert choice["text"].startswith(prompt_text)
        if max_tokens == 0:
            assert choice["text"] == prompt_text and choice["finish_reason"] == "length"
        else:
            greedy_next = hf_greedy(str(model), prompt, 1)[0]
            assert lp["tokens"][-1] == tok.token_text(greedy_next)


def _output_rows(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's log_softmax at each output position [len(output), vocab]."""
    return _hf_logprobs(model, prompt + output)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def _token_id(text: str) -> int:
    assert text.startswith("token_id:"), text  # return_tokens_as_token_ids: no text collisions
    return int(text[len("token_id:") :])


def _chat_logprobs(router, body: dict, stream: bool) -> list[dict]:
    if not stream:
        return _post(router, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    events = _stream(router, "/v1/chat/completions", body)
    return [c for e in events for ch in e["choices"] if ch.get("logprobs") for c in ch["logprobs"]["content"]]


def _completion_choice(router, body: dict, stream: bool) -> dict:
    if not stream:
        return _post(router, "/v1/completions", body)["choices"][0]
    merged: dict = {"logprobs": {"tokens": [], "top_logprobs": []}, "prompt_logprobs": None}
    for event in _stream(router, "/v1/completions", body):
        for choice in event["choices"]:
            merged["prompt_logprobs"] = merged["prompt_logprobs"] or choice.get("prompt_logprobs")
            if choice.get("logprobs"):
                merged["logprobs"]["tokens"] += choice["logprobs"]["tokens"]
                merged["logprobs"]["top_logprobs"] += choice["logprobs"]["top_logprobs"]
    return merged


@pytest.mark.parametrize("router_name", ["pd", "decode_only"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_whole_vocabulary_and_chosen_token_ids_equal_hf_log_softmax(cluster, router_name, stream):
    """vLLM's -1 (prompt_logprobs; chat's top_logprobs) lists every token; logprob_token_ids lists
    the tokens asked for, on both endpoints. An 8-token prompt goes through the prefill node on
    the disaggregating router; requests run concurrently."""
    model, routers, _ = cluster
    router = routers[router_name]
    vocab = _tokenizer(model).vocab_size
    prompt = _prompts(3, [8])[0]
    chosen = [5, 17, 300]
    messages = [{"role": "user", "content": "Name a colour."}]
    base = {"model": model.name, "temperature": 0, "max_tokens": 2, "return_tokens_as_token_ids": True}
    calls = [
        lambda: _completion_choice(router, {**base, "prompt": prompt, "prompt_logprobs": -1}, stream),
        lambda: _chat_logprobs(
            router, {**base, "messages": messages, "logprobs": True, "top_logprobs": -1}, stream
        ),
        lambda: _completion_choice(
            router, {**base, "prompt": prompt, "logprobs": 1, "logprob_token_ids": chosen}, stream
        ),
        lambda: _chat_logprobs(
            router, {**base, "messages": messages, "logprobs": True, "logprob_token_ids": chosen}, stream
        ),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        whole_prompt, whole_chat, chosen_completion, chosen_chat = [
            f.result() for f in map(pool.submit, calls)
        ]
    _check_prompt_logprobs(model, prompt, whole_prompt["prompt_logprobs"], vocab)
    chat_prompt = _tokenizer(model).encode_chat(messages)
    for content, whole in ((whole_chat, True), (chosen_chat, False)):
        output = [_token_id(c["token"]) for c in content]
        rows = _output_rows(model, chat_prompt, output)
        assert len(output) == 2 and output == rows.argmax(dim=-1).tolist()  # greedy
        for entry, row in zip(content, rows, strict=True):
            listed = {_token_id(t["token"]): t["logprob"] for t in entry["top_logprobs"]}
            assert abs(entry["logprob"] - float(row[_token_id(entry["token"])])) < ATOL
            if whole:
                assert sorted(listed) == list(range(vocab))
            else:  # as vLLM: the sampled token, then the ids asked for in their order, each once
                sampled = _token_id(entry["token"])
                expected = [sampled, *(t for t in chosen if t != sampled)]
                assert [_token_id(t["token"]) for t in entry["top_logprobs"]] == expected
            ids = torch.tensor(list(listed))
            assert torch.allclose(torch.tensor(list(listed.values())), row[ids], atol=ATOL)
    lp = chosen_completion["logprobs"]
    output = [_token_id(t) for t in lp["tokens"]]
    assert output == _output_rows(model, prompt, output).argmax(dim=-1).tolist()
    for token, top, row in zip(output, lp["top_logprobs"], _output_rows(model, prompt, output), strict=True):
        assert set(map(_token_id, top)) == set(chosen) | {
            token
        }  # the sampled token is listed too, as in vLLM
        assert all(abs(value - float(row[_token_id(t)])) < ATOL for t, value in top.items())


def test_batched_chat_lists_the_sampled_token_before_the_chosen_ids_as_vllm_does(cluster):
    """logprob_token_ids on /v1/chat/completions/batch: each position lists the sampled token, then
    the ids asked for (vLLM's _create_chat_logprobs, shared with the single chat endpoint); the
    values are HF's log_softmax. The conversation that prefills on the prefill node and the short
    one run side by side."""
    model, routers, _ = cluster
    chosen = [5, 17, 300]
    conversations = [
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "user", "content": "Tell me about the sea and its long, grey waves."}],
    ]
    body = {"model": model.name, "messages": conversations, "max_tokens": 3, "temperature": 0}
    body |= {"logprobs": True, "logprob_token_ids": chosen, "return_tokens_as_token_ids": True}
    choices = _post(routers["pd"], "/v1/chat/completions/batch", body)["choices"]
    for conversation, choice in zip(conversations, choices, strict=True):
        content = choice["logprobs"]["content"]
        output = [_token_id(c["token"]) for c in content]
        rows = _output_rows(model, _tokenizer(model).encode_chat(conversation), output)
        assert len(output) == 3 and output == rows.argmax(dim=-1).tolist()
        for entry, row in zip(content, rows, strict=True):
            sampled = _token_id(entry["token"])
            listed = [(_token_id(t["token"]), t["logprob"]) for t in entry["top_logprobs"]]
            assert [t for t, _ in listed] == [sampled, *(t for t in chosen if t != sampled)]
            assert all(abs(value - float(row[t])) < ATOL for t, value in listed)


@pytest.mark.parametrize("router_name", ["pd", "decode_only"])
def test_a_token_id_prompt_echoes_its_decode_special_tokens_kept_with_matching_text_offsets(
    cluster, router_name
):
    model, routers, _ = cluster
    tok = _tokenizer(model)
    prompt = [0, 0, 0, 0, 0] + _prompts(31, [7])[0]  # five <|endoftext|>, then ordinary tokens
    echoed = tok.decode(prompt, skip_special_tokens=False)
    assert echoed.startswith("<|endoftext|>" * 5)
    for stream in (False, True):
        choice = _echo_scores(routers[router_name], model, prompt, 5, stream)
        lp = choice["logprobs"]
        assert choice["text"].startswith(echoed) and len(lp["tokens"]) == len(prompt) + 5
        assert lp["tokens"][:5] == ["<|endoftext|>"] * 5
        lengths = [len(t) for t in lp["tokens"]]
        assert lp["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
        for token, offset in zip(lp["tokens"][: len(prompt)], lp["text_offset"], strict=False):
            assert choice["text"][offset : offset + len(token)] == token
        assert lp["text_offset"][len(prompt)] == len(echoed)  # the output starts where the echo ends


@pytest.mark.parametrize("router_name", ["pd", "decode_only"])
def test_usage_reports_cache_read_input_tokens_cold_and_on_a_repeat(cluster, router_name):
    model, routers, _ = cluster
    router = routers[router_name]
    prompt = _prompts({"pd": 41, "decode_only": 43}[router_name], [40])[0]  # seen by no other test
    body = {"model": model.name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    stream_body = {**body, "stream_options": {"include_usage": True}}
    cold = _post(router, "/v1/completions", body)["usage"]
    repeats = [
        _post(router, "/v1/completions", body)["usage"],
        _stream(router, "/v1/completions", stream_body)[-1]["usage"],
    ]
    assert cold["cache_read_input_tokens"] == cold["prompt_tokens_details"]["cached_tokens"] == 0
    for usage in repeats:
        assert usage["cache_read_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] > 0
    chat = {
        "model": model.name,
        "messages": [{"role": "user", "content": "Hello there, friend"}],
        "max_tokens": 2,
    }
    for usage in (
        _post(router, "/v1/chat/completions", chat)["usage"],
        _stream(router, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})[-1][
            "usage"
        ],
    ):
        assert usage["cache_read_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]


def test_batched_chat_invocations_lax_fields_and_load_on_both_routers(cluster):
    model, routers, _ = cluster
    conversations = [
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "user", "content": "Tell me about the sea."}],
    ]
    base = {"model": model.name, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for router in routers.values():
        singles = [_post(router, "/v1/chat/completions", {**base, "messages": c}) for c in conversations]
        batch = _post(router, "/v1/chat/completions/batch", {**base, "messages": conversations})
        assert [c["index"] for c in batch["choices"]] == [0, 1]
        for single, choice, messages in zip(singles, batch["choices"], conversations, strict=True):
            expected = _tokenizer(model).decode(
                hf_greedy(str(model), _tokenizer(model).encode_chat(messages), 4)
            )
            assert choice["message"]["content"] == single["choices"][0]["message"]["content"] == expected
        assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
        # lax values as vLLM reads them, through SageMaker's entry
        lax = {
            **base,
            "messages": conversations[0],
            "logprobs": "true",
            "top_logprobs": "1",
            "max_tokens": "4",
        }
        invoked = _post(router, "/invocations", lax)
        assert invoked["choices"][0]["message"]["content"] == singles[0]["choices"][0]["message"]["content"]
        assert len(invoked["choices"][0]["logprobs"]["content"]) == 4
        completion = _post(router, "/invocations", {**base, "prompt": "The sea is"})
        assert completion["object"] == "text_completion" and completion["choices"][0]["text"]
        assert web.get(router.url + "/load", timeout=10).json() == {"server_load": 0}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_structured_outputs_constrain_as_guided_fields_do(cluster, endpoint):
    model, routers, _ = cluster
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    base = {"model": model.name, "max_tokens": 12, "temperature": 0}
    base |= (
        {"prompt": "Generate an email address:"}
        if endpoint == "completions"
        else {"messages": [{"role": "user", "content": "Pick one."}]}
    )
    cases = [
        ({"regex": "[a-z]{3,6}@[a-z]{3,5}\\.com"}, {"guided_regex": "[a-z]{3,6}@[a-z]{3,5}\\.com"}),
        ({"choice": ["alpha", "beta", "gamma"]}, {"guided_choice": ["alpha", "beta", "gamma"]}),
        (
            {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
            {"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
        ),
        ({"json_object": True}, {"response_format": {"type": "json_object"}}),
        ({"grammar": 'root ::= "yes" | "no"'}, {"guided_grammar": 'root ::= "yes" | "no"'}),
    ]

    def text(reply: dict) -> str:
        choice = reply["choices"][0]
        return choice["text"] if endpoint == "completions" else choice["message"]["content"]

    for router in routers.values():
        bodies = [b for so, old in cases for b in ({**base, "structured_outputs": so}, {**base, **old})]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(functools.partial(_post, router, path), bodies))
        for i, (so, _) in enumerate(cases):
            new, old = text(replies[2 * i]), text(replies[2 * i + 1])
            assert new == old, (so, new, old)  # the same constraint, the same greedy output
            if "regex" in so and replies[2 * i]["choices"][0]["finish_reason"] == "stop":
                assert re.fullmatch(so["regex"], new)
            if "choice" in so:
                assert new in so["choice"]
            if "grammar" in so:
                assert new in ("yes", "no")
            if "json" in so and replies[2 * i]["choices"][0]["finish_reason"] == "stop":
                assert isinstance(json.loads(new)["n"], int)
    bad = _post(routers["pd"], path, {**base, "structured_outputs": {"regex": "[.*"}}, 400)
    assert bad["error"]["param"] == "structured_outputs.regex"


def test_token_ids_in_and_out_and_truncation(cluster):
    model, routers, _ = cluster
    tok = _tokenizer(model)
    prompt = _prompts(4, [60])[0]
    for router in routers.values():
        body = {"model": model.name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        whole = _post(router, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]
        assert whole["prompt_token_ids"] == prompt
        assert whole["token_ids"] == hf_greedy(str(model), prompt, 6)
        assert tok.decode(whole["token_ids"]) == whole["text"]
        events = _stream(router, "/v1/completions", {**body, "return_token_ids": True})
        streamed = [c for e in events for c in e["choices"]]
        assert streamed[0]["prompt_token_ids"] == prompt
        assert [t for c in streamed for t in c["token_ids"]] == whole["token_ids"]
        for side, kept in (("left", prompt[-25:]), ("right", prompt[:25]), (None, prompt[-25:])):
            cut = {**body, "truncate_prompt_tokens": 25} | ({"truncation_side": side} if side else {})
            reply = _post(router, "/v1/completions", cut)
            assert reply["usage"]["prompt_tokens"] == 25  # usage counts what was run
            assert tok.encode(reply["choices"][0]["text"], False) is not None
            assert reply["choices"][0]["text"] == tok.decode(hf_greedy(str(model), kept, 6))
        messages = [{"role": "user", "content": "Tell me about the sea and its long, grey waves."}]
        chat = _post(
            router,
            "/v1/chat/completions",
            {
                "model": model.name,
                "messages": messages,
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert chat["prompt_token_ids"] == tok.encode_chat(messages)
        assert chat["choices"][0]["token_ids"] == hf_greedy(str(model), chat["prompt_token_ids"], 4)


def test_streaming_usage_every_chunk_and_include_usage_on_both_endpoints(cluster):
    model, routers, _ = cluster
    prompt = _prompts(9, [20])[0]
    for router in routers.values():
        for path, body in (
            ("/v1/completions", {"prompt": prompt}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to ten."}]}),
        ):
            body = {
                **body,
                "model": model.name,
                "max_tokens": 7,
                "temperature": 0,
                "ignore_eos": True,
                "n": 2,
            }
            opts = {"include_usage": True, "continuous_usage_stats": True}
            events = _stream(router, path, {**body, "stream_options": opts})
            assert all("usage" in e for e in events)
            counts = [e["usage"]["completion_tokens"] for e in events]
            assert counts == sorted(counts) and counts[-1] == 14 and not events[-1]["choices"]
            only_last = _stream(router, path, {**body, "stream_options": {"include_usage": True}})
            assert [("usage" in e) for e in only_last] == [False] * (len(only_last) - 1) + [True]
            for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                assert only_last[-1]["usage"][key] == events[-1]["usage"][key]
            plain = _stream(router, path, body)
            assert not any("usage" in e for e in plain)
            # as vLLM reads it: continuous_usage_stats without include_usage asks for no usage at all
            silent = {"include_usage": False, "continuous_usage_stats": True}
            assert not any("usage" in e for e in _stream(router, path, {**body, "stream_options": silent}))


def _hf_chat_ids(model, messages, **kwargs) -> list[int]:
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(model))
    return hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


def test_chat_echo_continue_final_message_generation_prompt_and_any_role(cluster):
    model, routers, _ = cluster
    tok = _tokenizer(model)
    partial = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    cases = [
        (
            {
                "messages": partial,
                "continue_final_message": True,
                "add_generation_prompt": False,
                "echo": True,
            },
            _hf_chat_ids(model, partial, continue_final_message=True, add_generation_prompt=False),
            "The color is",
        ),
        (
            {"messages": partial[:1], "add_generation_prompt": False},
            _hf_chat_ids(model, partial[:1], add_generation_prompt=False),
            "",
        ),
        (
            {
                "messages": [
                    {"role": "observer", "content": "It is raining."},
                    {"role": "user", "content": "Hi"},
                ]
            },
            _hf_chat_ids(
                model,
                [{"role": "observer", "content": "It is raining."}, {"role": "user", "content": "Hi"}],
                add_generation_prompt=True,
            ),
            "",
        ),
    ]
    for router in routers.values():
        for extra, ids, echo in cases:
            body = {
                "model": model.name,
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                **extra,
            }
            whole = _post(router, "/v1/chat/completions", body)
            assert whole["prompt_token_ids"] == ids
            output = tok.decode(hf_greedy(str(model), ids, 5))
            assert whole["choices"][0]["message"]["content"] == echo + output
            events = _stream(router, "/v1/chat/completions", body)
            streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            assert streamed == echo + output
            tokenized = _post(router, "/tokenize", {k: v for k, v in extra.items() if k != "echo"})
            assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)


def test_int64_seeds_give_the_same_tokens_on_every_path(cluster):
    model, routers, _ = cluster
    prompt = _prompts(11, [30])[0]
    outputs = {}
    for seed in (-1, (1 << 63) - 1, -(1 << 63)):
        body = {
            "model": model.name,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": seed,
            "n": 2,
            "return_token_ids": True,
        }
        for name, router in routers.items():
            reply = _post(router, "/v1/completions", body)
            outputs[(seed, name)] = [c["token_ids"] for c in reply["choices"]]
        assert outputs[(seed, "pd")] == outputs[(seed, "decode_only")]
        assert outputs[(seed, "pd")][0] != outputs[(seed, "pd")][1]
    assert outputs[(-1, "pd")] != outputs[((1 << 63) - 1, "pd")]


def test_tokenize_detokenize_and_version(cluster):
    model, routers, _ = cluster
    tok = _tokenizer(model)
    router = routers["pd"]
    reply = _post(
        router, "/tokenize", {"model": model.name, "prompt": "Hello world", "return_token_strs": True}
    )
    assert reply["tokens"] == tok.encode("Hello world") and reply["count"] == len(reply["tokens"])
    assert (
        reply["token_strs"] == [tok.token_text(t) for t in reply["tokens"]] and reply["max_model_len"] == 1024
    )
    assert _post(router, "/detokenize", {"tokens": reply["tokens"]})["prompt"] == "Hello world"
    assert _post(router, "/detokenize", {"tokens": [10**9]}, 400)["error"]["param"] == "tokens"
    assert _post(router, "/tokenize", {"prompt": "x", "messages": []}, 400)["error"]["param"]
    assert _post(router, "/tokenize", {"prompt": "x", "bogus": 1}, 400)["error"]["param"] == "bogus"
    assert web.get(router.url + "/version", timeout=10).json()["version"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_schema_field_is_honoured_or_refused_by_name(cluster, endpoint):
    model, routers, _ = cluster
    fields = sorted(set(FIELDS[endpoint]["openai"]) | set(FIELDS[endpoint]["vllm"]) | {"stream"})
    unclassified = [f for f in fields if f not in HONOURED and f not in REFUSED]
    assert not unclassified, f"classify these fields: {unclassified}"
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    base = {"model": model.name, "max_tokens": 2, "temperature": 0}
    base |= (
        {"prompt": "The sea is"}
        if endpoint == "completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    needs = {"top_logprobs": {"logprobs": True}, "truncation_side": {"truncate_prompt_tokens": 3}}
    needs |= {
        "stream_options": {"stream": True},
        "min_tokens": {"ignore_eos": False},
        "tools": {"tool_choice": "none"},
    }
    if endpoint == "chat":
        needs["logprobs"] = {}
    samples = {**HONOURED, "logprobs": True if endpoint == "chat" else 2}
    needs["logprob_token_ids"] = {"logprobs": samples["logprobs"]}

    def send(field: str) -> tuple[str, httpx.Response]:
        if field in REFUSED:
            body = {**base, field: REFUSED[field]}
        else:
            body = {**base, **needs.get(field, {}), field: samples[field]}
        if body.get("stream"):
            with web.stream("POST", routers["pd"].url + path, json=body, timeout=60) as reply:
                reply.read()
                return field, reply
        return field, web.post(routers["pd"].url + path, json=body, timeout=60)

    walk = [f for f in fields if f not in ("model", "prompt", "messages")]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = dict(pool.map(send, walk))
    for field, reply in replies.items():
        if field in REFUSED:
            assert reply.status_code == 400, (field, reply.text)
            assert reply.json()["error"]["param"] == field, (field, reply.text)
        else:
            assert reply.status_code == 200, (field, reply.text)
    unknown = web.post(routers["pd"].url + path, json={**base, "guided_regexp": "a+"}, timeout=60)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "guided_regexp"


# The agent APIs' walk: per endpoint, its path, a minimal body, what some fields need beside them,
# and how a refusal names the field (OpenAI's param; Anthropic's shape has none, its message does).
AGENT_APIS = {
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "temperature": 0}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
}
AGENT_NEEDS = {
    "responses": {
        "stream_options": {"stream": True},
        "tools": {"tool_choice": "none"},
        "top_logprobs": {"include": ["message.output_text.logprobs"]},
    },
    "messages": {
        "tools": {"tool_choice": {"type": "none"}},
        "tool_choice": {"tools": [{"name": "f", "input_schema": {}}]},
    },
}


def _refusal_names(endpoint: str, reply: httpx.Response, field: str) -> bool:
    body = reply.json()
    if endpoint == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return re.search(rf"\b{re.escape(field)}\b", body["error"]["message"]) is not None
    return body["error"]["param"] == field


@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_every_agent_api_field_is_honoured_or_refused_by_name(cluster, endpoint):
    """The Responses and Messages APIs' fields, OpenAI's or Anthropic's and vLLM's
    (tests/data/request_fields.json), each a 200 or a 400 naming it, in the API's own error shape."""
    model, routers, _ = cluster
    router = routers["pd"]
    fields = sorted(set().union(*FIELDS[endpoint].values()))  # each source's names
    honoured, refused = SAMPLES[endpoint]["honoured"], SAMPLES[endpoint]["refused"]
    unclassified = [f for f in fields if f not in honoured and f not in refused]
    assert not unclassified, f"classify these fields: {unclassified}"
    path, minimal = AGENT_APIS[endpoint]
    base = {"model": model.name, **minimal}
    if endpoint == "responses":  # a stored response to continue from
        honoured = {**honoured, "previous_response_id": _post(router, path, base)["id"]}

    def send(field: str) -> tuple[str, httpx.Response]:
        if field in refused:
            body = {**base, field: refused[field]}
        else:
            body = {**base, **AGENT_NEEDS[endpoint].get(field, {}), field: honoured[field]}
        if body.get("stream"):
            with web.stream("POST", router.url + path, json=body, timeout=60) as reply:
                reply.read()
                return field, reply
        return field, web.post(router.url + path, json=body, timeout=60)

    walk = [f for f in fields if f not in ("model", "input", "messages")]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = dict(pool.map(send, walk))
    for field, reply in replies.items():
        if field in refused:
            assert reply.status_code == 400, (field, reply.text)
            assert _refusal_names(endpoint, reply, field), (field, reply.text)
        else:
            assert reply.status_code == 200, (field, reply.text)
    unknown = web.post(router.url + path, json={**base, "bogus_field": 1}, timeout=60)
    assert unknown.status_code == 400 and _refusal_names(endpoint, unknown, "bogus_field")


def _beam_choices(router, path: str, body: dict, stream: bool) -> list[dict]:
    """Each choice's token ids, text, logprobs and finish reason, by index, streamed or not."""
    body = {**body, "return_token_ids": True}
    if not stream:
        return sorted(_post(router, path, body)["choices"], key=lambda c: c["index"])
    merged: dict[int, dict] = {}
    for event in _stream(router, path, body):
        for choice in event["choices"]:
            into = merged.setdefault(choice["index"], {"index": choice["index"], "token_ids": [], "text": ""})
            into["token_ids"] += choice.get("token_ids") or []
            into["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            into["logprobs"] = choice.get("logprobs") or into.get("logprobs")
            into["finish_reason"] = choice.get("finish_reason") or into.get("finish_reason")
    return [merged[i] for i in sorted(merged)]


BEAM_CASES = [  # (prompt length, n, max_tokens, length_penalty, early_stopping, logprobs)
    (12, 2, 8, None, None, None),
    (40, 3, 10, 0.5, True, 2),
    (9, 4, 6, None, False, None),
    (25, 3, 9, -0.5, None, 1),
]


@pytest.mark.parametrize("router_name", ["pd", "decode_only"])
def test_beam_search_equals_hf_num_beams_concurrently_streamed_or_not(cluster, router_name):
    """use_beam_search: the n choices are HF's n best beams, best first, streamed or not, beside
    ordinary requests; on the disaggregating router the prefill node runs the prompt and the
    decode node forks the beams from the first step's candidates it sent."""
    model, routers, nodes = cluster
    router = routers[router_name]
    eos = list(ModelConfig.from_path(str(model)).eos_token_ids)
    prompts = _prompts(61, [case[0] for case in BEAM_CASES])
    before = len(nodes["prefill"].events("request_added"))
    jobs = []
    for prompt, (_, n, max_tokens, penalty, early, logprobs) in zip(prompts, BEAM_CASES, strict=True):
        body = {
            "model": model.name,
            "prompt": prompt,
            "n": n,
            "max_tokens": max_tokens,
            "use_beam_search": True,
        }
        body |= {k: v for k, v in (("length_penalty", penalty), ("early_stopping", early)) if v is not None}
        if logprobs is not None:
            body |= {"logprobs": logprobs, "return_tokens_as_token_ids": True}
        params = SamplingParams(
            n=n,
            temperature=0,
            max_tokens=max_tokens,
            beam_search=BeamSearch(
                length_penalty=1.0 if penalty is None else penalty, early_stopping=bool(early)
            ),
        )
        for stream in (False, True):
            jobs.append((prompt, params, body, stream, logprobs))
    greedy = {"model": model.name, "prompt": prompts[1], "max_tokens": 10, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as pool:
        futures = [pool.submit(_beam_choices, router, "/v1/completions", j[2], j[3]) for j in jobs]
        plain = pool.submit(_post, router, "/v1/completions", {**greedy, "return_token_ids": True})
        answers = [f.result() for f in futures]
    assert plain.result()["choices"][0]["token_ids"] == hf_greedy(str(model), prompts[1], 10)
    for (prompt, params, _, stream, logprobs), choices in zip(jobs, answers, strict=True):
        expected = hf_beams(str(model), prompt, params, eos)
        assert [c["token_ids"] for c in choices] == expected, (params, stream)
        tokenizer = _tokenizer(model)
        for choice, ids in zip(choices, expected, strict=True):
            assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
            assert choice["finish_reason"] == ("stop" if ids[-1] in eos else "length")
        if logprobs is not None:  # the best beam's: HF's log_softmax along its path
            entries = choices[0]["logprobs"]
            rows = _output_rows(model, prompt, expected[0])
            assert [_token_id(t) for t in entries["tokens"]] == expected[0]
            for pos, token in enumerate(expected[0]):
                assert abs(entries["token_logprobs"][pos] - float(rows[pos, token])) < ATOL
                assert len(entries["top_logprobs"][pos]) in (logprobs, logprobs + 1)
    disaggregated = len(nodes["prefill"].events("request_added")) - before
    assert disaggregated == (2 * len(BEAM_CASES) + 1 if router_name == "pd" else 0)


def test_chat_beam_search_answers_n_beams_of_the_templated_prompt(cluster):
    model, routers, _ = cluster
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = _hf_chat_ids(model, messages, add_generation_prompt=True)
    params = SamplingParams(n=2, temperature=0, max_tokens=7, beam_search=BeamSearch())
    eos = list(ModelConfig.from_path(str(model)).eos_token_ids)
    body = {"model": model.name, "messages": messages, "n": 2, "max_tokens": 7, "use_beam_search": True}
    for router in routers.values():
        for stream in (False, True):
            choices = _beam_choices(router, "/v1/chat/completions", body, stream)
            assert [c["token_ids"] for c in choices] == hf_beams(str(model), ids, params, eos)


@pytest.mark.parametrize("router_name", ["pd", "decode_only"])
def test_cache_salt_keeps_blocks_apart_and_a_repeat_with_the_same_salt_reuses_them(cluster, router_name):
    """vLLM's cache_salt: the same prompt unsalted, then under two salts, never reuses a block (on
    the prefill node, the decode node, or in the router's prefix index), each answer equal to HF;
    the same salt again does, on both nodes of the pair."""
    model, routers, nodes = cluster
    router = routers[router_name]
    prompt = _prompts({"pd": 71, "decode_only": 73}[router_name], [48])[0]  # seen by no other test
    expected = hf_greedy(str(model), prompt, 4)

    def run(salt: str | None, stream: bool = False, prompt: list[int] = prompt) -> tuple[int, list[int]]:
        body = {"model": model.name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        body |= {"return_token_ids": True} | ({} if salt is None else {"cache_salt": salt})
        if stream:
            events = _stream(router, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
            ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
            return events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"], ids
        reply = _post(router, "/v1/completions", body)
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"], reply["choices"][0]["token_ids"]

    adopted = len(nodes["decode"].events("kv_adopted"))
    for salt, stream in ((None, False), ("tenant-a", True), ("tenant-b", False)):
        cached, ids = run(salt, stream)
        assert (cached, ids) == (0, expected), salt
    new = nodes["decode"].events("kv_adopted")[adopted:]
    assert all(e["blocks_reused"] == 0 for e in new)  # the decode node held none of them either
    for stream in (False, True):
        cached, ids = run("tenant-a", stream)
        assert cached >= 32 and ids == expected  # the prompt's full blocks, from the first salted run
    if router_name == "pd":  # the repeats ran on the decode node, from its cache; now a longer
        assert len(new) == 3  # prompt goes through the prefill node, and both reuse the salted blocks
        longer = prompt + _prompts(75, [20])[0]
        cached, ids = run("tenant-a", False, longer)
        assert cached >= 32 and ids == hf_greedy(str(model), longer, 4)
        (last,) = nodes["decode"].events("kv_adopted")[adopted + 3 :]
        assert last["blocks_reused"] > 0


def test_an_empty_or_non_string_cache_salt_is_a_400_naming_it(cluster):
    model, routers, _ = cluster
    for salt in ("", 5):
        body = {"model": model.name, "prompt": "x", "max_tokens": 1, "cache_salt": salt}
        error = _post(routers["pd"], "/v1/completions", body, 400)["error"]
        assert error["param"] == "cache_salt"
