"""A tensor-parallel node's ranks fail fast and name why (engine/executor/executor.py): a rank
whose CUDA device does not exist fails before any worker starts; a worker that fails before the
group forms is named by the error it sent, long before the rendezvous' timeout; a lost rank
aborts the group, and a node whose rank is killed exits with the rank named. A missing or
present CUDA device is faked by torch's device count, the one fault the CPU cannot cause."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from pdserve.engine import LLM
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.executor.executor import Executor, WorkerLost
from pdserve.engine.executor.parallel import eager_init
from pdserve.engine.executor.platform import Platform
from tests.cluster import NodeProcess
from tests.test_tensor_parallel_cluster import _worker_pid
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("processes")

JOIN_TIMEOUT_S = 60.0  # the group's rendezvous: what a failed start cost before
NAMED_WITHIN_S = 20.0  # a worker's import and its error on the socket, on a loaded machine


def _cuda_executor(path: str) -> Executor:
    """Two ranks on --device cuda, rank 0 computing on the CPU's platform (no GPU here)."""
    config = EngineConfig(model=path, device="cuda", num_kv_blocks=16, block_size=8)
    return Executor(
        ModelConfig.from_path(path), config, Platform(), tp_size=2, collective_timeout_s=JOIN_TIMEOUT_S
    )


def test_a_rank_whose_cuda_device_is_missing_fails_before_any_worker_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"rank 1 takes cuda:1, but torch sees 1 CUDA device\(s\)"):
        _cuda_executor(str(make_tiny_model("llama")))
    assert time.monotonic() - start < 5.0  # no worker was started, no join waited on


def test_a_worker_that_fails_before_the_group_forms_is_named_at_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # rank 0 believes cuda:1 exists
    start = time.monotonic()
    with pytest.raises(
        WorkerLost, match=r"rank 1 failed to start: ValueError: device cuda:1: torch sees no CUDA"
    ):
        _cuda_executor(str(make_tiny_model("llama")))
    assert time.monotonic() - start < NAMED_WITHIN_S
    assert not dist.is_initialized()


def test_a_lost_rank_fails_the_executor_and_aborts_its_group():
    llm = LLM(str(make_tiny_model("llama3")), tensor_parallel_size=2, num_kv_blocks=16, block_size=8)
    executor = llm.engine.executor
    try:
        assert dist.is_initialized()
        os.kill(executor.workers[0].proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while executor.failure is None or dist.is_initialized():
            assert time.monotonic() < deadline, (executor.failure, dist.is_initialized())
            time.sleep(0.05)
        assert "rank 1 exited (-9)" in executor.failure
    finally:
        llm.engine.close()


def test_an_idle_node_whose_rank_is_killed_exits_naming_it(tmp_path):
    extra = ["--block-size", "8", "--num-kv-blocks", "32", "--tensor-parallel-size", "2"]
    node = NodeProcess("decode", str(make_tiny_model("llama3")), tmp_path, None, extra)
    try:
        node.wait_ready(timeout_s=120)
        os.kill(_worker_pid(node.proc.pid), signal.SIGKILL)
        assert node.proc.wait(timeout=30) != 0
        (fatal,) = node.events("integrity_failed")
        assert "rank 1 exited (-9)" in fatal["error"]
    finally:
        node.close()


def test_nccl_forms_eagerly_on_its_device_and_gloo_is_unchanged():
    device = torch.device("cuda:1")
    assert eager_init("nccl", device) == {"device_id": device}
    assert eager_init("gloo", torch.device("cpu")) == {}
    assert eager_init("nccl", None) == {}
