"""An idle node sleeps on its sockets instead of spinning: on a 2-core machine a decode node that
polled every 2 ms took a quarter of a core from the prefill node next to it."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.cluster import NodeProcess
from tests.test_router_cluster import tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")


def test_an_idle_node_uses_almost_no_cpu(tmp_path, default_model_dir):
    """A prefill and a decode node, measured over the same window (one wait for both)."""
    model = str(tiny_model_with_tokenizer(default_model_dir))
    nodes = {
        role: NodeProcess(role, model, tmp_path, None, ["--num-kv-blocks", "64"])
        for role in ("prefill", "decode")
    }
    try:
        for node in nodes.values():
            node.wait_ready()
        processes = {role: psutil.Process(node.proc.pid) for role, node in nodes.items()}
        time.sleep(0.5)  # start-up work done
        before = {role: sum(p.cpu_times()[:2]) for role, p in processes.items()}
        time.sleep(3.0)
        for role, process in processes.items():
            share = (sum(process.cpu_times()[:2]) - before[role]) / 3.0
            assert share < 0.05, f"an idle {role} node used {share:.0%} of a core"
    finally:
        for node in nodes.values():
            node.close()
