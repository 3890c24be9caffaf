"""A node of another protocol version beside a router: each side refuses the other by name, in
registry mode (its record) and in static mode (its messages), and the cluster serves on without it.
The old node is a real node process whose codec speaks protocol 4, as one of that release does."""

from __future__ import annotations

import subprocess
import time

import pytest

from pdserve.launcher.commands import pdserve_argv
from pdserve.launcher.ports import free_port
from pdserve.protocol.codec import PROTOCOL_VERSION
from tests import web
from tests.cluster import ROOT, NodeProcess, RedisServer, close_all
from tests.test_router_cluster import RouterProcess, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")
OLD = PROTOCOL_VERSION - 1


@pytest.fixture
def old_protocol(tmp_path):
    """A folder whose sitecustomize makes a process speak protocol ``OLD``."""
    folder = tmp_path / f"protocol-{OLD}"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        f"import pdserve.protocol.codec as codec\ncodec.PROTOCOL_VERSION = {OLD}\n"
    )
    return str(folder)


def _wait_for(read, text: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (log := read()):
        assert time.monotonic() < deadline, f"{text!r} not in:\n{log[-3000:]}"
        time.sleep(0.1)
    return log


def test_a_router_refuses_a_node_of_another_version_by_name_and_serves_on(
    tmp_path, default_model_dir, old_protocol
):
    model = tiny_model_with_tokenizer(default_model_dir)
    redis = RedisServer(tmp_path)
    nodes = [NodeProcess(role, str(model), tmp_path, redis.url) for role in ("prefill", "decode")]
    old = NodeProcess("decode", str(model), tmp_path, redis.url, pythonpath=(old_protocol,))
    router = RouterProcess(model, redis.url, tmp_path)
    try:
        for node in (*nodes, old):
            node.wait_ready()
        router.wait_healthy()
        old_id = old.addrs["node_id"]
        _wait_for(
            router.log_path.read_text,
            f"registry record from node {old_id} speaks pdserve protocol {OLD}; this process speaks "
            f"protocol {PROTOCOL_VERSION}",
        )
        health = web.get(router.url + "/health", timeout=5).json()
        assert health["num_decode"] == 1 and health["num_prefill"] == 1
        body = {"model": model.name, "prompt": "one two three", "max_tokens": 4, "temperature": 0}
        reply = web.post(router.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        close_all(router, [*nodes, old], redis)


def test_in_static_mode_the_node_and_the_router_each_name_the_version_they_refuse(
    tmp_path, default_model_dir, old_protocol
):
    model = tiny_model_with_tokenizer(default_model_dir)
    old = NodeProcess("decode", str(model), tmp_path, pythonpath=(old_protocol,))
    log_path = tmp_path / "static-router.log"
    try:
        addrs = old.wait_ready()
        argv = pdserve_argv(
            "router", "--model", str(model), "--port", str(free_port()), "--decode", addrs["control_addr"]
        )
        with open(log_path, "w") as log:
            router = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            # the router's status query reaches the old node, which names the router's version...
            _wait_for(
                old.log,
                f"from a peer speaks pdserve protocol {PROTOCOL_VERSION}; this process speaks protocol {OLD}",
            )
            # ...and answers in its own, which the router refuses naming the node
            _wait_for(
                log_path.read_text,
                f"from node {addrs['node_id']} speaks pdserve protocol {OLD}; this process speaks protocol "
                f"{PROTOCOL_VERSION}",
            )
        finally:
            router.terminate()
            router.wait(10)
    finally:
        old.close()
