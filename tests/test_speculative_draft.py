"""Speculative decoding with a draft model (engine/sampling/draft_model.py): exact against HF and against the
engine without speculation, whatever the draft model proposes.

Three draft models: the model itself (its greedy drafts are what greedy decoding draws, so every
draft is kept), the model with noise on its weights (some drafts kept, some rolled back), and a
tiny Qwen2 of the same vocabulary with weights of its own (every draft rejected, until the
speculator stops drafting). Every engine runs ``debug_checks``.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from tests.engine_helpers import hf_greedy
from tests.test_speculative import _prompts, _tokens
from tests.tiny_models import make_tiny_model

MAX_NEW = 24
COMMON = {"num_kv_blocks": 160, "block_size": 4, "debug_checks": True}


def _draft_engine(target: str, draft: str, **options) -> LLM:
    return LLM(target, speculative_model=draft, num_speculative_tokens=4, **{**COMMON, **options})


def _noisy_copy(path: pathlib.Path, dest: pathlib.Path, noise: float = 0.01) -> str:
    """The model with seeded noise on its matrices (theirs are about N(0, 0.08)): a draft model
    that agrees with it often, not always."""
    shutil.copytree(path, dest)
    weights = load_file(dest / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    noisy = {
        k: v + noise * torch.randn(v.shape, generator=g) if v.dim() > 1 else v for k, v in weights.items()
    }
    save_file(noisy, dest / "model.safetensors", metadata={"format": "pt"})
    return str(dest)


def _all_blocks_back(llm: LLM) -> None:
    """Every block of the target's pool and of the draft engine's is free (cached ones count)."""
    for engine in (llm.engine, llm.engine.speculator.draft.engine):
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, (engine.config.model, bm.num_free_blocks, bm.num_blocks)
        assert not engine.has_work()


def test_the_model_as_its_own_draft_keeps_nearly_every_draft_and_equals_hf():
    path = str(make_tiny_model("llama"))
    spec = _draft_engine(path, path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    outputs = spec.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)
        assert len(out.outputs[0].logprobs) == MAX_NEW
    stats = spec.engine.speculator.stats
    assert stats.proposed_tokens >= 2 * len(prompts) * 4  # several rounds of 4 drafts each
    assert stats.accepted_tokens >= 0.9 * stats.proposed_tokens, stats  # fp32 ties aside: all
    assert spec.engine.speculator.draft.stats.rounds > 0
    _all_blocks_back(spec)


@pytest.mark.parametrize("draft", ["noisy", "qwen2"])
def test_a_draft_model_of_other_weights_never_changes_greedy_or_seeded_output(draft, tmp_path):
    path = make_tiny_model("llama")
    if draft == "noisy":
        draft_path = _noisy_copy(path, tmp_path / "noisy")
    else:
        draft_path = str(make_tiny_model("qwen2", seed=3))
    plain, spec = LLM(str(path), **COMMON), _draft_engine(str(path), draft_path)
    prompts = _prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    ours, theirs = spec.generate(prompts, greedy), plain.generate(prompts, greedy)
    for prompt, out, ref in zip(prompts, ours, theirs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(str(path), prompt, MAX_NEW)
        for a, b in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    stats = spec.engine.speculator.stats
    assert stats.proposed_tokens > stats.accepted_tokens  # rejected drafts were rolled back
    if draft == "noisy":
        assert stats.accepted_tokens > 0 and spec.engine.speculator.draft.stats.rounds > 1
    seeded = [
        SamplingParams(temperature=t, top_k=k, seed=s, max_tokens=MAX_NEW, ignore_eos=True)
        for t, k, s in ((0.7, None, 1), (1.0, 20, 2), (0.3, 5, 3), (1.2, None, 4))
    ]
    assert _tokens(spec.generate(prompts[:4], seeded)) == _tokens(plain.generate(prompts[:4], seeded))
    _all_blocks_back(spec)


def test_stops_n_and_the_context_limit_end_where_they_would_without_a_draft_model():
    path = str(make_tiny_model("llama"))
    plain, spec = LLM(path, max_model_len=64, **COMMON), _draft_engine(path, path, max_model_len=64)
    prompts = _prompts()
    free = plain.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    stop_at = free[0].outputs[0].token_ids[9]  # a token the greedy output reaches mid-way
    cases = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=(stop_at,)),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=(stop_at,), min_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),  # shorter than the drafts
        SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),  # to the 64-token context
        SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_NEW, ignore_eos=True, n=2),
    ]
    short = [p for p in prompts if len(p) < 60]
    for params in cases:
        ours, theirs = spec.generate(short, params), plain.generate(short, params)
        assert [[c.token_ids for c in o.outputs] for o in ours] == [
            [c.token_ids for c in o.outputs] for o in theirs
        ]
        assert [o.outputs[0].finish_reason for o in ours] == [o.outputs[0].finish_reason for o in theirs]
    assert spec.engine.speculator.stats.accepted_tokens > 0
    _all_blocks_back(spec)


def test_preemption_and_a_small_token_budget_keep_output_exact():
    # 24 blocks of 4 tokens for six sequences: decodes preempt each other; a 12-token budget
    # trims drafts so that every decode still runs each step.
    path = str(make_tiny_model("llama"))
    spec = _draft_engine(path, path, num_kv_blocks=24, max_num_batched_tokens=12)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [p[:20] for p in _prompts()]
    assert _tokens(spec.generate(prompts, params)) == [hf_greedy(path, p, MAX_NEW) for p in prompts]
    assert spec.engine.speculator.stats.accepted_tokens > 0
    _all_blocks_back(spec)


def test_a_draft_model_of_another_vocabulary_or_with_ngram_is_refused_naming_the_flag(tmp_path):
    path = make_tiny_model("llama")
    other = tmp_path / "other-vocab"
    shutil.copytree(path, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    with pytest.raises(ValueError, match="speculative_model: .* vocabulary of 300 tokens"):
        LLM(str(path), speculative_model=str(other), **COMMON)
    with pytest.raises(ValueError, match="speculative_model: .*no config.json"):
        LLM(str(path), speculative_model=str(tmp_path), **COMMON)
    with pytest.raises(ValueError, match="speculative_model: .*not both"):
        LLM(str(path), speculative="ngram", speculative_model=str(path), **COMMON)
