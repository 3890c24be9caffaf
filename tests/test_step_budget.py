"""Time-bounded steps: the token budget follows a step-time target at the measured speed."""

from __future__ import annotations

import time

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.step_budget import AUTO_MAX_STEP_S, StepBudget
from pdserve.engine.llm_engine import LLMEngine
from tests.tiny_models import make_tiny_model


def test_the_budget_settles_on_the_chunk_that_takes_the_target():
    budget = StepBudget(target_s=0.5, max_tokens=2048, min_tokens=80)
    fixed_s, per_token_s = 0.05, 0.001  # a step takes 0.05 s + 1 ms per token
    for _ in range(30):
        n = budget.tokens()
        budget.observe(n, fixed_s + per_token_s * n)
    assert abs(budget.tokens() - 450) <= 5  # (0.5 - 0.05) / 0.001


def test_a_machine_that_slows_down_gets_smaller_chunks_and_one_that_recovers_larger():
    budget = StepBudget(target_s=0.5, max_tokens=2048, min_tokens=80)
    for _ in range(10):
        budget.observe(budget.tokens(), 0.001 * budget.tokens())
    assert budget.tokens() == 500
    for _ in range(10):  # another process takes half the cores: 2 ms a token
        budget.observe(budget.tokens(), 0.002 * budget.tokens())
    assert abs(budget.tokens() - 250) <= 10
    for _ in range(10):
        budget.observe(budget.tokens(), 0.001 * budget.tokens())
    assert abs(budget.tokens() - 500) <= 10


def test_the_budget_stays_within_its_floor_and_the_configured_maximum():
    budget = StepBudget(target_s=0.1, max_tokens=2048, min_tokens=80)
    assert budget.tokens() == 2048  # nothing measured yet
    budget.observe(1000, 100.0)  # 0.1 s a token
    assert budget.tokens() == 80
    fast = StepBudget(target_s=10.0, max_tokens=2048, min_tokens=80)
    fast.observe(1000, 0.01)
    assert fast.tokens() == 2048


def test_the_derived_target_is_the_full_budgets_time_at_the_first_speed_at_most_a_second():
    gpu_like = StepBudget(None, max_tokens=2048, min_tokens=80)
    gpu_like.observe(10, 1.0)  # too small a step to measure speed by
    assert gpu_like.target_s is None and gpu_like.tokens() == 2048
    gpu_like.observe(1024, 0.02)
    assert abs(gpu_like.target_s - 0.04) < 1e-9 and gpu_like.tokens() == 2048
    slow = StepBudget(None, max_tokens=2048, min_tokens=80)
    slow.observe(512, 1.0)  # 2048 tokens would take 4 s here
    assert slow.target_s == AUTO_MAX_STEP_S and slow.tokens() == 512


def _prefill(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of each step that prefills ``prompt``."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    steps = []
    first = (engine.step_stats.by_kind["prefill"].prompt_tokens, 0.0)
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        steps.append((engine.step_stats.by_kind["prefill"].prompt_tokens, time.perf_counter() - start))
    return [(b[0] - a[0], b[1]) for a, b in zip([first, *steps], steps, strict=False)]


def test_prompt_chunks_shrink_to_the_step_time_target_when_the_machine_slows_down():
    model = make_tiny_model("llama-deep")
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=128, block_size=8, max_step_s=0.2))
    delay = {"per_token_s": 10e-6}  # each layer's extra time per token: 8 layers, 80 us a token
    for layer in engine.runner.model.model.layers:
        layer.register_forward_pre_hook(lambda _m, args: time.sleep(delay["per_token_s"] * args[0].shape[0]))
    ((tokens, _),) = _prefill(engine, "fast", [(7 * i) % 250 + 3 for i in range(400)])
    assert tokens == 400  # 32 ms: one step
    delay["per_token_s"] = 100e-6  # ten times slower: 0.8 ms a token, 480 tokens would take 0.38 s
    for seed in (11, 13, 17):  # the first steps at the new speed run long; the budget follows them
        steps = _prefill(engine, f"slow-{seed}", [(seed * i) % 250 + 3 for i in range(480)])
        assert sum(n for n, _ in steps) == 480
    assert len(steps) >= 2 and all(n <= 320 for n, _ in steps), steps  # ~0.2 s / 0.8 ms = 250
    assert all(seconds < 0.2 * 1.5 for _, seconds in steps), steps


def test_steps_that_carry_decodes_keep_to_the_decode_step_target_and_prompt_only_steps_to_the_other():
    model = make_tiny_model("llama-deep")
    config = EngineConfig(
        model=str(model),
        num_kv_blocks=256,
        block_size=8,
        max_num_seqs=8,
        max_step_s=0.3,
        max_decode_step_s=0.06,
    )
    engine = LLMEngine(config)
    assert engine.step_budget.target_s == 0.06  # what the router checks a local prefill against
    for layer in engine.runner.model.model.layers:  # 8 layers: 0.8 ms a token, 375 tokens in 0.3 s
        layer.register_forward_pre_hook(lambda _m, args: time.sleep(100e-6 * args[0].shape[0]))
    for seed in (3, 13):  # measure the speed (the first step pays for first-call allocations)
        _prefill(engine, f"first-{seed}", [(seed * i) % 250 + 3 for i in range(480)])
    steps = _prefill(engine, "alone", [(5 * i) % 250 + 3 for i in range(480)])
    alone = steps[0][0]  # a prompt alone: chunks of the prompt-only target (0.3 s, ~375 tokens)
    assert alone > 150, steps
    engine.add_request(
        "decoding", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    )
    engine.step()  # its prefill; from here it decodes in every step
    engine.add_request("long", [(7 * i) % 250 + 3 for i in range(480)], SamplingParams(max_tokens=1))
    mixed = []
    while "long" in engine.requests:
        before = engine.step_stats.by_kind["mixed"].prompt_tokens
        start = time.perf_counter()
        engine.step()
        mixed.append((engine.step_stats.by_kind["mixed"].prompt_tokens - before, time.perf_counter() - start))
    assert sum(n for n, _ in mixed) == 480
    # ~0.06 s / 0.8 ms = 75 tokens a step beside the decode, the decode row among them
    assert len(mixed) >= 4 and all(2 * n <= alone for n, _ in mixed), (mixed, steps)
    assert sorted(s for _, s in mixed)[len(mixed) // 2] < 0.06 * 1.5, mixed
    engine.abort_request("decoding")
    steps = _prefill(engine, "alone-again", [(11 * i) % 250 + 3 for i in range(480)])
    assert steps[0][0] > 150, steps  # no decodes running: the prompt-only target again
