"""A real node with the automatic thread count gives a torch thread up beside a busy process and
says so where an operator looks: a ``log`` event in its structured log (engine.cpu_share logs at
INFO, which node processes used to drop) and ``pdserve_node_torch_threads`` at the router. Its
answers stay Hugging Face's throughout."""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import time

import httpx
import pytest

from tests import web
from tests.cluster import NodeProcess, RedisServer
from tests.engine_helpers import hf_greedy
from tests.test_cpu_share import busy_neighbour, needs_two_cpus
from tests.test_router_cluster import RouterProcess, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")
THREADS = re.compile(r'^pdserve_node_torch_threads\{node_id="[^"]+",role="decode"\} (\S+)', re.M)


def _threads(router) -> list[float]:
    return [float(v) for v in THREADS.findall(web.get(router.url + "/metrics", timeout=10).text)]


def _healthy(router) -> bool:
    try:
        return web.get(router.url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:  # not listening yet
        return False


@needs_two_cpus
def test_a_node_beside_a_busy_process_drops_a_thread_logs_it_and_exports_it(tmp_path, default_model_dir):
    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)
    redis = RedisServer(tmp_path)
    flags = ["--num-kv-blocks", "512", "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2"]
    node = NodeProcess("decode", str(model), tmp_path, redis.url, flags, threads=None, cpus=cpus)
    router = RouterProcess(model, redis.url, tmp_path, "--disagg-threshold", "100000")
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (30, 120, 75)]
    want = [hf_greedy(str(model), p, 48) for p in prompts]

    def complete(prompt: list[int]) -> list[int]:
        body = {"model": model.name, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        body |= {"logprobs": 0, "return_tokens_as_token_ids": True}
        reply = web.post(router.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return [int(t.removeprefix("token_id:")) for t in reply.json()["choices"][0]["logprobs"]["tokens"]]

    try:
        node.wait_ready()
        deadline = time.monotonic() + 30  # a decode node alone: healthy as "decode_only"
        while not _healthy(router):
            assert time.monotonic() < deadline and router.proc.poll() is None, router.log_path.read_text()
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while _threads(router) != [2.0] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _threads(router) == [2.0]
        with busy_neighbour(min(cpus)), concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            deadline, dropped = time.monotonic() + 60, []
            while not dropped and time.monotonic() < deadline:
                assert list(pool.map(complete, prompts)) == want  # fewer threads: slower, never different
                # the start-up line (logger pdserve.engine) names its threads too: only cpu_share's records
                dropped = [e for e in node.events("log") if e["logger"] == "pdserve.engine.machine.cpu_share"]
            assert dropped, node.log()[-2000:]
            assert (
                dropped[0]["logger"] == "pdserve.engine.machine.cpu_share" and dropped[0]["level"] == "info"
            )
            assert dropped[0]["message"].startswith("engine: 1 torch threads (other processes took")
            deadline = time.monotonic() + 10
            while _threads(router) != [1.0] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _threads(router) == [1.0]
    finally:
        router.close()
        node.close()
        redis.stop()
