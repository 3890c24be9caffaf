"""A prefill node dies or hangs holding requests (2 prefill + 1 decode node, router and node timeouts
at their defaults): the router notices at once when the node's connection drops, else within the
heartbeat TTL, retries every request it held on the surviving prefill node, and each completes
equal to Hugging Face."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import time

import httpx
import pytest

from tests import web
from tests.cluster import NodeProcess, RedisServer, close_all
from tests.engine_helpers import hf_greedy
from tests.test_router_cluster import RouterProcess, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")
HEARTBEAT_TTL_S = 3.0  # the nodes' default
RETRY_RE = re.compile(r"^(\d+\.\d+) WARNING pdserve\.router\.generation: sample \S+: attempt 1 failed", re.M)


@pytest.fixture
def cluster(tmp_path, default_model_dir):
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=2048)
    redis = RedisServer(tmp_path)
    extra = ["--num-kv-blocks", "1024"]
    nodes = [
        NodeProcess(role, str(model), tmp_path, redis.url, extra) for role in ("prefill", "prefill", "decode")
    ]
    router = RouterProcess(model, redis.url, tmp_path)
    try:
        for node in nodes:
            node.wait_ready()
        router.wait_healthy()
        deadline = time.monotonic() + 10
        while web.get(router.url + "/health").json()["num_prefill"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        yield model, router, nodes
    finally:
        close_all(router, nodes, redis)


def _stream_tokens(router, model, prompt: list[int]) -> list[int]:
    body = {
        "model": model.name,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    tokens = []
    with web.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                tokens += [
                    int(t.removeprefix("token_id:")) for t in (choice["logprobs"] or {}).get("tokens", [])
                ]
    return tokens


@pytest.mark.parametrize("fault", ["kill_9", "hang"])
def test_requests_held_by_a_dead_prefill_node_are_retried_at_once_and_complete(cluster, fault):
    model, router, nodes = cluster
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(1500)] for _ in range(4)]
    victim = nodes[0]
    os.kill(victim.proc.pid, signal.SIGSTOP)  # it takes requests into its socket and never answers
    stopped = time.time()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_stream_tokens, router, model, p) for p in prompts]
        time.sleep(1.0)
        killed = time.time()
        if fault == "kill_9":
            victim.kill()
        results = [f.result() for f in futures]
    ended = time.time()
    for prompt, tokens in zip(prompts, results, strict=True):
        assert tokens == hf_greedy(str(model), prompt, 8)
    retries = [float(t) for t in RETRY_RE.findall(router.log_path.read_text())]
    assert retries, "no request went to the stopped node"
    if fault == "kill_9":  # the connection reset says so: well before the heartbeat could expire
        assert max(retries) - killed < 1.0, [round(t - killed, 2) for t in retries]
    else:  # a hung node keeps its connection: its heartbeat expiring says so
        assert max(retries) - stopped < HEARTBEAT_TTL_S + 1.5, [round(t - stopped, 2) for t in retries]
    assert ended - stopped < HEARTBEAT_TTL_S + 8


def test_a_stream_whose_client_leaves_before_its_first_token_is_aborted_at_once(cluster):
    model, router, nodes = cluster
    prefills = nodes[:2]
    for node in prefills:  # whichever takes the request holds it without answering
        os.kill(node.proc.pid, signal.SIGSTOP)
    body = {"model": model.name, "prompt": list(range(1000, 1200)), "max_tokens": 8, "stream": True}  # via P
    with pytest.raises(httpx.ReadTimeout):
        web.post(router.url + "/v1/completions", json=body, timeout=1.5)  # the client gives up
    time.sleep(1.0)  # the router notices the disconnect and sends the aborts
    for node in prefills:
        os.kill(node.proc.pid, signal.SIGCONT)
    time.sleep(2.0)
    added = [e["request_id"] for n in prefills for e in n.events("request_added")]
    aborted = [e["request_id"] for n in prefills for e in n.events("request_aborted")]
    first_tokens = [e["request_id"] for n in prefills for e in n.events("first_token_sent")]
    assert added and added == aborted and not first_tokens
    metrics = web.get(router.url + "/metrics").text
    assert re.findall(r'pdserve_router_inflight_requests\{role="\w+"\} (\d+)', metrics) == ["0", "0"]
