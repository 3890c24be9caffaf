"""The executor's ranks (engine/executor/executor.py). Executor.rank_pools, what a node wraps for its KV
transfer (node/transfer_caches.py): at tp=2 each rank's pool with the model's KV heads it holds,
rank 0's being the pool its runner computes with and rank 1's the pages its worker writes; seen as
one, they hold what one rank's pool holds after the same prompt. At tp=1 the one pool is rank 0's
own. A call made the moment a worker died names how it ended, though rank 0's monitor has not seen it
yet."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.executor.executor import WorkerLost
from pdserve.node.transfer_caches import transfer_caches
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("processes")

PROMPT = [(5 * i) % 200 + 3 for i in range(21)]  # three blocks of 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _llm(path: str, tp: int) -> LLM:
    return LLM(path, tensor_parallel_size=tp, num_kv_blocks=16, block_size=8)


def test_two_ranks_pools_hold_their_heads_and_together_what_one_rank_holds():
    path = str(make_tiny_model("llama-3kv"))  # three KV heads: two on rank 0, one on rank 1
    one = _llm(path, 1)
    want = one.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    [single] = one.engine.executor.rank_pools
    assert single.rank == 0 and single.kv_heads == range(3)
    assert single.layer_caches is one.engine.executor.kv_caches
    two = _llm(path, 2)
    try:
        assert two.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == want
        executor = two.engine.executor
        pools = executor.rank_pools
        assert [(p.rank, p.kv_heads) for p in pools] == [(0, range(0, 2)), (1, range(2, 3))]
        assert [p.layer_caches[0][0].shape[2] for p in pools] == [2, 1]
        rank0_k = executor.runner.kv_caches[0][0]
        assert pools[0].layer_caches[0][0].data_ptr() == rank0_k.data_ptr()  # what rank 0 computes with
        assert pools[1].layer_caches[-1][1].abs().sum() > 0  # rank 1's worker wrote its V here
        with pytest.raises(AssertionError, match="rank_pools"):
            _ = executor.kv_caches  # rank 0's own heads are not the model's
        num_blocks = two.engine.kv_spec.num_blocks
        for (k2, v2), (k1, v1) in zip(transfer_caches(pools), single.layer_caches, strict=True):
            torch.testing.assert_close(k2.gather(slice(0, num_blocks), None), k1, atol=1e-5, rtol=0)
            torch.testing.assert_close(v2.gather(slice(0, num_blocks), None), v1, atol=1e-5, rtol=0)
    finally:
        two.engine.close()


def test_a_call_the_moment_a_worker_died_names_its_exit_code():
    llm = _llm(str(make_tiny_model("llama3")), 2)
    executor = llm.engine.executor
    try:
        worker = executor.workers[0].proc
        executor._closing = True  # rank 0's monitor stands down: only the call itself can see the exit
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        with pytest.raises(WorkerLost, match=r"rank 1 exited \(-9\)"):
            executor.time_prefill(8)  # its message goes out at once: the socket is closed
    finally:
        llm.engine.close()
