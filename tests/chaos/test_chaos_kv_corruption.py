"""KV bytes corrupted on the way (the prefill node's sender flips a checksum bit of every third
transfer: PDSERVE_FAULT_CORRUPT_KV_EVERY, a test-only fault hook) under the steady mixed load: the
decode node's check catches each one, frees the blocks and stays in the pool; a request the client
has seen nothing of is retried, one that has tokens migrates, and each completes equal to Hugging
Face: never a wrong token."""

from __future__ import annotations

import os
import re

import pytest

from tests import web
from tests.chaos.harness import Cluster
from tests.chaos.test_chaos_node_faults import run_fault

pytestmark = pytest.mark.usefixtures("processes")


@pytest.fixture(scope="module")
def corrupting(tmp_path_factory, model):
    os.environ["PDSERVE_FAULT_CORRUPT_KV_EVERY"] = "3"
    try:
        cluster = Cluster(tmp_path_factory.mktemp("corrupt"), model, roles=("prefill", "decode", "decode"))
    finally:
        del os.environ["PDSERVE_FAULT_CORRUPT_KV_EVERY"]
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.mark.chaos
def test_corrupted_kv_is_caught_replayed_and_the_nodes_stay_healthy(corrupting, expected):
    cluster = corrupting
    row = run_fault(
        cluster,
        expected,
        fault="KV checksum mismatch on every 3rd transfer",
        where="prefill -> decode transfer",
        inject=lambda: None,  # the fault runs all along
        seed=41,
        long_output=False,
        allowed=frozenset(),  # failed transfers are retried or migrated: every request completes
    )
    caught = [
        e for n in cluster.live("decode") for e in n.events("kv_failed") if "checksum" in e.get("error", "")
    ]
    assert caught, "no corrupted transfer reached a decode node"
    assert row["outcomes"].get("complete", 0) > 0
    metrics = web.get(cluster.router.url + "/metrics").text
    moved = re.findall(r"^pdserve_(?:retries|migrations)_total (\d+)", metrics, re.M)
    assert sum(map(int, moved)) > 0  # the failed ones went on elsewhere: retried or migrated
    cluster.wait_members(1, 2)  # nobody left the pool over it
