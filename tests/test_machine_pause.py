"""The whole machine pauses (every node stopped at once, longer than the heartbeat TTL: a VM
paused or migrated, after which the wall clock steps and Redis expires every record): the nodes'
records lapse, the router drops them all, and the samples under way wait for them to come back
instead of failing with 503 "no usable decode node". 1 prefill + 1 decode node, their heartbeat
and the router's expiry at the defaults; concurrent, mixed lengths, streamed and not, with
logprobs; every sample equal to Hugging Face and no block held after."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import time

import pytest

from tests import web
from tests.cluster import NodeProcess, RedisServer, close_all
from tests.engine_helpers import hf_greedy
from tests.test_router_cluster import RouterProcess, tiny_model_with_tokenizer, wait_blocks_freed

pytestmark = pytest.mark.usefixtures("processes")
PAUSE_S = 4.5  # past the nodes' default heartbeat TTL (3 s) and a router poll


@pytest.fixture
def cluster(tmp_path, default_model_dir):
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=2048)
    redis = RedisServer(tmp_path)
    nodes = [NodeProcess(role, str(model), tmp_path, redis.url) for role in ("prefill", "decode")]
    router = RouterProcess(model, redis.url, tmp_path, "--disagg-threshold", "8")
    try:
        for node in nodes:
            node.wait_ready()
        router.wait_healthy()
        yield model, router, nodes
    finally:
        close_all(router, nodes, redis)


def sample_tokens(url: str, model: str, prompt: list[int], max_tokens: int, stream: bool) -> list[int]:
    """The sample's token ids (from its logprobs), streamed or whole; asserts a 200."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    if not stream:
        reply = web.post(url + "/v1/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        found = reply.json()["choices"][0]["logprobs"]["tokens"]
        return [int(t.removeprefix("token_id:")) for t in found]
    tokens = []
    with web.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                found = (event["choices"][0]["logprobs"] or {}).get("tokens", [])
                tokens += [int(t.removeprefix("token_id:")) for t in found]
    return tokens


def test_samples_under_way_when_every_node_pauses_past_its_ttl_complete_exact(cluster):
    model, router, nodes = cluster
    rng = random.Random(11)
    work = [  # (prompt, max_tokens, streamed): long enough to be under way through the pause
        (
            [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 300))],
            rng.randrange(150, 350),
            i % 2 == 0,
        )
        for i in range(8)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
        futures = [pool.submit(sample_tokens, router.url, model.name, *w) for w in work[:6]]
        time.sleep(0.5)  # the first six are decoding
        for node in nodes:
            os.kill(node.proc.pid, signal.SIGSTOP)
        futures += [
            pool.submit(sample_tokens, router.url, model.name, *w) for w in work[6:]
        ]  # sent to paused nodes
        time.sleep(PAUSE_S)
        for node in nodes:
            os.kill(node.proc.pid, signal.SIGCONT)
        results = [f.result() for f in futures]
    resumed_at = time.time()
    for (prompt, max_tokens, _), tokens in zip(work, results, strict=True):
        assert tokens == hf_greedy(str(model), prompt, max_tokens)
    log = router.log_path.read_text()
    assert "left the registry" in log or "went away mid-stream" in log, log[-4000:]
    scraped = web.get(router.url + "/metrics", timeout=10).text
    found = re.search(r'^pdserve_node_waits_total\{outcome="found"\} (\S+)$', scraped, re.M)
    assert found and float(found[1]) >= 1, scraped  # samples waited for the nodes, and found them
    assert 'pdserve_node_waits_total{outcome="gave_up"} 0.0' in scraped
    used = wait_blocks_freed(router, after=resumed_at)
    assert len(used) == 2 and not any(used.values()), used
