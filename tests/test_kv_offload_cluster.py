"""The KV offload tier through real processes: nodes with small pools and a folder each. A prefix
evicted from a pool comes back from the folder (usage reports the cached tokens, the output is
HF's) on a colocated node and across prefill and decode nodes, concurrently, streamed and not;
and after the whole cluster restarts on the same folders, it is still served."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import pytest

from tests import web
from tests.cluster import NodeProcess, RedisServer
from tests.engine_helpers import hf_greedy
from tests.test_router_cluster import RouterProcess, serving, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")

LOADED = re.compile(
    r'^pdserve_node_kv_offload_loaded_blocks_total\{node_id="([^"]+)",role="(\w+)"\} (\S+)', re.M
)
STORED = re.compile(
    r'^pdserve_node_kv_offload_stored_blocks_total\{node_id="([^"]+)",role="(\w+)"\} (\S+)', re.M
)
# 32 blocks of 16 tokens a node: one 200-token prompt and its output take 14 of them
NODE_ARGS = ["--num-kv-blocks", "32", "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2"]
MAX_TOKENS = 8


def _prompt(seed: int, n: int = 200) -> list[int]:
    return [(seed * 131 + 37 * i) % 30000 + 100 for i in range(n)]


def _start(model, tmp, redis, folders) -> tuple[dict, dict]:
    second = redis.url.removesuffix("/0") + "/1"  # the colocated node's own registry
    nodes = {
        "prefill": NodeProcess(
            "prefill", str(model), tmp, redis.url, [*NODE_ARGS, "--kv-offload-dir", str(folders / "p")]
        ),
        "decode": NodeProcess(
            "decode", str(model), tmp, redis.url, [*NODE_ARGS, "--kv-offload-dir", str(folders / "d")]
        ),
        "colocated": NodeProcess(
            "decode",
            str(model),
            tmp,
            second,
            [*NODE_ARGS, "--colocated", "--kv-offload-dir", str(folders / "c")],
        ),
    }
    routers = {
        "pd": RouterProcess(
            model, redis.url, tmp, "--disagg-threshold", "8", "--local-prefill-margin-s", "-1"
        ),
        "colocated": RouterProcess(model, second, tmp),
    }
    for router in routers.values():
        router.served_name = model.name  # the model id clients name: the folder's
    return nodes, routers


def _complete(router, prompt: list[int], stream: bool) -> tuple[list[int], int]:
    """The output's token ids and the usage's cached prompt tokens."""
    body = {
        "model": router.served_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }
    url = router.url + "/v1/completions"
    tokens, usage = [], {}
    if not stream:
        body.pop("stream_options")
        reply = web.post(url, json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        tokens, usage = reply.json()["choices"][0]["logprobs"]["tokens"], reply.json()["usage"]
    else:
        with web.stream("POST", url, json=body, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    choice = (chunk["choices"] or [{}])[0]
                    tokens += (choice.get("logprobs") or {}).get("tokens", [])
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return [int(t.removeprefix("token_id:")) for t in tokens], cached


def _counts(router, pattern) -> dict[str, float]:
    text = web.get(router.url + "/metrics", timeout=10).text
    return {role: float(v) for _, role, v in pattern.findall(text)}


def _wait_stored(router, roles, minimum: int) -> None:
    """Until each node of ``roles`` has written ``minimum`` blocks (a node idles, then writes)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stored = _counts(router, STORED)
        if all(stored.get(role, 0) >= minimum for role in roles):
            return
        time.sleep(0.2)
    raise AssertionError(f"stored blocks {stored} never reached {minimum}")


def _wait_loaded(router, minimum: int) -> None:
    """Until the router's nodes have read ``minimum`` blocks from their folders, together: on the
    prefill→decode path the router may place a prompt whose prefix a decode node's folder holds
    on that node (prefilled there), so either node may be the one that reads. The counts come
    with the node records, a heartbeat late."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        loaded = _counts(router, LOADED)
        if sum(loaded.values()) >= minimum:
            return
        time.sleep(0.2)
    raise AssertionError(f"loaded blocks {loaded} never reached {minimum}")


def test_an_evicted_prefix_is_served_from_the_folder_then_after_a_restart(tmp_path, default_model_dir):
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)
    folders = tmp_path / "tiers"
    kept = {path: _prompt(seed) for path, seed in (("pd", 1), ("colocated", 2))}
    want = {path: hf_greedy(str(model), prompt, MAX_TOKENS) for path, prompt in kept.items()}
    redis = RedisServer(tmp_path)
    nodes, routers = _start(model, tmp_path, redis, folders)
    with serving(redis, nodes.values(), routers.values()):
        for path, prompt in kept.items():
            assert _complete(routers[path], prompt, stream=False) == (want[path], 0)
        # three more prompts on each path, concurrently, streamed and not: they evict the first
        # from every pool
        others = [(path, _prompt(seed), seed % 2 == 0) for path in kept for seed in (11, 12, 13)]
        with concurrent.futures.ThreadPoolExecutor(len(others)) as pool:
            got = list(pool.map(lambda job: _complete(routers[job[0]], job[1], job[2])[0], others))
        assert got == [hf_greedy(str(model), prompt, MAX_TOKENS) for _, prompt, _ in others]
        _wait_stored(routers["pd"], ("prefill", "decode"), 48)
        _wait_stored(routers["colocated"], ("colocated",), 48)
        # the first prompts again, concurrently, one streamed: from the folders, not recomputed
        jobs = [("pd", True), ("colocated", False)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            again = list(pool.map(lambda j: _complete(routers[j[0]], kept[j[0]], j[1]), jobs))
        for (path, _), (tokens, cached) in zip(jobs, again, strict=True):
            assert tokens == want[path], path
            assert cached >= 176, (path, cached)  # 11 blocks of 16: all but the last token's block
        _wait_loaded(routers["pd"], 11)
        _wait_loaded(routers["colocated"], 11)
    # the whole cluster (Redis too) stops, its nodes killed, and starts again on the same folders
    redis = RedisServer(tmp_path)
    nodes, routers = _start(model, tmp_path, redis, folders)
    with serving(redis, nodes.values(), routers.values()):
        for path, prompt in kept.items():
            tokens, cached = _complete(routers[path], prompt, stream=path == "pd")
            assert tokens == want[path] and cached >= 176, (path, cached)
