"""The token budget of each step, so that no step runs much past a time target.

A step's time grows with the tokens it computes. The engine feeds every step that computed
prompt tokens to ``observe``; ``tokens`` is the budget of the next step: the target over the
measured seconds per token, within [``min_tokens``, ``max_tokens``]. The measure is a ratio of
decayed sums (seconds over tokens), so large steps weigh most and a machine that slows down
(another process on its cores) shrinks the next chunks within a few steps.

A fixed cost per step makes small steps look slower per token, which shrinks the next chunk,
whose step is then closer to the target: with step = a + b*n the budget settles at n = (T - a) / b,
the chunk that takes the target (the update's slope there is a / T < 1, so it converges).

``target_s`` None: derived from the first measure, the time the full ``max_tokens`` budget
takes at that speed, at most ``AUTO_MAX_STEP_S``: steps then never get longer than the first
ones would have on that machine, and on a slow one they stay under a second.

A node may keep a second budget for the steps that carry running decodes beside prompt chunks
(``--max-decode-step-seconds``): those steps' time is every running request's time per token
while prompts are prefilled beside it, so a TPOT SLO bounds them, where prompt-only steps may run
to the longer target that prefills fastest. ``pdserve up --tpot-slo-s`` sets it on every node to
``TPOT_SLO_STEP_SHARE`` of the SLO, leaving the rest for the steps' spread. Torch-free.
"""

from __future__ import annotations

AUTO_MAX_STEP_S = 1.0  # the derived target's ceiling
TPOT_SLO_STEP_SHARE = 0.8  # `pdserve up --tpot-slo-s`: the decode-step target, as a share of the SLO
MIN_MEASURED_TOKENS = 64  # the first measure needs a step at least this large
DECAY = 0.7  # weight of the past at each observed step


class StepBudget:
    def __init__(self, target_s: float | None, max_tokens: int, min_tokens: int) -> None:
        assert target_s is None or target_s > 0, "the step-time target must be positive"
        assert 0 < min_tokens <= max_tokens
        self.target_s = target_s  # None until derived
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self._seconds = 0.0  # decayed sum of observed step seconds
        self._tokens = 0.0  # decayed sum of their tokens

    @property
    def seconds_per_token(self) -> float | None:
        return self._seconds / self._tokens if self._tokens else None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step that computed prompt tokens: ``num_tokens`` in all (decode rows included)."""
        if self._tokens == 0 and num_tokens < MIN_MEASURED_TOKENS:
            return
        self._seconds = DECAY * self._seconds + seconds
        self._tokens = DECAY * self._tokens + num_tokens
        if self.target_s is None:
            self.target_s = min(AUTO_MAX_STEP_S, self.max_tokens * self._seconds / self._tokens)

    def tokens(self, fallback_per_token: float | None = None) -> int:
        """The next step's token budget (at ``fallback_per_token`` seconds a token while this
        budget has measured none)."""
        per_token = self.seconds_per_token or fallback_per_token
        if per_token is None or self.target_s is None or per_token <= 0:
            return self.max_tokens
        return max(self.min_tokens, min(self.max_tokens, int(self.target_s / per_token)))


class StepBudgets:
    """A node's budgets: every step's, and, with ``decode_target_s``, that of the steps that
    carry running decodes beside prompt chunks (measured on such steps only; until one ran, at the
    speed of the others)."""

    def __init__(
        self, target_s: float | None, decode_target_s: float | None, max_tokens: int, min_tokens: int
    ) -> None:
        self.steps = StepBudget(target_s, max_tokens, min_tokens)
        self.decode_steps = (
            None if decode_target_s is None else StepBudget(decode_target_s, max_tokens, min_tokens)
        )

    def tokens(self, decoding: bool) -> int:
        """The next step's token budget; ``decoding``: running requests decode in it."""
        budget = self.steps.tokens()
        if not decoding or self.decode_steps is None:
            return budget
        return min(budget, self.decode_steps.tokens(self.steps.seconds_per_token))

    def observe(self, prompt_tokens: int, decode_tokens: int, seconds: float) -> None:
        """A step that computed prompt tokens, and the decode rows beside them."""
        self.steps.observe(prompt_tokens + decode_tokens, seconds)
        if decode_tokens and self.decode_steps is not None:
            self.decode_steps.observe(prompt_tokens + decode_tokens, seconds)

    @property
    def target_s(self) -> float | None:
        """What a running request's time per token stretches to while prompts are prefilled
        beside it; None until known."""
        budgets = (self.steps, self.decode_steps)
        return min((b.target_s for b in budgets if b is not None and b.target_s), default=None)
