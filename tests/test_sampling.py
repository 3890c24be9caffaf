"""Sampler and SamplingParams: HF logits processors as the oracle where one exists."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.sampling.sampler import Sampler, SamplerInput
from tests.engine_helpers import hf_logits, hf_model
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(make_tiny_model("llama")), num_kv_blocks=64, block_size=8)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"temperature": -1.0}, "temperature"),
        ({"n": 0}, "n"),
        ({"logprobs": -2}, "logprobs"),  # vLLM's -1 reaches the engine as the vocabulary's size
        ({"logprob_token_ids": (3,)}, "logprob_token_ids"),  # without logprobs
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_invalid_sampling_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_naming_the_field(llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="prompt: 600 tokens"):
        llm.generate([[5] * 600])  # the tiny model's context is 512
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5] * 500], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="prompt: token ids"):
        llm.generate([[5, 100000]])
    assert not llm.engine.has_work()


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    top1 = llm.generate([[4, 5, 6]], SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_same_seed_same_output_different_seed_differs(llm):
    def run(seed):
        p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=seed, ignore_eos=True)
        return llm.generate([[9, 8, 7]], p)[0].outputs[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_repetition_penalty_greedy_matches_hf(llm):
    path = llm.engine.model_config.path
    prompt = [7, 8, 9, 10, 7, 8]
    ours = (
        llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )
    with torch.no_grad():
        ref = (
            hf_model(path)
            .generate(
                torch.tensor([prompt]),
                max_new_tokens=16,
                do_sample=False,
                repetition_penalty=1.3,
                pad_token_id=0,
            )[0, len(prompt) :]
            .tolist()
        )
    assert ours == ref


def _row_after(params: SamplingParams, tokens: list[int], num_prompt: int) -> torch.Tensor:
    from pdserve.engine.sampling.sampler import _apply_penalties

    row = torch.zeros(16)
    _apply_penalties(row, Sequence("r", tokens, num_prompt, params), params)
    return row


def test_presence_and_frequency_penalties_follow_openai_formula():
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = _row_after(p, [1, 2, 3, 3, 3, 4], num_prompt=2)  # output tokens: 3, 3, 3, 4
    assert row[3].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert row[4].item() == pytest.approx(-(0.5 + 0.25))
    assert row[1].item() == 0.0  # prompt tokens are not penalised


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.zeros(1, 8)
    logits[0, 2] = 10.0  # EOS is by far the most likely
    seq = Sequence("r", [5], 1, SamplingParams(temperature=0.0, min_tokens=2))
    token, _ = Sampler().sample(logits, [SamplerInput(seq, banned_token_ids=(2,))])[0]
    assert token != 2


def test_logprobs_are_the_models_log_softmax_with_top_alternatives(llm):
    path = llm.engine.model_config.path
    prompt = [11, 12, 13]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True))[
        0
    ].outputs[0]
    ref = torch.log_softmax(hf_logits(path, prompt + out.token_ids[:-1]), dim=-1)[len(prompt) - 1 :]
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref[i], 5).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the best


def test_stop_token_ids_end_generation_with_reason(llm):
    first = llm.generate([[20, 21]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    stop_at = first[0].outputs[0].token_ids[3]
    out = llm.generate(
        [[20, 21]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at])
    )[0].outputs[0]
    assert out.token_ids[-1] == stop_at and len(out.token_ids) <= 4
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_rows_filtered_together_equal_rows_filtered_one_by_one():
    """The batched filter (unseeded rows, drawn together on the device) gives each row the
    distribution the one-row filter does, for every mix of temperature, top-k, min-p and top-p."""
    from pdserve.engine.sampling.sampler import _filtered_probs, _filtered_probs_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 300, generator=g) * 3
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.5, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=300),  # k = vocab: no cut
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.9, top_p=1e-6),  # the top token alone
    ]
    together = _filtered_probs_rows(logits.clone(), params)
    for r, p in enumerate(params):
        alone = _filtered_probs(logits[r].clone(), p)
        assert torch.allclose(together[r], alone, atol=1e-6), r
        assert torch.equal(together[r] > 0, alone > 0), r  # the same tokens can be drawn
    assert (together[6] > 0).sum() == 1 and (together[7] > 0).sum() == 1


def test_a_batch_of_unseeded_rows_keeps_every_rows_constraints(llm):
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    params = [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=1e-9, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=1.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.5, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6),  # greedy with EOS banned
        SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3),  # one by one
    ]
    outs = llm.generate(prompts, params)
    greedy = llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for r in range(3):  # filters that leave one token are greedy
        assert outs[r].outputs[0].token_ids == greedy[r].outputs[0].token_ids, r
    assert len(outs[4].outputs[0].token_ids) == 6 and len(outs[3].outputs[0].token_ids) == 6
    seeded = llm.generate([prompts[5]], params[5])  # alone, it draws what it drew in the batch
    assert seeded[0].outputs[0].token_ids == outs[5].outputs[0].token_ids
