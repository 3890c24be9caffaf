"""Real node processes commit their KV pool while idle (``--kv-commit idle``, the default) and
serve exactly while they do: a prefill node and a decode node with 512 MiB pools (seconds to
commit on the dev VM), a lazy decode node beside them, a real Redis and two routers."""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import time

import pytest

from tests import web
from tests.cluster import NodeProcess, RedisServer
from tests.engine_helpers import hf_greedy
from tests.test_router_cluster import RouterProcess, serving, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")
POOL_MB = 512
COMMITTED = re.compile(r'^pdserve_node_kv_blocks_committed\{node_id="([^"]+)",role="(\w+)"\} (\S+)', re.M)
THREADS = re.compile(r'^pdserve_node_torch_threads\{node_id="([^"]+)",role="(\w+)"\} (\S+)', re.M)
TOTAL = re.compile(r'^pdserve_node_kv_blocks_total\{node_id="([^"]+)",role="(\w+)"\} (\S+)', re.M)


def _blocks(router) -> dict[str, tuple[float, float]]:
    """node id -> (committed, total) KV blocks, from the router's /metrics."""
    text = web.get(router.url + "/metrics", timeout=10).text
    total = {node: float(v) for node, _, v in TOTAL.findall(text)}
    return {node: (float(v), total[node]) for node, _, v in COMMITTED.findall(text)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("idle_commit")
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)
    redis = RedisServer(tmp)
    common = ["--kv-cache-memory-mb", str(POOL_MB), "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2"]
    nodes = {
        "prefill": NodeProcess("prefill", str(model), tmp, redis.url, common),
        "decode": NodeProcess("decode", str(model), tmp, redis.url, common),
        "lazy": NodeProcess("decode", str(model), tmp, redis.url, [*common, "--kv-commit", "lazy"]),
    }
    routers = {
        "pd": RouterProcess(model, redis.url, tmp),
        "decode_only": RouterProcess(model, redis.url, tmp, "--disagg-threshold", "100000"),
    }
    with serving(redis, nodes.values(), routers.values()):
        yield model, routers, nodes


def test_requests_during_the_idle_commit_equal_hf_and_idle_pools_end_fully_committed(cluster):
    model, routers, nodes = cluster
    rng = random.Random(7)
    jobs = [
        (path, [rng.randrange(100, 40000) for _ in range(n)], stream)
        for path, n, stream in [
            ("pd", 150, True),
            ("pd", 40, False),
            ("pd", 260, True),
            ("decode_only", 90, False),
            ("decode_only", 310, True),
            ("decode_only", 20, False),
        ]
    ]

    def run(job) -> list[int]:
        path, prompt, stream = job
        body = {
            "model": model.name,
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "stream": stream,
        }
        url = routers[path].url + "/v1/completions"
        if not stream:
            reply = web.post(url, json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
        else:
            tokens = []
            with web.stream("POST", url, json=body, timeout=120) as reply:
                assert reply.status_code == 200, reply.read()
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        choice = (json.loads(line[6:])["choices"] or [{}])[0]
                        tokens += (choice.get("logprobs") or {}).get("tokens", [])
        return [int(t.removeprefix("token_id:")) for t in tokens]

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    assert got == [hf_greedy(str(model), prompt, 12) for _, prompt, _ in jobs]

    deadline, blocks = time.monotonic() + 120, {}
    while time.monotonic() < deadline:
        blocks = _blocks(routers["pd"])
        idle = [blocks.get(node.addrs["node_id"]) for name, node in nodes.items() if name != "lazy"]
        if all(b is not None and b[0] == b[1] for b in idle):
            break
        time.sleep(0.5)
    for name, node in nodes.items():
        committed, total = blocks[node.addrs["node_id"]]
        if name == "lazy":  # what it wrote and one block a sequence ahead: a small part of the pool
            assert committed < total / 4, (committed, total)
        else:
            assert committed == total, (name, committed, total)
    text = web.get(routers["pd"].url + "/metrics", timeout=10).text
    threads = {node: float(v) for node, _, v in THREADS.findall(text)}
    assert threads == {node.addrs["node_id"]: 1.0 for node in nodes.values()}  # NodeProcess's --threads 1
