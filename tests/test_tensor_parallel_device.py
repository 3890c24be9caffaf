"""Tensor-parallel ranks whose KV pools are in device memory, on the split platform (the CPU's
stand-in for a GPU: engine/executor/platform.py). Each rank allocates its own pool, as each GPU
would, and the engine's output equals HF's; rank 0 makes no host copy of them and offers none
(Executor.rank_pools refuses), so nothing can transfer KV it did not read. A prefill, decode or
colocated node of two ranks on such a platform refuses at start, naming why; so does an engine
with an offload tier there."""

from __future__ import annotations

import subprocess

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.executor.platform import TEST_PLATFORM_ENV
from pdserve.engine.executor.rank_pools import PoolsNotShared
from pdserve.launcher.commands import pdserve_argv
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("processes")

PROMPT = [(7 * i) % 200 + 3 for i in range(19)]
REFUSED_WITHIN_S = 60.0  # the refusal comes before any weights load: the interpreter's start


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setenv(TEST_PLATFORM_ENV, "split")  # the workers inherit it


def test_two_ranks_on_a_device_keep_their_own_pools_and_match_hf(split):
    path = str(make_tiny_model("llama-3kv"))
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=16, block_size=8)
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        assert out[0].outputs[0].token_ids == hf_greedy(path, PROMPT, 5)
        executor = llm.engine.executor
        assert executor.runner.platform.kind == "split"
        assert executor.pools == []  # no host memfd stands in for the device pools
        with pytest.raises(PoolsNotShared, match="2 tensor-parallel ranks"):
            _ = executor.rank_pools
    finally:
        llm.engine.close()


def test_an_offload_tier_on_two_device_ranks_is_refused(split, tmp_path):
    with pytest.raises(ValueError, match="rank 0 sees only its own device's"):
        LLM(
            str(make_tiny_model("llama")),
            tensor_parallel_size=2,
            num_kv_blocks=16,
            block_size=8,
            kv_offload_dir=str(tmp_path),
        )


@pytest.mark.parametrize(
    "role", [["prefill"], ["decode"], ["decode", "--colocated"]], ids=["prefill", "decode", "colocated"]
)
def test_a_two_rank_node_on_a_device_refuses_at_start_naming_why(split, role, tmp_path):
    argv = [
        *pdserve_argv(*role),
        *("--model", str(make_tiny_model("llama"))),
        *("--tensor-parallel-size", "2", "--block-size", "8", "--num-kv-blocks", "32"),
        *("--ready-file", str(tmp_path / "ready.json")),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=REFUSED_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode != 0
    assert "--tensor-parallel-size 2: each rank's KV pool is in its own device's memory" in out, out
    assert "would move host copies" in out, out
    assert not (tmp_path / "ready.json").exists()
