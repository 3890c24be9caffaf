"""An idle node sleeps on its sockets instead of spinning: on a 2-core machine a decode node that
polled every 2 ms took a quarter of a core from the prefill node next to it."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.cluster import NodeProcess
from tests.test_router_cluster import tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_idle_node_uses_almost_no_cpu(tmp_path, default_model_dir, role):
    node = NodeProcess(
        role, str(tiny_model_with_tokenizer(default_model_dir)), tmp_path, None, ["--num-kv-blocks", "64"]
    )
    try:
        node.wait_ready()
        process = psutil.Process(node.proc.pid)
        time.sleep(0.5)  # start-up work done
        before = sum(process.cpu_times()[:2])
        time.sleep(3.0)
        share = (sum(process.cpu_times()[:2]) - before) / 3.0
        assert share < 0.05, f"an idle {role} node used {share:.0%} of a core"
    finally:
        node.close()
