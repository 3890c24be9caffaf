"""A tensor-parallel engine (engine/executor/executor.py): rank 0 here, rank 1 in a worker process it
starts, joined by gloo. Against Hugging Face on the same weights at tp=2: greedy output through
chunked prefill, a prefix hit and concurrent mixed-length requests, prompt and sampled logprobs
within fp32 tolerance, for one KV head (replicated on both ranks), two, three (an uneven share),
GPT-2's fused transposed checkpoint and a vocabulary with padding rows (`make chaos`: every other
dense family); preemption by a tiny pool; n-gram speculation. Seeded sampling with n > 1 and a
guided request give what one rank gives. MoE families are refused naming the flag before any
worker starts, and a worker that dies fails the engine's next step naming its rank."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.executor.executor import WorkerLost
from pdserve.protocol.sampling_params import BeamSearch
from tests.engine_helpers import hf_beams, hf_greedy, hf_logits
from tests.test_prompt_logprobs import _check_against_hf
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("processes")

# The default suite: one KV head (fewer than the ranks), two with q/k/v bias, three (an uneven
# share), GPT-2's transposed fused checkpoint, a vocabulary with padding rows; `make chaos` adds
# every other dense family.
DEFAULT_TIER = ["llama3", "qwen2", "llama-3kv", "gpt2", "llama-odd-vocab"]
MORE = ["llama", "mistral", "qwen3", "gemma", "gemma2", "phi3", "stablelm", "stablelm-parallel", "olmo2"]
DENSE = DEFAULT_TIER + [pytest.param(kind, marks=pytest.mark.chaos) for kind in MORE]


def _prompts() -> list[list[int]]:
    shared = [(7 * i) % 200 + 3 for i in range(24)]  # three full blocks of 8: the second reuses them
    return [
        shared + [11, 12, 13],
        [5, 6, 7],
        shared + [40, 41, 42, 43, 44, 45],
        [(3 * i) % 97 + 2 for i in range(41)],
    ]


def _tp2(path: str, **kw) -> LLM:
    return LLM(path, tensor_parallel_size=2, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, **kw)


@pytest.mark.parametrize("kind", DENSE)
def test_every_dense_family_at_tp2_is_exact_against_hf(kind):
    path = str(make_tiny_model(kind))
    llm = _tp2(path)
    try:
        prompts = _prompts()
        greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
        first = llm.generate(prompts[:1], greedy)[0]  # alone: its blocks are cached after it
        rest = llm.generate(prompts[1:], greedy)  # together, 16-token chunks, a prefix hit
        assert rest[1].num_cached_tokens == 24
        for prompt, out in zip(prompts, [first, *rest], strict=True):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, 10), prompt
        # sampled tokens' logprobs: log_softmax of HF's logits at each step
        full = prompts[0] + first.outputs[0].token_ids
        expected = torch.log_softmax(hf_logits(path, full), dim=-1)[len(prompts[0]) - 1 : -1]
        got = [entry.logprob for entry in first.outputs[0].logprobs]
        want = [float(expected[i, t]) for i, t in enumerate(first.outputs[0].token_ids)]
        assert got == pytest.approx(want, abs=2e-5)
        scored = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))[
            0
        ]  # 41 prompt tokens in 16-token chunks: the head's gather in every chunk, on both ranks
        _check_against_hf(path, prompts[3], scored.prompt_logprobs, 3)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.engine.close()


def test_seeded_sampling_with_n_gt_1_is_the_same_at_tp1_and_tp2():
    path = str(make_tiny_model("llama3"))
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, n=3, seed=1234, ignore_eos=True)
    prompts = _prompts()[:2]
    one = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16).generate(prompts, params)
    llm = _tp2(path)
    try:
        two = llm.generate(prompts, params)
    finally:
        llm.engine.close()
    for a, b in zip(one, two, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_families_are_refused_at_tp2_naming_the_flag(kind):
    path = str(make_tiny_model(kind))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 is refused"):
        _tp2(path)


def test_ngram_speculation_at_tp2_is_exact_against_hf():
    path = str(make_tiny_model("llama"))
    prompt = [5, 6, 7, 8, 9] * 6  # repeats: the n-gram proposer drafts, the step verifies them
    llm = _tp2(path, speculative="ngram", num_speculative_tokens=3)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)
        assert llm.engine.speculator.stats.proposed_tokens > 0
    finally:
        llm.engine.close()


def test_beam_search_at_tp2_equals_hf_num_beams():
    path = str(make_tiny_model("qwen2"))
    prompts = _prompts()[:2]
    params = SamplingParams(
        n=3, temperature=0.0, max_tokens=8, ignore_eos=True, beam_search=BeamSearch(length_penalty=0.5)
    )
    llm = _tp2(path)
    try:
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            assert [o.token_ids for o in out.outputs] == hf_beams(path, prompt, params, None)
    finally:
        llm.engine.close()


def test_preemption_at_tp2_keeps_outputs_exact_and_a_dead_worker_fails_the_next_step():
    path = str(make_tiny_model("llama-3kv"))  # uneven heads too: two KV heads on rank 0, one on rank 1
    g = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(3, 250, (int(n),), generator=g).tolist()
        for n in torch.randint(10, 30, (6,), generator=g)
    ]
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=12, block_size=8)  # 96 slots for 6 of up to 70
    engine = llm.engine
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy)
        finished, preemptions = {}, 0
        while engine.has_work():
            preemptions += len([s for s in engine.scheduler.waiting if s.num_preemptions])
            finished.update({out.request_id: out for out in engine.step().outputs if out.finished})
        assert preemptions > 0
        for i, prompt in enumerate(prompts):
            assert finished[str(i)].outputs[0].token_ids == hf_greedy(path, prompt, 40)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        worker = engine.executor.workers[0].proc  # then its worker dies: the next step says so
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        with pytest.raises(WorkerLost, match=r"rank 1 exited \(-9\)"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3))
        assert engine.executor.failure is not None
    finally:
        engine.close()


def test_a_guided_request_at_tp2_gives_what_one_rank_gives(default_model_dir):
    from pdserve.protocol.sampling_params import GuidedDecoding
    from tests.test_router_cluster import tiny_model_with_tokenizer

    path = str(tiny_model_with_tokenizer(default_model_dir))  # a real vocabulary for the grammar
    params = SamplingParams(
        temperature=0.0, max_tokens=24, guided_decoding=GuidedDecoding.regex(r"[a-z]{2,6}-\d{3}")
    )
    prompt = list(range(100, 130))
    want = LLM(path, num_kv_blocks=32, block_size=8).generate([prompt], params)[0].outputs[0]
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=32, block_size=8)
    try:
        got = llm.generate([prompt], params)[0].outputs[0]
    finally:
        llm.engine.close()
    assert got.token_ids == want.token_ids and re.fullmatch(r"[a-z]{2,6}-\d{3}", got.text)


def test_a_stopped_worker_fails_the_step_at_the_collective_timeout():
    path = str(make_tiny_model("llama3"))
    llm = _tp2(path, collective_timeout_s=3)
    worker = llm.engine.executor.workers[0].proc
    try:
        assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))[0].finished
        os.kill(worker.pid, signal.SIGSTOP)  # hung: alive, but never at the next collective
        start = time.monotonic()
        with pytest.raises(WorkerLost, match=r"failed after \d+ s \(timeout 3 s\)"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3))
        assert time.monotonic() - start < 20
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        llm.engine.close()
