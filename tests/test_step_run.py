"""model_runner.StepRun, the one code path of a step on every tensor-parallel rank: the LM-head
calls it makes (each a collective at tp > 1) are the same, in the same order, whether rank 0's
engine reads every prompt range, skips one, abandons one half-read, or none is read (a worker);
and what rank 0 reads equals the model's logits of those rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.executor.model_runner import PROMPT_LOGITS_ROWS, ModelRunner, StepRun
from pdserve.protocol.kv_layout import KVCacheSpec
from tests.tiny_models import make_tiny_model

BLOCK = 16
LONG = PROMPT_LOGITS_ROWS + 44  # 300 prompt tokens: its 299 scored rows take two LM-head calls


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    path = make_tiny_model("llama")
    cfg = ModelConfig.from_path(path)
    spec = KVCacheSpec(cfg.num_layers, 32, BLOCK, cfg.num_kv_heads, cfg.head_dim, "float32")
    return ModelRunner(cfg, EngineConfig(model=str(path), dtype="float32", block_size=BLOCK), spec)


def _sched() -> SchedulerOutput:
    """A decode, then two whole prompts due prompt logprobs: 299 rows, then 9."""
    items, blocks = [], iter(range(32))

    def seq(name: str, tokens: list[int], computed: int, prompt_logprobs: int | None) -> Sequence:
        s = Sequence(name, tokens, len(tokens), SamplingParams(prompt_logprobs=prompt_logprobs))
        s.num_computed_tokens = computed
        s.block_table = [next(blocks) for _ in range(-(-len(tokens) // BLOCK))]
        items.append(ScheduledSeq(s, len(tokens) - computed))
        return s

    seq("decode", [5, 6, 7, 8], computed=3, prompt_logprobs=None)
    seq("long", [(7 * i) % 200 + 3 for i in range(LONG)], computed=0, prompt_logprobs=2)
    seq("short", list(range(30, 40)), computed=0, prompt_logprobs=0)
    return SchedulerOutput(items, [], [])


def _lm_head_calls(runner: ModelRunner, read: Callable[[StepRun], None]) -> list[int]:
    """The rows of each LM-head call of one step whose prompt rows ``read`` reads, then finishes."""
    calls: list[int] = []
    hook = runner.model.lm_head.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    try:
        plan = runner.plan(_sched())[0]
        run = StepRun(runner, plan)
        read(run)
        run.finish()
        assert run.finished
    finally:
        hook.remove()
    return calls


def _read_all(run: StepRun) -> None:
    for hidden in run.prompt_hidden:
        for _ in run.prompt_logits(hidden):
            pass


def _read_second_only(run: StepRun) -> None:
    for _ in run.prompt_logits(run.prompt_hidden[1]):
        pass


def _abandon_first_half_read(run: StepRun) -> None:
    next(iter(run.prompt_logits(run.prompt_hidden[0])))


@pytest.mark.parametrize(
    "read",
    [lambda run: None, _read_all, _read_second_only, _abandon_first_half_read],
    ids=["a worker: none", "every range", "the second only", "the first half read"],
)
def test_a_step_makes_the_same_lm_head_calls_whatever_rank_0_reads(runner, read):
    # the sampled rows (one a sequence), then 256 + 43 rows of the long prompt, then 9 of the short
    assert _lm_head_calls(runner, read) == [3, PROMPT_LOGITS_ROWS, LONG - 1 - PROMPT_LOGITS_ROWS, 9]


def test_rank_0_reads_each_prompt_range_as_the_models_logits_of_its_rows(runner):
    run = StepRun(runner, runner.plan(_sched())[0])
    for hidden in run.prompt_hidden:
        got = torch.cat([logits for _, logits in run.prompt_logits(hidden)])  # [rows, vocab]
        with torch.inference_mode():
            assert torch.equal(got, runner.model.compute_logits(hidden))
    assert run.finished and run.logits.shape == (3, runner.model_config.vocab_size)


def test_a_prompt_range_read_twice_or_out_of_order_is_refused(runner):
    run = StepRun(runner, runner.plan(_sched())[0])
    _read_second_only(run)
    with pytest.raises(AssertionError, match="prompt range 0 was read already"):
        next(iter(run.prompt_logits(run.prompt_hidden[0])))
