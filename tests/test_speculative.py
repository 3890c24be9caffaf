"""Speculative decoding (engine/sampling/speculation.py): exact against HF and against the engine without it.

Every engine here runs ``debug_checks`` (the block pool's ref counts against every table, each
step), and each test asserts that drafts were proposed and accepted, so it exercises the path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.sampling.speculation import MIN_FIT_STEPS, RowCost, Speculator, ngram_lookup
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

MAX_NEW = 40


def _random(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


def _prompts() -> list[list[int]]:
    """Mixed lengths, some repetition-rich (the proposer finds drafts in the prompt), some not."""
    base = _random(0, 12)
    return [base * 3, base[:5] * 4 + [7, 9], _random(1, 30), [5], _random(2, 70) + base * 2, base[:3] * 9]


def _engines(kind: str = "llama", **options) -> tuple[LLM, LLM]:
    path = str(make_tiny_model(kind))
    common = {"num_kv_blocks": 160, "block_size": 4, "debug_checks": True, **options}
    return LLM(path, **common), LLM(path, speculative="ngram", num_speculative_tokens=4, **common)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _accepted(llm: LLM) -> int:
    return llm.engine.speculator.stats.accepted_tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_equals_hf_in_one_batch_of_mixed_lengths(kind):
    path = str(make_tiny_model(kind))
    plain, spec = _engines(kind)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    prompts = _prompts()
    ours, theirs = spec.generate(prompts, params), plain.generate(prompts, params)
    for prompt, out, ref in zip(prompts, ours, theirs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)
        assert out.outputs[0].finish_reason == "length"
        for a, b in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    stats = spec.engine.speculator.stats
    assert stats.accepted_tokens > 0 and stats.proposed_tokens > stats.accepted_tokens  # both outcomes ran
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_seeded_sampling_draws_what_the_engine_without_speculation_draws():
    plain, spec = _engines()
    params = [
        SamplingParams(
            temperature=t, top_k=k, top_p=p, seed=s, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1
        )
        for t, k, p, s in ((0.7, None, 1.0, 1), (1.0, 20, 0.9, 2), (0.3, 5, 1.0, 3), (1.2, None, 0.8, 4))
    ]
    prompts = _prompts()[:4]
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=MAX_NEW, ignore_eos=True)
    ours = spec.generate([*prompts, prompts[0]], [*params, penalised])
    theirs = plain.generate([*prompts, prompts[0]], [*params, penalised])
    assert _tokens(ours) == _tokens(theirs)
    assert _accepted(spec) > 0


def test_stops_min_tokens_and_length_limits_end_where_they_would_without_drafts():
    plain, spec = _engines()
    prompts = _prompts()
    base = prompts[0]
    free = plain.generate([base], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    stop_at = free[0].outputs[0].token_ids[9]  # a token the greedy output reaches mid-way
    cases = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=(stop_at,)),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=(stop_at,), min_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),  # shorter than the drafts
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2),
    ]
    for params in cases:
        ours, theirs = spec.generate(prompts, params), plain.generate(prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in ours] == [
            [c.token_ids for c in o.outputs] for o in theirs
        ]
        assert [o.outputs[0].finish_reason for o in ours] == [o.outputs[0].finish_reason for o in theirs]
    assert _accepted(spec) > 0
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_context_limit_and_requests_with_logits_rules():
    plain, spec = _engines(max_model_len=64)
    prompt = _prompts()[0]  # 36 tokens: 28 more reach the context limit, inside a draft
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    assert _tokens(spec.generate([prompt], params)) == _tokens(plain.generate([prompt], params))
    assert len(spec.generate([prompt], params)[0].outputs[0].token_ids) == 64 - len(prompt)
    proposed = spec.engine.speculator.stats.proposed_tokens
    assert proposed > 0
    biased = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logit_bias={17: 5.0})
    assert _tokens(spec.generate([prompt], biased)) == _tokens(plain.generate([prompt], biased))
    assert spec.engine.speculator.stats.proposed_tokens == proposed  # a ruled row never drafts


def test_prefix_cache_after_rejected_drafts_holds_the_right_kv():
    # Blocks written by a verification with rejected drafts are rolled back and rewritten; a later
    # prompt that hits them in the prefix cache must still match HF.
    path = str(make_tiny_model("llama"))
    _, spec = _engines()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = _prompts()[1]
    out = spec.generate([first], greedy)[0].outputs[0].token_ids
    assert spec.engine.speculator.stats.proposed_tokens > _accepted(spec) > 0
    extended = first + out[:30]
    again = spec.generate([extended], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert again.num_cached_tokens >= 40  # the speculative run's blocks served the hit
    assert again.outputs[0].token_ids == hf_greedy(path, extended, 12)


def test_preemption_and_a_small_token_budget_keep_output_exact():
    # 24 blocks of 4 tokens for six sequences: decodes preempt each other; a 12-token budget
    # trims drafts so that every decode still runs each step.
    path = str(make_tiny_model("llama"))
    plain, spec = _engines(num_kv_blocks=24, max_num_batched_tokens=12)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [p[:20] for p in _prompts()]
    ours = spec.generate(prompts, params)
    assert _tokens(ours) == [hf_greedy(path, p, 24) for p in prompts]
    assert _tokens(ours) == _tokens(plain.generate(prompts, params))
    assert _accepted(spec) > 0


def test_ngram_lookup_takes_the_longest_most_recent_match():
    tokens = np.array([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 2, 3])
    assert ngram_lookup(tokens, 3) == [4, 5, 6]  # "2 3" last recurs before "4 5 6" (not "9 9")
    assert ngram_lookup(tokens, 10) == [4, 5, 6, 2, 3]  # stops at the end of the sequence
    assert ngram_lookup(np.array([5, 6, 7, 8]), 4) == []  # no suffix recurs
    assert ngram_lookup(np.array([7, 7]), 4) == [7]


def _seq(tokens: list[int], computed: int, max_tokens: int = 100) -> Sequence:
    seq = Sequence(
        "r", list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens
    )
    seq.num_computed_tokens = computed
    return seq


def test_drafts_follow_acceptance_and_the_output_limit():
    spec = Speculator(4)
    seq = _seq([1, 2, 3, 1, 2, 3, 1, 2], 7)
    spec.propose([seq], waiting=[], max_len=512)
    assert seq.draft_token_ids == [3, 1, 2]  # all that follows the last "1 2" before the end
    for _ in range(8):
        spec.verified(seq, 4, 0)
    assert spec.draft_length(seq) == 0  # nothing is accepted: it stops drafting
    spec.propose([seq], waiting=[], max_len=512)
    assert seq.draft_token_ids == []
    assert spec.acceptance < 0.1  # and new sequences start from the node's rate
    fresh = Speculator(4)
    near_limit = _seq([4, 4, 4, 4], 3, max_tokens=2)
    near_limit.token_ids.append(4)  # one output token of two: the last is drawn, not drafted
    fresh.propose([near_limit], waiting=[], max_len=512)
    assert near_limit.draft_token_ids == []


def _observe(cost, fixed: float, per_row: float) -> None:
    for i in range(4 * MIN_FIT_STEPS):
        rows = 1 + (7 * i) % 40
        cost.observe(rows, fixed + per_row * rows)


def test_row_cost_fit_recovers_the_fixed_and_per_row_parts():
    cost = RowCost()
    assert cost.fit() is None  # no steps yet: the prior
    for _ in range(2 * MIN_FIT_STEPS):
        cost.observe(8, 0.05)
    assert cost.fit() is None  # rows that never vary cannot separate the two parts
    cost = RowCost()
    _observe(cost, 0.020, 0.002)
    fixed, per_row = cost.fit()
    assert fixed == pytest.approx(0.020, rel=0.05) and per_row == pytest.approx(0.002, rel=0.05)


def test_speculation_turns_itself_off_where_rows_no_longer_pay():
    """Steps of 20 ms + 2 ms a row: a draft kept 80% of the time pays while 0.8 > c * Y / T,
    that is below 40 decodes (the first drafts) and not at 48."""
    spec = Speculator(4)
    _observe(spec.row_cost, 0.020, 0.002)
    for _ in range(20):  # 4 of 5 drafts kept at each verification: per-token acceptance 0.8
        spec.verified(_seq([1], 1), 5, 4)
    assert spec.acceptance == pytest.approx(0.8, abs=0.01)
    small = [_seq([4, 4, 4, 4], 3) for _ in range(4)]
    spec.propose(small, waiting=[], max_len=512)
    assert all(s.draft_token_ids for s in small)
    crowd = [_seq([4, 4, 4, 4], 3) for _ in range(48)]
    spec.propose(crowd, waiting=[], max_len=512)
    assert not any(s.draft_token_ids for s in crowd)
    # none while prompt tokens wait, queued or as a running prompt's next chunk
    spec.propose(small, waiting=[_seq([4] * 8, 0)], max_len=512)  # a queued prompt
    assert not any(s.draft_token_ids for s in small)
    chunked = _seq([4] * 8, 4)  # half its prompt computed
    spec.propose([*small, chunked], waiting=[], max_len=512)
    assert not any(s.draft_token_ids for s in small)
    # where the rows cost nothing, every draft the lookup finds pays (to the draft length)
    cheap = Speculator(4)
    _observe(cheap.row_cost, 0.020, 0.0)
    crowd = [_seq([1, 2, 3, 1, 2], 4) for _ in range(48)]
    cheap.propose(crowd, waiting=[], max_len=512)
    assert all(s.draft_token_ids == [3, 1, 2] for s in crowd)


def test_scheduler_counts_drafts_in_the_budget_and_trims_them():
    sched = Scheduler(BlockManager(num_blocks=32, block_size=4), max_num_batched_tokens=6, max_num_seqs=8)
    seqs = [_seq([1, 2, 3, 1, 2, 3], 0) for _ in range(3)]
    for seq in seqs:
        sched.add(seq)
    while any(s.num_uncomputed_tokens for s in seqs):  # the prompts, 6 tokens a step
        for item in sched.schedule().scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
    for seq in seqs:
        seq.token_ids.append(1)  # each prompt's first token: now decodes
        seq.draft_token_ids = [2, 3, 1]
    out = sched.schedule()
    # 6 tokens: the oldest decode takes 4 (its token and 3 drafts), leaving one to each after it,
    # whose drafts are dropped; decodes without drafts go first in the batch
    assert [(s.seq is seqs[0], s.num_new_tokens) for s in out.scheduled] == [
        (False, 1),
        (False, 1),
        (True, 4),
    ]
    assert [len(s.draft_token_ids) for s in seqs] == [3, 0, 0]
