"""Counts of the engine's steps, by kind, for a node's metrics.

A step's kind follows from the rows it computed:

    prefill   prompt tokens only (chunks of prompts, recomputed preempted ones included)
    decode    decode rows only (one token of a sequence whose prompt is in the cache)
    mixed     both in one forward pass (continuous batching with chunked prefill)

Every count is cumulative from the engine's start, so a scraper takes differences: the mean step
time of a window is its seconds over its steps, and the histogram's buckets give the tail. Step
time is what a sequence's time per output token is made of, so a node whose TPOT is high shows
here whether its steps are slow or mostly mixed. Torch-free; the engine calls ``observe``.
"""

from __future__ import annotations

import bisect
import dataclasses

from pdserve.protocol.registry import STEP_BUCKETS_S

KINDS = ("prefill", "decode", "mixed")
BUCKETS_S = STEP_BUCKETS_S  # the step-time buckets, part of the node record's contract
# The prefill speed counts steps with at least this many prompt tokens: a queue long enough to
# wait for drains in steps of many tokens, and a step of a few (a short prompt beside the running
# decodes) measures the step's fixed cost and those decodes, not how fast prompts go. Counting
# them put a decode node's speed at 225-300 tokens/s where its large steps ran 8,000-20,000, and
# the router then shed new requests after a kill moved a dead node's requests onto it.
RATE_MIN_PROMPT_TOKENS = 64
# The prompt a node times before it serves (LLMEngine.warm_up): a chunk's size, for
# the speed a queue drains at. Before it, a node reported no speed until its first large step, and
# a router under a TTFT SLO shed a fresh cluster's first burst behind "a speed nobody measured".
PREFILL_PROBE_TOKENS = 256


@dataclasses.dataclass(slots=True)
class StepCounts:
    steps: int = 0  # steps of this kind
    seconds: float = 0.0  # their wall time, scheduling to outputs
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits are not computed)
    decode_tokens: int = 0  # decode rows: one token each
    buckets: list[int] = dataclasses.field(default_factory=lambda: [0] * len(BUCKETS_S))  # non-cumulative

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def step_tokens(scheduled) -> tuple[int, int]:
    """(prompt tokens, decode rows) of a step's ``ScheduledSeq`` items, taken before the engine
    counts them computed (a sequence that finishes frees its blocks and its count with them). A
    row is a decode when its sequence's whole prompt is already in the cache."""
    prompt = decode = 0
    for item in scheduled:
        if item.seq.num_computed_tokens >= item.seq.num_prompt_tokens:
            decode += item.num_new_tokens
        else:
            prompt += item.num_new_tokens
    return prompt, decode


class PrefillRate:
    """Prompt tokens computed per second of engine step: a decaying average over recent steps of
    at least ``min_tokens`` prompt tokens (decode rows beside them count in their seconds).

    Both sums decay by ``decay`` at every step counted, so the rate follows the node's current
    batch mix within tens of steps and never divides by an idle gap. None until a step counted.
    """

    def __init__(self, decay: float = 0.9, min_tokens: int = RATE_MIN_PROMPT_TOKENS) -> None:
        assert 0.0 < decay < 1.0 and min_tokens >= 1
        self.decay = decay
        self.min_tokens = min_tokens
        self.num_tokens = 0.0  # decayed prompt tokens computed
        self.seconds = 0.0  # decayed seconds of the steps that computed them

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < self.min_tokens or seconds <= 0.0:
            return
        self.num_tokens = self.num_tokens * self.decay + num_tokens
        self.seconds = self.seconds * self.decay + seconds

    def seed(self, num_tokens: int, seconds: float) -> None:
        """A measure taken before any step (``LLMEngine.warm_up``), counted whatever
        its size; the steps that follow decay it."""
        self.num_tokens, self.seconds = float(num_tokens), seconds

    @property
    def tokens_per_s(self) -> float | None:
        return self.num_tokens / self.seconds if self.seconds > 0.0 else None


class StepStats:
    def __init__(self) -> None:
        self.by_kind = {kind: StepCounts() for kind in KINDS}
        self.prefill_rate = PrefillRate()

    def observe(self, prompt: int, decode: int, seconds: float) -> None:
        """One step that computed ``prompt`` prompt tokens and ``decode`` decode rows (step_tokens)."""
        if prompt + decode == 0:
            return
        self.prefill_rate.observe(prompt, seconds)
        counts = self.by_kind["mixed" if prompt and decode else "prefill" if prompt else "decode"]
        counts.steps += 1
        counts.seconds += seconds
        counts.prompt_tokens += prompt
        counts.decode_tokens += decode
        index = bisect.bisect_left(BUCKETS_S, seconds)
        if index < len(BUCKETS_S):
            counts.buckets[index] += 1

    def snapshot(self) -> dict[str, dict]:
        """JSON-safe copy for the node's status record (kinds with no step yet are left out)."""
        return {kind: c.to_dict() for kind, c in self.by_kind.items() if c.steps}
