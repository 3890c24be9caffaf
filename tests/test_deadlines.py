"""A request's deadline is absolute: set once by whoever sends the GenerateRequest and carried from
the prefill node to the decode node, so time spent on the prefill node counts against it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.cluster import Client, NodeProcess
from tests.test_router_cluster import tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")


def test_time_spent_before_the_transfer_counts_against_the_deadline(tmp_path, default_model_dir):
    model = str(tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=4096))
    prefill = NodeProcess("prefill", model, tmp_path, None, ["--num-kv-blocks", "300"])
    decode = NodeProcess("decode", model, tmp_path, None, ["--num-kv-blocks", "300"])
    client = Client()
    try:
        p, d = prefill.wait_ready(), decode.wait_ready()
        os.kill(prefill.proc.pid, signal.SIGSTOP)  # the request waits 2 s on the prefill node
        sent = time.monotonic()
        client.generate(
            p,
            "late",
            list(range(5, 60)),
            {"temperature": 0, "max_tokens": 3900, "ignore_eos": True},
            decode=d,
            ttl_s=3.0,
        )
        time.sleep(2.0)
        os.kill(prefill.proc.pid, signal.SIGCONT)
        result = client.collect(["late"], timeout_s=30)["late"]
        ended = time.monotonic() - sent
        assert result["failed"] is not None and result["failed"].code == "timeout", result
        assert 2.5 < ended < 3.8, ended  # 3 s from the send, not 3 s from the decode node's adoption
        assert client.wait_idle(d)["num_blocks_free"] == 300
    finally:
        client.close()
        if prefill.proc.poll() is None:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        prefill.close()
        decode.close()
