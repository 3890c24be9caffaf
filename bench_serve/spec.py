"""What a bench is asked to do, as validated frozen dataclasses (the CLI flags map onto them)."""

from __future__ import annotations

import dataclasses
import enum
import math
import pathlib

from pdserve.bench_serve import trace, workload
from pdserve.bench_serve.client import Api
from pdserve.bench_serve.workload import LengthMix, PromptStyle, TokenSpace, WorkItem


class WorkloadKind(enum.Enum):
    FIXED = "fixed"  # num_requests prompts of input_len, output_len each
    MIX = "mix"  # long-tailed lengths around input_len / output_len
    SHARED_PREFIX = "shared-prefix"  # num_groups system prompts x questions_per_group questions
    MULTI_TURN = "multi-turn"  # num_conversations x num_turns, each turn resending the history
    FILE = "file"  # a JSONL workload file (see bench_serve.trace)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadSpec:
    kind: WorkloadKind
    style: PromptStyle  # TOKEN_IDS or TEXT for completions, CHAT for chat
    num_requests: int  # at most this many requests per run
    input_len: int = 128  # fixed: prompt tokens; mix: median; shared-prefix: question; multi-turn: user turn
    output_len: int = 64  # fixed, shared-prefix, multi-turn: tokens per reply; mix: median
    min_input_len: int = 16  # mix only
    max_input_len: int = 1024  # mix only
    min_output_len: int = 8  # mix only
    max_output_len: int = 256  # mix only
    length_sigma: float = 0.8  # mix: spread of log(length)
    num_groups: int = 4  # shared-prefix
    questions_per_group: int = 8  # shared-prefix
    prefix_len: int = 256  # shared-prefix: system prompt tokens
    num_conversations: int = 4  # multi-turn
    num_turns: int = 4  # multi-turn
    token_ids: TokenSpace = TokenSpace()  # where random prompt ids are drawn from
    path: pathlib.Path | None = None  # file only

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if (
            min(
                self.input_len,
                self.output_len,
                self.num_groups,
                self.questions_per_group,
                self.prefix_len,
                self.num_conversations,
                self.num_turns,
            )
            < 1
        ):
            raise ValueError("lengths and counts of a workload must be >= 1")
        if (self.kind is WorkloadKind.FILE) != (self.path is not None):
            raise ValueError("--workload file goes with --workload-file PATH, and only it")
        if self.kind is WorkloadKind.MIX:
            self.input_mix()  # LengthMix checks its bounds
            self.output_mix()

    def input_mix(self) -> LengthMix:
        return LengthMix(self.input_len, self.length_sigma, self.min_input_len, self.max_input_len)

    def output_mix(self) -> LengthMix:
        return LengthMix(self.output_len, self.length_sigma, self.min_output_len, self.max_output_len)

    def build(self, seed: int) -> list[WorkItem]:
        """The workload's items (at most num_requests), the same for the same seed."""
        return self._all(seed)[: self.num_requests]

    def _all(self, seed: int) -> list[WorkItem]:
        k, n, style, ids = self.kind, self.num_requests, self.style, self.token_ids
        if k is WorkloadKind.FIXED:
            return workload.fixed(n, self.input_len, self.output_len, style, seed, ids)
        if k is WorkloadKind.MIX:
            return workload.mix(n, self.input_mix(), self.output_mix(), style, seed, ids)
        if k is WorkloadKind.SHARED_PREFIX:
            return workload.shared_prefix(
                self.num_groups,
                self.questions_per_group,
                self.prefix_len,
                self.input_len,
                self.output_len,
                style,
                seed,
                ids,
            )
        if k is WorkloadKind.MULTI_TURN:
            return workload.multi_turn(
                self.num_conversations, self.num_turns, self.input_len, self.output_len, style, seed, ids
            )
        assert self.path is not None
        return trace.read(self.path)


def style_for(api: Api, text: bool) -> PromptStyle:
    """Chat takes messages; completions take token ids (exact lengths) unless text is asked for."""
    if api is Api.CHAT:
        return PromptStyle.CHAT
    return PromptStyle.TEXT if text else PromptStyle.TOKEN_IDS


def parse_rates(text: str) -> tuple[float, ...]:
    """``"0.5,1,2"`` -> (0.5, 1.0, 2.0); ``inf`` sends everything at once."""
    rates = tuple(
        math.inf if part.strip() == "inf" else float(part) for part in text.split(",") if part.strip()
    )
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be positive numbers or inf, got {text!r}")
    return rates
