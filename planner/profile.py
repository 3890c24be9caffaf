"""A calibration profile: how long the engine takes for a prefill, a decode step and a KV transfer.

    prefill_s(n)          one forward pass over n prompt tokens (piecewise linear in n)
    decode_step_s(b, c)   one continuous-batching step of b sequences holding c context tokens in all,
                          interpolated on the measured (batch x context per sequence) grid
    transfer_s(bytes)     a prefill node -> decode node KV transfer on this host: base + per_byte * bytes
    step_tokens           the tokens one engine step computes at most (its step-time target's budget)

Torch-free: ``pdserve plan simulate`` reads it; ``pdserve plan calibrate`` writes it.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import pathlib
from typing import Any

from pdserve.engine.core.step_budget import AUTO_MAX_STEP_S  # torch-free

VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class PiecewiseLinear:
    """y(x) through measured points; past the ends, the end segment's slope; never below 0."""

    xs: tuple[float, ...]  # ascending
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or len(self.xs) < 2 or list(self.xs) != sorted(set(self.xs)):
            raise ValueError("a piecewise-linear curve needs >= 2 points with distinct ascending xs")

    def __call__(self, x: float) -> float:
        return _interpolate(self.xs, self.ys, x)


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """PiecewiseLinear's y(x), for points already checked (the simulator calls it per step)."""
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)  # segment [i-1, i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeStepGrid:
    """Step seconds measured on a (batch size x context per sequence) grid, interpolated between
    the points (piecewise linear in the batch, then in the mean context) and extended past them."""

    batches: tuple[float, ...]  # running sequences, ascending (>= 2)
    contexts: tuple[float, ...]  # context tokens per sequence, ascending (>= 2)
    seconds: tuple[tuple[float, ...], ...]  # [context index][batch index]

    def __post_init__(self) -> None:
        if len(self.seconds) != len(self.contexts) or any(
            len(row) != len(self.batches) for row in self.seconds
        ):
            raise ValueError("the decode grid needs one row per context and one column per batch size")
        PiecewiseLinear(self.batches, self.seconds[0])  # checks the axes
        PiecewiseLinear(self.contexts, tuple(row[0] for row in self.seconds))

    def __call__(self, num_seqs: int, num_context_tokens: int) -> float:
        if num_seqs == 0:
            return 0.0
        by_context = tuple(_interpolate(self.batches, row, num_seqs) for row in self.seconds)
        return _interpolate(self.contexts, by_context, num_context_tokens / num_seqs)

    @classmethod
    def constant(cls, seconds: float) -> DecodeStepGrid:
        """Every step takes ``seconds`` (for hand-checked models)."""
        return cls((1.0, 2.0), (1.0, 2.0), ((seconds, seconds), (seconds, seconds)))


@dataclasses.dataclass(frozen=True, slots=True)
class TransferModel:
    base_s: float  # reserve -> grant -> done handshake
    per_byte_s: float  # seconds per KV byte moved

    def __call__(self, num_bytes: int) -> float:
        return max(0.0, self.base_s + self.per_byte_s * num_bytes)

    @classmethod
    def through(cls, small: tuple[int, float], large: tuple[int, float]) -> TransferModel:
        """The line through two (bytes, seconds) measurements."""
        (b0, t0), (b1, t1) = small, large
        slope = max(0.0, (t1 - t0) / (b1 - b0))
        return cls(max(0.0, t0 - slope * b0), slope)


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    model: str  # model folder name it was measured on
    threads: int  # torch threads of the measuring process (a node's share of the cores)
    kv_bytes_per_token: int  # KV cache bytes one token takes (all layers, K and V)
    max_num_batched_tokens: int  # the engine's token budget per step
    max_num_seqs: int  # the engine's running-batch cap
    prefill: PiecewiseLinear  # prompt tokens -> seconds
    decode: DecodeStepGrid  # (running sequences, their context tokens) -> step seconds
    transfer: TransferModel
    measured: dict[str, Any] = dataclasses.field(default_factory=dict)  # raw samples, for the record
    max_step_s: float | None = None  # the engine's step-time target (None: derived, as the engine does)

    def prefill_s(self, num_tokens: int) -> float:
        return self.prefill(num_tokens) if num_tokens > 0 else 0.0

    @property
    def step_target_s(self) -> float:
        """The engine's step-time target: given, or derived from the speed as the engine does."""
        if self.max_step_s is not None:
            return self.max_step_s
        return min(AUTO_MAX_STEP_S, self.prefill_s(self.max_num_batched_tokens))

    @property
    def min_step_tokens(self) -> int:
        """The step budget's floor (the engine's: a token per sequence and a block more)."""
        return min(self.max_num_batched_tokens, self.max_num_seqs + 16)

    @property
    def step_tokens(self) -> int:
        """Tokens a step computes at most, prompt chunks and decode rows together: the engine's
        step budget where it settles (engine.step_budget), the prompt length whose prefill takes
        the step-time target, within ``max_num_batched_tokens``."""
        return max(self.min_step_tokens, self.prefill_tokens_within(self.step_target_s))

    def prefill_tokens_within(self, seconds: float) -> int:
        """The most prompt tokens one prefill computes in ``seconds`` (0 to max_num_batched_tokens)."""
        lo, hi = 0, self.max_num_batched_tokens  # prefill_s grows with n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.prefill_s(mid) <= seconds else (lo, mid - 1)
        return lo

    def with_prefill_scale(self, scale: float) -> Profile:
        """This profile with every prefill ``scale`` times as long (planner.correction's fit)."""
        if scale == 1.0:
            return self
        ys = tuple(y * scale for y in self.prefill.ys)
        return dataclasses.replace(self, prefill=PiecewiseLinear(self.prefill.xs, ys))

    def transfer_s(self, num_prompt_tokens: int) -> float:
        return self.transfer(num_prompt_tokens * self.kv_bytes_per_token)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Profile:
        if body.get("version") != VERSION:
            raise ValueError(f"profile version {body.get('version')!r}, this pdserve reads {VERSION}")
        return cls(
            model=body["model"],
            threads=body["threads"],
            kv_bytes_per_token=body["kv_bytes_per_token"],
            max_num_batched_tokens=body["max_num_batched_tokens"],
            max_num_seqs=body["max_num_seqs"],
            prefill=PiecewiseLinear(tuple(body["prefill"]["xs"]), tuple(body["prefill"]["ys"])),
            decode=DecodeStepGrid(
                tuple(body["decode"]["batches"]),
                tuple(body["decode"]["contexts"]),
                tuple(tuple(row) for row in body["decode"]["seconds"]),
            ),
            transfer=TransferModel(**body["transfer"]),
            measured=body.get("measured", {}),
            max_step_s=body.get("max_step_s"),  # profiles written before it: derived
        )

    def save(self, path: pathlib.Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: pathlib.Path) -> Profile:
        return cls.from_json(json.loads(path.read_text()))
