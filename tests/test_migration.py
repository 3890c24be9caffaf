"""Mid-stream migration through real processes: kill -9 a decode node while eight concurrent
samples (streamed and whole, greedy and seeded, logprobs on and off, P→D and decode-only) are
mid-output. Every one completes with exactly the text and tokens of an undisturbed run, each token
once, and the greedy ones equal Hugging Face."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import pytest

from tests import web
from tests.cluster import NodeProcess, RedisServer, close_all
from tests.engine_helpers import hf_greedy
from tests.test_router_cluster import RouterProcess, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")
MAX_TOKENS = 160
RUNNING_RE = re.compile(r'pdserve_node_running_requests\{node_id="([^"]+)",role="decode"\} (\d+)')


@pytest.fixture
def cluster(tmp_path, default_model_dir):
    model = tiny_model_with_tokenizer(default_model_dir)
    redis = RedisServer(tmp_path)
    extra = ["--num-kv-blocks", "512"]
    nodes = [
        NodeProcess(role, str(model), tmp_path, redis.url, extra) for role in ("prefill", "decode", "decode")
    ]
    router = RouterProcess(model, redis.url, tmp_path, "--disagg-threshold", "32")
    try:
        infos = [node.wait_ready() for node in nodes]
        router.wait_healthy()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            health = web.get(router.url + "/health").json()
            if health["num_prefill"] == 1 and health["num_decode"] == 2:
                break
            time.sleep(0.1)
        yield model, router, nodes, infos
    finally:
        close_all(router, nodes, redis)


def _requests(model) -> list[dict]:
    bodies = []
    for i, length in enumerate((12, 90, 20, 150, 40, 70, 16, 120)):  # under and over the P→D threshold
        prompt = [(31 * i + 7 * k) % 4000 + 100 for k in range(length)]
        body = {
            "model": model.name,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": i % 2 == 0,
        }
        body.update({"temperature": 0} if i % 4 < 2 else {"temperature": 0.9, "seed": 1000 + i})
        if i % 3 != 2:
            body.update({"logprobs": 0, "return_tokens_as_token_ids": True})
        bodies.append(body)
    return bodies


def _run(router, body: dict, progress: dict, key: int) -> dict:
    """Text, token ids (when logprobs were asked for) and usage of one request."""
    if not body["stream"]:
        reply = web.post(router.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        ids = [int(t.removeprefix("token_id:")) for t in (choice["logprobs"] or {}).get("tokens", [])]
        return {"text": choice["text"], "ids": ids, "usage": reply.json()["usage"]["completion_tokens"]}
    text, ids, usage = "", [], None
    stream_body = {**body, "stream_options": {"include_usage": True}}
    with web.stream("POST", router.url + "/v1/completions", json=stream_body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += choice["text"]
                ids += [
                    int(t.removeprefix("token_id:")) for t in (choice["logprobs"] or {}).get("tokens", [])
                ]
            progress[key] = progress.get(key, 0) + 1
    return {"text": text, "ids": ids, "usage": usage}


def _run_all(router, bodies, progress) -> list[concurrent.futures.Future]:
    pool = concurrent.futures.ThreadPoolExecutor(len(bodies))
    futures = [pool.submit(_run, router, body, progress, i) for i, body in enumerate(bodies)]
    pool.shutdown(wait=False)
    return futures


def test_killing_a_decode_node_mid_output_loses_nothing(cluster):
    model, router, nodes, infos = cluster
    bodies = _requests(model)
    undisturbed = [f.result(timeout=180) for f in _run_all(router, bodies, {})]

    progress: dict[int, int] = {}
    futures = _run_all(router, bodies, progress)
    streamed = [i for i, b in enumerate(bodies) if b["stream"]]
    deadline = time.monotonic() + 60
    while not all(progress.get(i, 0) >= 3 for i in streamed) and time.monotonic() < deadline:
        time.sleep(0.01)
    running = dict(
        (node_id, int(n)) for node_id, n in RUNNING_RE.findall(web.get(router.url + "/metrics").text)
    )
    victim = max((1, 2), key=lambda k: running.get(infos[k]["node_id"], 0))
    nodes[victim].kill()
    disturbed = [f.result(timeout=180) for f in futures]

    for i, (want, got) in enumerate(zip(undisturbed, disturbed, strict=True)):
        assert got["text"] == want["text"], f"request {i} differs after the kill"
        assert got["ids"] == want["ids"]
        if "logprobs" in bodies[i]:
            assert len(got["ids"]) == MAX_TOKENS  # each token once: none lost, none repeated
        if got["usage"] is not None:
            assert got["usage"] == MAX_TOKENS
    metrics = web.get(router.url + "/metrics").text
    migrations = int(re.search(r"^pdserve_migrations_total (\d+)", metrics, re.M).group(1))
    assert migrations >= 1, "no sample was on the killed node mid-output"
    for i in (0, 1):  # greedy, with logprobs: the oracle
        assert disturbed[i]["ids"] == hf_greedy(model, bodies[i]["prompt"], MAX_TOKENS)
    survivor = nodes[3 - victim]
    assert survivor.events("request_added")  # it took the migrated samples (local prefill, resumed)
    assert any(e.get("resumed_tokens", 0) > 0 for e in survivor.events("request_added"))
