"""Every scheduling path gives the same greedy tokens as the request alone (and as HF)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def path() -> str:
    return str(make_tiny_model("llama"))


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in lengths]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _alone(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    return (
        LLM(path, num_kv_blocks=64, block_size=8)
        .generate([prompt], _greedy(max_tokens))[0]
        .outputs[0]
        .token_ids
    )


def _check_all_blocks_back(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_32_concurrent_mixed_requests_match_hf(path):
    prompts = _prompts(32, 1, 60)
    lengths = [1 + (7 * i) % 30 for i in range(32)]
    llm = LLM(path, num_kv_blocks=512, block_size=8, max_num_seqs=32)
    outs = llm.generate(prompts, [_greedy(n) for n in lengths])
    for prompt, n, out in zip(prompts, lengths, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, n)
    _check_all_blocks_back(llm)


def test_chunked_prefill_under_small_token_budget_matches_hf(path):
    prompts = _prompts(6, 30, 90, seed=1)
    llm = LLM(path, num_kv_blocks=256, block_size=8, max_num_batched_tokens=16)
    outs = llm.generate(prompts, _greedy(12))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)
    _check_all_blocks_back(llm)


def test_preemption_by_tiny_pool_keeps_outputs_exact(path):
    prompts = _prompts(8, 10, 30, seed=2)
    llm = LLM(path, num_kv_blocks=12, block_size=8)  # 96 slots for 8 requests of up to 70 tokens
    engine = llm.engine
    preemptions = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, _greedy(40))
    finished = {}
    while engine.has_work():
        preemptions += len([s for s in engine.scheduler.waiting if s.num_preemptions])
        for out in engine.step().outputs:
            engine.block_manager.check_integrity(engine.scheduler.running)
            if out.finished:
                finished[out.request_id] = out
    assert preemptions > 0
    for i, prompt in enumerate(prompts):
        assert finished[str(i)].outputs[0].token_ids == hf_greedy(path, prompt, 40)
    _check_all_blocks_back(llm)


def test_prefix_cache_hits_skip_computation_and_stay_exact(path):
    system = _prompts(1, 40, 40, seed=3)[0]
    questions = _prompts(4, 3, 9, seed=4)
    llm = LLM(path, num_kv_blocks=128, block_size=8)
    first = llm.generate([system + questions[0]], _greedy(10))[0]
    assert first.num_cached_tokens == 0
    later = llm.generate([system + q for q in questions[1:]], _greedy(10))
    for q, out in zip(questions[1:], later, strict=True):
        assert out.num_cached_tokens == 40  # five full blocks of the shared system prompt
        assert out.outputs[0].token_ids == hf_greedy(path, system + q, 10)
    _check_all_blocks_back(llm)


def test_n_samples_share_prompt_blocks_with_copy_on_write(path):
    prompt = _prompts(1, 21, 21, seed=5)[0]  # 21 tokens: the third block of 8 is partly filled
    llm = LLM(path, num_kv_blocks=64, block_size=8)
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.step()  # prefill, then three forks share the prompt's blocks
    seqs = engine.requests["r"].seqs
    assert len(seqs) == 3
    assert [engine.block_manager.blocks[b].ref_count for b in seqs[0].block_table] == [3, 3, 3]
    sched = engine.scheduler.schedule()
    assert len(sched.block_copies) == 2  # two of the three samples copy the shared partial block
    engine.scheduler.running.clear()  # undo the peek: give back and re-add
    for item in sched.scheduled:
        engine.block_manager.free(item.seq)
    engine.abort_request("r")
    _check_all_blocks_back(llm)
    outs = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True))
    expected = hf_greedy(path, prompt, 6)
    assert [o.token_ids for o in outs[0].outputs] == [expected] * 3
    _check_all_blocks_back(llm)


def test_n_samples_with_temperature_differ_and_seed_reproduces(path):
    llm = LLM(path, num_kv_blocks=64, block_size=8)
    params = SamplingParams(n=4, temperature=1.5, max_tokens=8, seed=7, ignore_eos=True)
    a = [o.token_ids for o in llm.generate([[5, 6, 7]], params)[0].outputs]
    b = [o.token_ids for o in llm.generate([[5, 6, 7]], params)[0].outputs]
    assert a == b
    assert len({tuple(x) for x in a}) > 1


def test_request_that_can_never_fit_is_rejected_not_queued(path):
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=4, block_size=8))
    with pytest.raises(ValueError, match="need 5 KV blocks"):
        engine.add_request("big", list(range(3, 30)), _greedy(10))
    assert not engine.has_work()


def test_abort_frees_blocks_at_once(path):
    llm = LLM(path, num_kv_blocks=64, block_size=8)
    engine = llm.engine
    engine.add_request("a", list(range(3, 40)), _greedy(50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < 64
    assert engine.abort_request("a")
    _check_all_blocks_back(llm)
