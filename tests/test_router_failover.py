"""Router failover against real nodes: kill -9 a prefill node with requests in flight (they finish
on the other one), kill -9 the decode node mid-stream (the client gets an error event, no hang)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from tests import web
from tests.cluster import NodeProcess, RedisServer
from tests.test_router_cluster import LONG_PROMPT, RouterProcess, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("router-failover")
    model = tiny_model_with_tokenizer(default_model_dir)
    redis = RedisServer(tmp)
    extra = ["--num-kv-blocks", "256", "--heartbeat-interval", "0.2", "--heartbeat-ttl", "1"]
    nodes = [
        NodeProcess(role, str(model), tmp, redis.url, extra) for role in ("prefill", "prefill", "decode")
    ]
    router = RouterProcess(
        model, redis.url, tmp, "--disagg-threshold", "4", "--chunk-timeout-s", "5", "--node-expiry-s", "1.5"
    )
    try:
        for node in nodes:
            node.wait_ready()
        router.wait_healthy()
        deadline = time.monotonic() + 10  # both prefill nodes registered with the router
        while web.get(router.url + "/health").json()["num_prefill"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        yield model, router, nodes
    finally:
        router.close()
        for node in nodes:
            node.close()
        redis.stop()


def _complete(router, model, i: int) -> httpx.Response:
    body = {
        "model": model.name,
        "prompt": f"{i}: {LONG_PROMPT}",
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    return web.post(router.url + "/v1/completions", json=body, timeout=60)


def test_requests_survive_kill_9_of_a_prefill_node(cluster):
    model, router, nodes = cluster
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_complete, router, model, i) for i in range(8)]
        time.sleep(0.1)
        nodes[0].kill()
        replies = [f.result() for f in futures]
    assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in replies)
    assert _complete(router, model, 99).status_code == 200  # and new ones keep working


def test_kill_9_of_the_decode_node_mid_stream_ends_with_an_error_event(cluster):
    model, router, nodes = cluster
    body = {"model": model.name, "prompt": LONG_PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    lines = []
    started = time.monotonic()
    with web.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 3:
                    nodes[2].kill()
    assert time.monotonic() - started < 20
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] in ("node_lost", "timeout") and error["type"] in ("bad_gateway", "timeout")
