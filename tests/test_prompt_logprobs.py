"""Prompt logprobs in the engine: every prompt token's log-probability after the first, its rank
and the top alternatives, equal to HF's log_softmax of the prompt within fp32 tolerance; through
chunked prefill, beside other requests, after a prefix-cache hit, with n > 1 and preemption."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.engine_helpers import hf_logits
from tests.tiny_models import make_tiny_model

ATOL = 2e-5


def _check_against_hf(path: str, prompt: list[int], entries, num_top: int) -> None:
    expected = torch.log_softmax(hf_logits(path, prompt), dim=-1)  # [T, vocab]
    assert len(entries) == len(prompt) - 1
    for pos, entry in enumerate(entries):
        row = expected[pos]
        token = prompt[pos + 1]
        assert entry.token_id == token
        assert abs(entry.logprob - float(row[token])) < ATOL, (pos, entry.logprob, float(row[token]))
        assert (
            entry.rank == int((row > row[token] + ATOL).sum()) + 1
            or abs(float(row.sort(descending=True).values[entry.rank - 1]) - entry.logprob) < ATOL
        )  # ties within tolerance may swap ranks
        assert len(entry.top) == num_top
        top_values = row.topk(num_top).values.tolist() if num_top else []
        assert [v for _, v in entry.top] == pytest.approx(top_values, abs=ATOL)
        for token_id, value in entry.top:
            assert abs(float(row[token_id]) - value) < ATOL


def _run(engine: LLMEngine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    firsts, results = {}, {}
    while engine.has_work():
        for out in engine.step().outputs:
            if out.prompt_logprobs is not None:
                firsts.setdefault(out.request_id, out.prompt_logprobs)
            if out.finished:
                results[out.request_id] = out
    return {rid: (firsts.get(rid), results[rid]) for rid in requests}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prompt_logprobs_match_hf_under_chunking_and_concurrency(family):
    path = str(make_tiny_model(family))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=96, block_size=8, max_num_batched_tokens=48))
    long_prompt = [(13 * i) % 250 + 3 for i in range(150)]  # four chunks
    requests = {
        "long": (long_prompt, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=5)),
        "short": ([5, 9, 11], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)),
        "plain": (list(range(20, 40)), SamplingParams(temperature=0.0, max_tokens=4)),
        "one": ([7], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)),
        "n2": (
            list(range(60, 90)),
            SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=3, prompt_logprobs=2),
        ),
    }
    out = _run(engine, requests)
    _check_against_hf(path, long_prompt, out["long"][0], 5)
    _check_against_hf(path, [5, 9, 11], out["short"][0], 0)
    _check_against_hf(path, list(range(60, 90)), out["n2"][0], 2)
    assert out["one"][0] == []  # a one-token prompt has nothing to score
    assert out["plain"][0] is None and out["plain"][1].prompt_logprobs is None
    # a prefix-cache hit on the long prompt's blocks: its positions are computed again
    again = _run(
        engine,
        {"again": (long_prompt + [4, 4], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))},
    )
    _check_against_hf(path, long_prompt + [4, 4], again["again"][0], 1)
    cached = _run(engine, {"cached": (long_prompt + [4, 4], SamplingParams(temperature=0.0, max_tokens=1))})
    assert cached["cached"][1].num_cached_tokens > 0  # without prompt logprobs the cache serves it
    assert engine.block_manager.num_free_blocks == 96


def test_prompt_logprobs_survive_preemption():
    path = str(make_tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=12, block_size=4, max_num_batched_tokens=64))
    prompts = {f"r{i}": [(i * 31 + 7 * j) % 250 + 3 for j in range(14)] for i in range(3)}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    out = _run(engine, {rid: (p, params) for rid, p in prompts.items()})
    for rid, prompt in prompts.items():
        _check_against_hf(path, prompt, out[rid][0], 2)


def test_the_whole_vocabulary_and_chosen_token_ids_equal_hf_log_softmax():
    """vLLM's -1 reaches the engine as the vocabulary's size (a larger count lists the whole
    vocabulary too); logprob_token_ids lists those tokens, in the order asked, instead of the top."""
    path = str(make_tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=8))
    vocab = engine.model_config.vocab_size
    prompt = [5, 9, 11, 40, 7]
    chosen = (17, 3, 200)
    requests = {
        "vocab": (
            prompt,
            SamplingParams(temperature=0.0, max_tokens=3, logprobs=vocab, prompt_logprobs=vocab),
        ),
        "past": (prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=vocab + 7)),
        "chosen": (
            prompt,
            SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, logprob_token_ids=chosen),
        ),
    }
    out = _run(engine, requests)
    _check_against_hf(path, prompt, out["vocab"][0], vocab)
    _check_against_hf(path, prompt, out["past"][0], vocab)
    whole_out, chosen_out = out["vocab"][1].outputs[0], out["chosen"][1].outputs[0]
    output = whole_out.token_ids
    assert chosen_out.token_ids == output
    expected = torch.log_softmax(hf_logits(path, prompt + output), dim=-1)[len(prompt) - 1 :]  # [3+1, vocab]
    for pos, (whole, picked) in enumerate(zip(whole_out.logprobs, chosen_out.logprobs, strict=True)):
        row = expected[pos]
        assert whole.token_id == picked.token_id == output[pos]
        assert abs(picked.logprob - float(row[output[pos]])) < ATOL
        assert sorted(t for t, _ in whole.top) == list(range(vocab))  # every token, best first
        assert [v for _, v in whole.top] == pytest.approx(row.sort(descending=True).values.tolist(), abs=ATOL)
        assert [t for t, _ in picked.top] == list(chosen)
        assert [v for _, v in picked.top] == pytest.approx([float(row[t]) for t in chosen], abs=ATOL)


def test_logprob_token_ids_outside_the_vocabulary_are_refused_by_the_engine():
    path = str(make_tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=8))
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logprob_token_ids"):
        engine.add_request("a", [5, 9], SamplingParams(max_tokens=2, logprobs=0, logprob_token_ids=(vocab,)))
    assert not engine.requests
    with pytest.raises(ValueError, match="logprob_token_ids needs logprobs"):
        SamplingParams(logprob_token_ids=(1,))
