"""Real clients against a real cluster, many requests at once: 1 prefill + 1 decode node (the
session's API-surface nodes) on redis-server, and three routers on the same nodes: one that
disaggregates (the default threshold), one that never does (every request prefills on the decode
node), and one that lets the decode node prefill whenever the prefill node has the longer queue (a
margin of 0 s). Each answer is checked against Hugging Face on the same weights: text, token ids,
logprob values, and the exact number of cached tokens."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import random
import re
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.tokenizer import Tokenizer
from tests import web
from tests.engine_helpers import hf_greedy, hf_logits
from tests.test_router_cluster import RouterProcess, serving

pytestmark = pytest.mark.usefixtures("processes")
BLOCK_SIZE = 16  # the nodes' default


@pytest.fixture(scope="module")
def cluster(api_cluster, tmp_path_factory):
    """The session's API-surface nodes (tests/conftest.py api_cluster: this module's model and node
    flags; its colocated node is on another registry) behind this module's three routers."""
    model, _, shared = api_cluster
    nodes = {role: shared[role] for role in ("prefill", "decode")}
    tmp, redis_url = tmp_path_factory.mktemp("concurrent"), nodes["prefill"].redis_url
    routers = {
        "pd": RouterProcess(model, redis_url, tmp),
        "decode_only": RouterProcess(model, redis_url, tmp, "--disagg-threshold", "100000"),
        "no_margin": RouterProcess(model, redis_url, tmp, "--local-prefill-margin-s", "0"),
    }
    with serving(None, [], routers.values()):  # the session closes the nodes and their Redis
        yield model, routers, nodes


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


def _post(router, path: str, body: dict) -> dict:
    reply = web.post(router.url + path, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _stream(router, path: str, body: dict) -> list[dict]:
    events = []
    with web.stream("POST", router.url + path, json={**body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _completion_logprobs(router, model, prompt: list[int], stream: bool) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs, as the client sees them."""
    body = {
        "model": model.name,
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    if stream:
        parts = [
            e["choices"][0]["logprobs"] for e in _stream(router, "/v1/completions", body) if e["choices"]
        ]
        tokens = [t for p in parts if p for t in p["tokens"]]
        values = [v for p in parts if p for v in p["token_logprobs"]]
    else:
        done = _post(router, "/v1/completions", body)
        assert done["usage"]["completion_tokens"] == 20
        tokens, values = (
            done["choices"][0]["logprobs"]["tokens"],
            done["choices"][0]["logprobs"]["token_logprobs"],
        )
    return [int(t.removeprefix("token_id:")) for t in tokens], values


@functools.cache
def _hf_expected(model: str, prompt: tuple[int, ...]) -> tuple[list[int], list[float]]:
    ids = hf_greedy(model, list(prompt), 20)
    logits = hf_logits(model, [*prompt, *ids])[len(prompt) - 1 : -1]  # [20, vocab]: the ones that chose ids
    logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(20), torch.tensor(ids)]
    return ids, logprobs.tolist()


@pytest.mark.parametrize("path", ["pd", "decode_only"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_concurrent_completions_return_every_logprob_equal_to_hf(cluster, path, stream):
    model, routers, _ = cluster
    lengths = [80, 700, 150, 333, 96, 512, 260, 81]
    prompts = _prompts(len(path) * 2 + stream, lengths)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _completion_logprobs(routers[path], model, p, stream), prompts))
    for prompt, (ids, values) in zip(prompts, got, strict=True):
        want_ids, want_values = _hf_expected(str(model), tuple(prompt))
        assert ids == want_ids, len(prompt)
        assert values == pytest.approx(want_values, abs=2e-3), len(prompt)


def _cached(router, model, prompt: list[int]) -> int:
    body = {
        "model": model.name,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
        "logprobs": 0,
    }
    done = _post(router, "/v1/completions", body)
    ids = [int(t.removeprefix("token_id:")) for t in done["choices"][0]["logprobs"]["tokens"]]
    assert ids == hf_greedy(str(model), prompt, 4)  # a reused prefix must not change the output
    return done["usage"]["prompt_tokens_details"]["cached_tokens"]


def _full_blocks(num_tokens: int) -> int:
    """Tokens a prefix hit can cover: whole blocks, never the last prompt token (it must run)."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_burst_behind_the_prefill_node_is_shared_with_the_decode_node_and_still_equals_hf(cluster, stream):
    model, routers, nodes = cluster
    router = routers["no_margin"]
    (warm,) = _prompts(20 + stream, [120])
    assert _completion_logprobs(router, model, warm, stream)[0] == _hf_expected(str(model), tuple(warm))[0]
    time.sleep(
        1.5
    )  # a heartbeat (0.2 s) carries the prefill node's measured speed; the router polls at 0.5 s

    def local_prefills() -> int:
        return sum(1 for e in nodes["decode"].events("request_finished") if e.get("local_prefill"))

    def routed(placement: str) -> int:
        metrics = web.get(router.url + "/metrics", timeout=10).text
        found = re.search(rf'^pdserve_routes_total{{prefill="{placement}"}} (\d+)', metrics, re.M)
        return int(found.group(1)) if found else 0

    before, backed_up, remote = local_prefills(), routed("backed_up"), routed("prefill_node")
    prompts = _prompts(30 + stream, [300, 280, 320, 260, 310, 290, 270, 330])
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _completion_logprobs(router, model, p, stream), prompts))
    for prompt, (ids, values) in zip(prompts, got, strict=True):
        want_ids, want_values = _hf_expected(str(model), tuple(prompt))
        assert ids == want_ids, len(prompt)
        assert values == pytest.approx(want_values, abs=2e-3), len(prompt)
    # Sent at once, each prompt goes to whichever queue is shorter, the ones sent before it counted:
    # some to each node.
    num_local = local_prefills() - before
    assert 1 <= num_local <= len(prompts) - 1
    assert routed("backed_up") - backed_up == num_local  # the router counts why
    assert routed("prefill_node") - remote == len(prompts) - num_local


def test_a_repeated_prompt_is_a_counted_prefix_hit_on_the_decode_node(cluster):
    model, routers, nodes = cluster
    (prompt,) = _prompts(7, [301])
    assert _cached(routers["pd"], model, prompt) == 0  # through the prefill node: nothing cached yet
    assert _cached(routers["pd"], model, prompt) == _full_blocks(301)  # the decode node now holds it
    changed = [*prompt[:-1], prompt[-1] + 1]
    assert _cached(routers["pd"], model, changed) == _full_blocks(301)
    local = [e for e in nodes["decode"].events("request_finished") if e.get("local_prefill")]
    assert [e["cached_tokens"] for e in local[-2:]] == [_full_blocks(301)] * 2


def test_prefill_node_hit_counts_its_cached_tokens(cluster):
    model, routers, _ = cluster
    (first,) = _prompts(8, [200])
    (suffix,) = _prompts(9, [220])
    assert _cached(routers["pd"], model, first) == 0
    extended = first[:100] + suffix  # 96 tokens (6 blocks) shared; 224 new: prefilled on the prefill node
    assert _cached(routers["pd"], model, extended) == 96


def test_chats_sharing_a_system_prompt_count_the_shared_blocks(cluster):
    model, routers, _ = cluster
    tokenizer = Tokenizer(model)
    system = (
        "You are a meticulous assistant for a shipping company. Answer in short, factual sentences, "
        "quote tracking numbers exactly, never invent delivery dates, and ask for the order number "
        "when it is missing. Prefer metric units. Keep a polite, neutral tone in every reply. If a "
        "customer is upset, acknowledge it once and move on to the facts. Do not promise refunds; "
        "explain that the claims team decides them within five working days of a complete claim."
    )
    questions = [
        "Where is my parcel?",
        "Can I change the delivery address?",
        "How heavy can a box be?",
        "Do you ship to Norway?",
    ]
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions
    ]
    ids = [tokenizer.encode_chat(c) for c in conversations]
    num_shared = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1], strict=False)) if a != b)
    assert num_shared > 64  # long enough to make the router keep the later ones on the decode node
    cached = []
    for messages in conversations:
        body = {
            "model": model.name,
            "messages": messages,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        }
        cached.append(
            _post(routers["pd"], "/v1/chat/completions", body)["usage"]["prompt_tokens_details"][
                "cached_tokens"
            ]
        )
    assert cached == [0] + [num_shared // BLOCK_SIZE * BLOCK_SIZE] * 3


def test_a_seeded_sample_is_the_same_offline_through_prefill_and_decode_and_decode_only(cluster):
    from pdserve.engine import LLM, SamplingParams

    model, routers, _ = cluster
    prompts = _prompts(11, [90, 200, 130])
    params = {
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 1234,
        "max_tokens": 12,
        "ignore_eos": True,
    }
    llm = LLM(model=str(model), num_kv_blocks=128)
    offline = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**params))]

    def served(args):
        path, prompt = args
        body = {
            "model": model.name,
            "prompt": prompt,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **params,
        }
        tokens = _post(routers[path], "/v1/completions", body)["choices"][0]["logprobs"]["tokens"]
        return [int(t.removeprefix("token_id:")) for t in tokens]

    jobs = [(path, p) for path in ("pd", "decode_only") for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(served, jobs))
    assert got == offline + offline
    assert len({tuple(t) for t in offline}) == 3


def _node_tokens(router) -> dict[tuple[str, str], float]:
    """(role, phase) -> tokens the nodes' engine steps computed, from the router's /metrics."""
    metrics = web.get(router.url + "/metrics", timeout=10).text
    totals: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(metrics):
        for s in family.samples if family.name == "pdserve_node_engine_tokens" else ():
            key = s.labels["role"], s.labels["phase"]
            totals[key] = totals.get(key, 0.0) + s.value
    return totals


def test_node_step_metrics_count_every_token_of_concurrent_requests_on_both_paths(cluster):
    model, routers, _ = cluster
    router = routers["decode_only"]
    jobs = [("pd", p, 9) for p in _prompts(41, [70, 210, 150])] + [
        ("decode_only", p, 13) for p in _prompts(42, [90, 300, 40, 120])
    ]

    def run(job):
        path, prompt, n = job
        body = {"model": model.name, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        if path == "pd":  # streamed through one path, whole through the other
            events = _stream(routers[path], "/v1/completions", body)
            return sum(1 for e in events if e["choices"] and e["choices"][0]["text"] is not None)
        return _post(routers[path], "/v1/completions", body)["usage"]["completion_tokens"]

    before = _node_tokens(router)
    for _ in range(10):  # earlier tests' last steps reach the router a heartbeat and a poll late
        time.sleep(1.0)
        if (now := _node_tokens(router)) == before:
            break
        before = now
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        assert list(pool.map(run, jobs))[3:] == [13] * 4
    want_prompt = sum(len(p) for _, p, _ in jobs)  # fresh prompts: no prefix hit
    want_decode = sum(n - 1 for _, _, n in jobs)  # the first token comes with the prompt's last row
    deadline, got = time.monotonic() + 10, {}
    while time.monotonic() < deadline:  # the counts reach the router with the nodes' heartbeats
        now = _node_tokens(router)
        got = {key: now.get(key, 0.0) - before.get(key, 0.0) for key in now}
        prompt = got.get(("prefill", "prompt"), 0) + got.get(("decode", "prompt"), 0)
        if prompt >= want_prompt and got.get(("decode", "decode"), 0) >= want_decode:
            break
        time.sleep(0.2)
    assert got.get(("prefill", "decode"), 0) == 0  # a prefill node stops at the first token
    assert got.get(("decode", "decode"), 0) == want_decode
    assert got.get(("prefill", "prompt"), 0) + got.get(("decode", "prompt"), 0) == want_prompt
    assert got.get(("decode", "prompt"), 0) >= sum(len(p) for path, p, _ in jobs if path == "decode_only")
