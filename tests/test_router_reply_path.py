"""The router's reply path (nodes push tokens to it) in the shapes a deployment gives it: bound to
every interface, it advertises a host its nodes can reach, not loopback; advertising an address the
nodes cannot reach keeps it unhealthy and answering 503 at once, instead of timing out requests."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

from pdserve.protocol.cluster_key import write_new_key
from tests import web
from tests.cluster import NodeProcess, RedisServer
from tests.test_router_cluster import RouterProcess, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")


def _key(tmp) -> list[str]:
    return ["--cluster-key-file", str(tmp / "cluster.key")]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("reply-path")
    model = tiny_model_with_tokenizer(default_model_dir)
    redis = RedisServer(tmp)
    write_new_key(tmp / "cluster.key")  # a router bound beyond loopback takes none without one
    extra = ["--num-kv-blocks", "64", "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2", *_key(tmp)]
    procs = [NodeProcess(role, str(model), tmp, redis.url, extra) for role in ("prefill", "decode")]
    try:
        for proc in procs:
            proc.wait_ready()
        yield model, redis, tmp
    finally:
        for proc in procs:
            proc.close()
        redis.stop()


def test_a_router_on_every_interface_advertises_its_hostname_and_serves(nodes):
    model, redis, tmp = nodes
    router = RouterProcess(model, redis.url, tmp, "--host", "0.0.0.0", *_key(tmp))
    try:
        router.wait_healthy()
        body = {"model": model.name, "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}
        reply = web.post(router.url + "/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        advertised = re.search(r"nodes push replies to tcp://(\S+):\d+", router.log_path.read_text())
        assert advertised and advertised.group(1) == socket.gethostname() != "127.0.0.1"
    finally:
        router.close()


def test_a_reply_address_the_nodes_cannot_reach_keeps_the_router_unhealthy(nodes):
    model, redis, tmp = nodes
    # Bound on 127.0.0.1, advertised as 127.0.0.3 where nothing listens: like a container's loopback.
    router = RouterProcess(model, redis.url, tmp, "--advertise-host", "127.0.0.3", *_key(tmp))
    try:
        _wait_listening(router)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            health = web.get(router.url + "/health", timeout=2)
            assert health.status_code == 503 and health.json()["num_decode"] == 0
            time.sleep(0.2)
        started = time.monotonic()
        body = {"model": model.name, "prompt": "Hello there", "max_tokens": 4}
        reply = web.post(router.url + "/v1/completions", json=body, timeout=30)
        assert reply.status_code == 503 and time.monotonic() - started < 2
        assert "sent no status back through the reply address tcp://127.0.0.3:" in router.log_path.read_text()
    finally:
        router.close()


def _wait_listening(router, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert router.proc.poll() is None, router.log_path.read_text()
        try:
            web.get(router.url + "/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError("router did not start")
