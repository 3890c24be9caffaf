"""A decode node that starts draining while requests routed to it still sit on the prefill node:
it refuses their KV, and since the prefill node reports a first token only once blocks are granted,
the router retries each on the other decode node and none is lost (the compose scale-down case)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import pytest

from tests import web
from tests.cluster import Client, NodeProcess, RedisServer, close_all
from tests.engine_helpers import hf_greedy
from tests.test_router_cluster import RouterProcess, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")


def _stream(router, model, prompt: list[int]) -> tuple[list[int], list[dict]]:
    """A streamed completion's token ids and the error events it ended with, if any."""
    body = {
        "model": model.name,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": True,
    }
    tokens, errors = [], []
    with web.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                    continue
                logprobs = event["choices"][0]["logprobs"] or {}
                tokens += [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens", [])]
    return tokens, errors


def test_requests_refused_by_a_draining_decode_node_are_retried_on_another(tmp_path, default_model_dir):
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=2048)
    redis = RedisServer(tmp_path)
    beat = ["--heartbeat-interval", "0.2", "--heartbeat-ttl", "2"]
    prefill = NodeProcess("prefill", str(model), tmp_path, redis.url, ["--num-kv-blocks", "256", *beat])
    draining = NodeProcess("decode", str(model), tmp_path, redis.url, ["--num-kv-blocks", "512", *beat])
    other = NodeProcess("decode", str(model), tmp_path, redis.url, ["--num-kv-blocks", "128", *beat])
    router = RouterProcess(model, redis.url, tmp_path)
    client = Client()
    try:
        for node in (prefill, draining, other):
            node.wait_ready()
        router.wait_healthy()
        while web.get(router.url + "/health").json()["num_decode"] < 2:
            time.sleep(0.1)
        # Keeps the draining node alive (and refusing) for a few seconds after SIGTERM.
        client.generate(
            draining.addrs,
            "long",
            list(range(5, 40)),
            {"temperature": 0, "max_tokens": 1900, "ignore_eos": True},
        )
        os.kill(prefill.proc.pid, signal.SIGSTOP)  # the requests wait on the prefill node
        prompts = [[100 + i, *range(200, 300)] for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(_stream, router, model, p) for p in prompts]
            time.sleep(0.5)
            draining.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # it publishes draining; the router takes no new requests there
            os.kill(prefill.proc.pid, signal.SIGCONT)
            streams = [f.result() for f in futures]
        for prompt, (tokens, errors) in zip(prompts, streams, strict=True):
            assert not errors and tokens == hf_greedy(str(model), prompt, 8), errors
        refused = [e for e in prefill.events("request_failed") if e.get("code") == "decode_rejected"]
        assert refused, "no request was routed to the draining node in time"
        assert client.collect(["long"])["long"]["finish"] == "length"  # its in-flight work finished
        assert draining.proc.wait(30) == 0
    finally:
        client.close()
        close_all(router, [prefill, draining, other], redis)
