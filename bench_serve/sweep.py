"""A bench: one run per request rate, each measured and summarized on its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pdserve.bench_serve import runner, server_steps
from pdserve.bench_serve.arrivals import Arrivals, replayed_times
from pdserve.bench_serve.client import Endpoint
from pdserve.bench_serve.metrics import Slo, summarize
from pdserve.bench_serve.report import RunReport, table
from pdserve.bench_serve.spec import WorkloadSpec
from pdserve.bench_serve.workload import WorkItem


@dataclasses.dataclass(frozen=True, slots=True)
class SweepSpec:
    rates: tuple[float, ...]  # one run per rate, in this order; math.inf: all at once
    burstiness: float  # gamma shape of the gaps (1.0: Poisson)
    limits: runner.Limits  # concurrency cap and time bounds of every run
    slo: Slo  # what goodput counts against
    seed: int  # run k uses seed + k for its prompts and its arrivals
    warmup: int = 0  # requests sent before the first run, all at once under the concurrency cap; not counted
    warmup_max_s: float = 300.0  # the warm-up's own bound on sending

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warm-up requests must be >= 0, got {self.warmup}")


WARMUP_SEED = 1_000_003  # added to the seed: prompts no run of a sweep draws, so none hits a warm-up's prefix


def send_times(items: list[WorkItem], rate: float, burstiness: float, seed: int, max_s: float) -> list[float]:
    """A replayed trace keeps its own arrival times; anything else gets the arrival process's."""
    if items and all(item.arrival_s is not None for item in items):
        return replayed_times(
            [item.arrival_s for item in items if item.arrival_s is not None], len(items), max_s
        )
    return Arrivals(rate, burstiness, seed).send_times(len(items), max_s)


def sweep(
    workload: WorkloadSpec,
    spec: SweepSpec,
    endpoint: Endpoint,
    progress: bool = True,
    say: Callable[[str], None] = print,
) -> list[RunReport]:
    """Each run draws fresh prompts (seed + k) so that no run hits prefixes an earlier run cached.
    A warm-up first sends ``spec.warmup`` requests of the workload drawn from another seed, so
    that a fresh server's first-touch costs (memory pages, lazy compiles, caches) are paid before
    anything is measured; its results count nowhere."""
    if spec.warmup > 0:
        warm(workload, spec, endpoint, progress, say)
    reports = []
    for k, rate in enumerate(spec.rates):
        items = workload.build(spec.seed + k)
        for item in items:
            endpoint.body(item)  # a prompt the endpoint cannot take fails here, before anything is sent
        times = send_times(items, rate, spec.burstiness, spec.seed + k, spec.limits.max_s)
        before = server_steps.settled(endpoint.base_url, endpoint.api_key)  # None: not a pdserve server
        result = runner.run(items, times, endpoint, spec.limits, progress)
        after = server_steps.settled(endpoint.base_url, endpoint.api_key) if before is not None else None
        steps = (
            tuple(server_steps.difference(before, after)) if before is not None and after is not None else ()
        )
        summary = summarize(result.records, result.duration_s, spec.slo)
        report = RunReport(rate, spec.limits.max_concurrency, summary, result, steps)
        say(table(report))
        reports.append(report)
    return reports


def warm(
    workload: WorkloadSpec,
    spec: SweepSpec,
    endpoint: Endpoint,
    progress: bool = True,
    say: Callable[[str], None] = print,
) -> runner.RunResult:
    items = workload.build(spec.seed + WARMUP_SEED)[: spec.warmup]
    for item in items:
        endpoint.body(item)
    limits = dataclasses.replace(spec.limits, max_s=spec.warmup_max_s)
    result = runner.run(items, [0.0] * len(items), endpoint, limits, progress)
    failed = sum(1 for r in result.records if not r.ok)
    say(
        f"warm-up: {len(result.records)} requests in {result.duration_s:.1f} s, {failed} failed (not counted)"
    )
    return result
