"""Per-request sampling parameters, validated on construction. Torch-free: the router builds them,
they cross the wire as they are (protocol.codec builds and so re-validates them on decode), and
the engine samples by them (``from engine import SamplingParams`` names this class)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from protocol.codec import SIGNED

MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1  # independent samples of the same prompt (they share its KV blocks)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None (or 0 / -1) keeps all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    seed: Annotated[int, SIGNED] | None = None  # per-request RNG seed: same seed, same output
    presence_penalty: float = 0.0  # OpenAI: subtract once per token seen in the output
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and output tokens
    max_tokens: int | None = 16  # output tokens; None means up to the model's context
    min_tokens: int = 0  # suppress EOS and stop tokens until this many were produced
    stop: tuple[str, ...] = ()  # stop strings; the output is cut before the first match
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token
    logprobs: int | None = None  # number of top alternatives to return per token (0 = chosen only)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.stop, str):
            set_(self, "stop", (self.stop,))
        elif self.stop is None:
            set_(self, "stop", ())
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            set_(self, "stop", tuple(self.stop))
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if not all(self.stop):
            raise ValueError("stop strings must not be empty")
        set_(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.top_k is not None and self.top_k in (0, -1):
            set_(self, "top_k", None)
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or 0 / -1 / None to disable), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not -(1 << 63) <= self.seed < 1 << 63
        ):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
