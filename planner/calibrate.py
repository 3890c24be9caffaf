"""Measure the engine offline for a profile: prefill by prompt length, decode steps by batch and context.

    prefill:  for each length n, one request of n random ids, max_tokens 1: the step that computes it
              (best of ``repeats``, fresh ids each time, prefix caching off)
    decode:   for each context c, ``max(batches)`` requests of c tokens prefilled, then for each batch
              size b (largest first, aborting the surplus) the best of a few steps; the grid's
              context axis is the nominal c (the few tokens generated meanwhile are left out)

Runs in this process with ``threads`` torch threads (set it to a node's share of the cores). Every
figure is a best-of: on a shared machine other work only ever adds time, so the profile describes
the engine with the cores to itself, and predictions from it are lower bounds under load.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence

from pdserve.planner.profile import DecodeStepGrid, PiecewiseLinear

NUM_DECODE_STEPS = 5  # timed steps per (batch, context) point
# Tokens a decode context leaves below the model's limit: the early prompts decode while the later
# ones prefill, then 1 + NUM_DECODE_STEPS steps per batch size (``_decode_points``)
DECODE_HEADROOM = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Grid:
    prefill_lens: tuple[int, ...] = (16, 64, 128, 256, 512)  # prompt tokens
    decode_batches: tuple[int, ...] = (1, 4, 16)  # running sequences
    decode_contexts: tuple[int, ...] = (64, 512)  # prompt tokens of each sequence
    repeats: int = 2  # prefill timings per length (the best counts)

    def __post_init__(self) -> None:
        if (
            len(self.prefill_lens) < 2
            or min(self.prefill_lens) < 1
            or len(set(self.prefill_lens)) != len(self.prefill_lens)
        ):
            raise ValueError("need >= 2 distinct positive prefill lengths")
        for axis in (self.decode_batches, self.decode_contexts):
            if len(set(axis)) != len(axis) or len(axis) < 2 or min(axis) < 1:
                raise ValueError("decode batches and contexts: >= 2 distinct positive values each")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")

    def within(self, max_model_len: int) -> Grid:
        """This grid with its prompts cut to what a model of ``max_model_len`` tokens takes: a
        prefill prompt leaves room for its one token, a decode context for the steps timed on
        it (DECODE_HEADROOM). Lengths a model cannot take are never asked of it. ValueError
        when fewer than two distinct lengths are left on an axis."""
        prefill = sorted({min(n, max_model_len - 1) for n in self.prefill_lens})
        contexts = sorted({min(c, max_model_len - DECODE_HEADROOM) for c in self.decode_contexts})
        if len(prefill) < 2 or min(contexts) < 1 or len(contexts) < 2:
            raise ValueError(
                f"a model context of {max_model_len} tokens is too short to calibrate "
                f"(prompts {list(self.prefill_lens)}, decode contexts {list(self.decode_contexts)} "
                f"+ {DECODE_HEADROOM} tokens generated)"
            )
        return dataclasses.replace(self, prefill_lens=tuple(prefill), decode_contexts=tuple(contexts))


@dataclasses.dataclass(frozen=True, slots=True)
class EngineTimings:
    prefill: PiecewiseLinear
    decode: DecodeStepGrid
    prefill_samples: tuple[tuple[int, float], ...]  # (prompt tokens, seconds)
    decode_samples: tuple[tuple[int, int, float], ...]  # (batch, context tokens in all, seconds)


def measure_engine(engine, grid: Grid, say: Callable[[str], None] = print) -> EngineTimings:
    """``engine``: an LLMEngine with prefix caching off and room for max(batches) x max(contexts)."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    draw = lambda n: [rng.randrange(100, min(vocab, 10000)) for _ in range(n)]  # noqa: E731
    _prefill_once(engine, draw(32))  # warm-up: first-call allocations
    prefill_samples = []
    for n in sorted(grid.prefill_lens):
        best = min(_prefill_once(engine, draw(n)) for _ in range(grid.repeats))
        prefill_samples.append((n, best))
        say(f"prefill {n:5d} tokens: {best * 1e3:8.1f} ms")
    decode_samples, rows = [], []
    batches, contexts = sorted(grid.decode_batches), sorted(grid.decode_contexts)
    for context in contexts:
        points = _decode_points(engine, [draw(context) for _ in range(batches[-1])], batches[::-1])
        for batch, num_context, seconds in points:
            decode_samples.append((batch, num_context, seconds))
            say(f"decode batch {batch:3d} x context {context:5d}: {seconds * 1e3:8.1f} ms/step")
        rows.append(tuple(seconds for _, _, seconds in points[::-1]))  # ascending batch
    xs, ys = zip(*prefill_samples, strict=True)
    decode = DecodeStepGrid(tuple(float(b) for b in batches), tuple(float(c) for c in contexts), tuple(rows))
    return EngineTimings(
        PiecewiseLinear(tuple(float(x) for x in xs), tuple(ys)),
        decode,
        tuple(prefill_samples),
        tuple(decode_samples),
    )


def _params(max_tokens: int | None):
    from pdserve.protocol.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


_ids = iter(range(1 << 62))


def _prefill_once(engine, prompt: list[int]) -> float:
    """Seconds for the steps that prefill ``prompt`` and sample its one token (one step within the budget)."""
    engine.add_request(f"cal-{next(_ids)}", prompt, _params(1))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def _decode_points(
    engine, prompts: Sequence[list[int]], batches: Sequence[int]
) -> list[tuple[int, int, float]]:
    """(batch, context tokens in all, best step seconds) for each batch size, largest first."""
    request_ids = [f"cal-{next(_ids)}" for _ in prompts]
    # Up to the context limit: the early prompts decode while the later ones prefill, for as many
    # steps as the step budget cuts the prompts into (more on a slower machine); a fixed count
    # let them finish before the last batch was timed. All are aborted at the end.
    for rid, prompt in zip(request_ids, prompts, strict=True):
        engine.add_request(rid, prompt, _params(None))
    while any(
        len(engine.requests[r].seqs[0].token_ids) == len(p) for r, p in zip(request_ids, prompts, strict=True)
    ):
        engine.step()  # until every prompt is prefilled (its first token sampled)
    points = []
    for batch in batches:
        for rid in request_ids[batch:]:
            engine.abort_request(rid)
        engine.step()  # the first step after a batch change pays for the new shapes
        times = []
        for _ in range(NUM_DECODE_STEPS):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        num_context = sum(engine.requests[r].seqs[0].num_tokens for r in request_ids[:batch])
        points.append((batch, num_context, min(times)))
    for rid in request_ids:
        engine.abort_request(rid)
    return points
