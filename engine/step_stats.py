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

from protocol.registry import STEP_BUCKETS_S

KINDS = ("prefill", "decode", "mixed")
BUCKETS_S = STEP_BUCKETS_S  # the step-time buckets, part of the node record's contract


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


class StepStats:
    def __init__(self) -> None:
        self.by_kind = {kind: StepCounts() for kind in KINDS}

    def observe(self, prompt: int, decode: int, seconds: float) -> None:
        """One step that computed ``prompt`` prompt tokens and ``decode`` decode rows (step_tokens)."""
        if prompt + decode == 0:
            return
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
