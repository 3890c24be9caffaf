"""A bench's output: the figures as a text table, and everything (config, summaries, records) as JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

from pdserve.bench_serve.metrics import Stats, Summary
from pdserve.bench_serve.runner import RunResult
from pdserve.bench_serve.server_steps import StepLine, describe


@dataclasses.dataclass(frozen=True, slots=True)
class RunReport:
    """One run of a sweep: how it was driven and what it measured."""

    request_rate: float  # requests per second asked for; math.inf: all at once
    max_concurrency: int | None  # the cap on requests in flight; None: none
    summary: Summary
    result: RunResult
    server_steps: tuple[StepLine, ...] = ()  # a pdserve server's engine steps during the run

    @property
    def label(self) -> str:
        rate = "all at once" if math.isinf(self.request_rate) else f"{self.request_rate:g} req/s"
        cap = f", concurrency {self.max_concurrency}" if self.max_concurrency else ""
        return rate + cap


def to_json(config: dict[str, Any], runs: Sequence[RunReport]) -> dict[str, Any]:
    return {"config": config, "runs": [_run_json(run) for run in runs]}


def _run_json(run: RunReport) -> dict[str, Any]:
    return {
        "request_rate": None if math.isinf(run.request_rate) else run.request_rate,
        "max_concurrency": run.max_concurrency,
        "summary": dataclasses.asdict(run.summary),
        "num_unsent": run.result.num_unsent,
        "server_steps": [dataclasses.asdict(line) for line in run.server_steps],
        "records": [r.to_json() for r in run.result.records],
    }


def write_json(path: pathlib.Path, config: dict[str, Any], runs: Sequence[RunReport]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(config, runs), indent=1) + "\n")


def table(run: RunReport) -> str:
    s = run.summary
    errors = ", ".join(f"{kind} {n}" for kind, n in s.errors.items()) or "none"
    lines = [
        f"== {run.label} ".ljust(60, "="),
        f"requests      {s.num_sent} sent, {s.num_ok} ok, errors: {errors}"
        + (f" ({run.result.num_unsent} not sent before the time limit)" if run.result.num_unsent else ""),
        f"duration      {s.duration_s:.1f} s",
        f"throughput    {s.request_throughput:.3f} req/s, {s.output_throughput:.1f} output tok/s "
        f"({s.total_output_tokens} output, {s.total_prompt_tokens} prompt tokens, {s.total_cached_tokens} of them cached)",
        f"goodput       {s.goodput:.3f} req/s (TTFT <= {s.slo.ttft_s * 1e3:g} ms and TPOT <= {s.slo.tpot_s * 1e3:g} ms)",
        f"{'':14}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}   ms",
        *(
            _stats_line(name, stats)
            for name, stats in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e))
        ),
        f"tokens        counted in the stream; usage disagrees on {s.num_usage_mismatch}, missing on "
        f"{s.num_usage_missing}; {s.num_off_length} not of the requested length"
        + (
            f"; {s.num_logprobs_missing} streamed text without the logprobs asked for"
            if s.num_logprobs_missing
            else ""
        ),
        *describe(list(run.server_steps)),
    ]
    return "\n".join(lines)


def _stats_line(name: str, stats: Stats | None) -> str:
    if stats is None:
        return f"{name:14}{'-':>9}"
    cells = "".join(f"{v * 1e3:9.1f}" for v in (stats.mean, stats.p50, stats.p90, stats.p99))
    return f"{name:14}{cells}"
