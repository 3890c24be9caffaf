"""From a workload to predicted figures: bench_serve's workloads and arrivals in, its Summary out.

The simulated requests become bench_serve ``RequestRecord``s (one token per event, sent at their
arrival), so a prediction and a measured ``pdserve bench serve`` run are summarized by the same
code, with the same TTFT / TPOT / goodput definitions.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.bench_serve.arrivals import Arrivals
from pdserve.bench_serve.metrics import Slo, Summary, summarize
from pdserve.bench_serve.records import RequestRecord
from pdserve.bench_serve.workload import WorkItem, prompt_len
from pdserve.planner.profile import Profile
from pdserve.planner.simulate import Cluster, SimOutcome, SimRequest, simulate


def sim_requests(
    items: Sequence[WorkItem], rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[SimRequest]:
    """The requests ``pdserve bench serve`` would send for these items at this rate and seed."""
    times = Arrivals(rate, burstiness, seed).send_times(len(items))
    requests = []
    for item, arrival in zip(items, times, strict=True):
        num = prompt_len(item.prompt)
        if num is None:
            raise ValueError(
                "the simulator needs token-id prompts (exact lengths): completions without --text-prompts"
            )
        requests.append(
            SimRequest(item.arrival_s if item.arrival_s is not None else arrival, num, item.output_len)
        )
    return requests


def to_record(index: int, outcome: SimOutcome) -> RequestRecord:
    req = outcome.request
    if outcome.shed:  # as the client records a 429
        return RequestRecord(
            index=index,
            conversation=None,
            turn=0,
            ok=False,
            error_kind="http_429",
            error="shed by the TTFT SLO (predicted)",
            sent_s=req.arrival_s,
            ttft_s=None,
            e2e_s=None,
            token_times_s=(),
            event_tokens=(),
            requested_tokens=req.output_len,
            prompt_tokens=req.prompt_len,
            usage_completion_tokens=None,
            usage_cached_tokens=None,
            finish_reason=None,
        )
    times = tuple(t - req.arrival_s for t in outcome.token_times_s)
    return RequestRecord(
        index=index,
        conversation=None,
        turn=0,
        ok=True,
        error_kind=None,
        error=None,
        sent_s=req.arrival_s,
        ttft_s=times[0],
        e2e_s=times[-1],
        token_times_s=times,
        event_tokens=(1,) * len(times),
        requested_tokens=req.output_len,
        prompt_tokens=req.prompt_len,
        usage_completion_tokens=len(times),
        usage_cached_tokens=0,
        finish_reason="length",
    )


def predict(
    profile: Profile, cluster: Cluster, requests: Sequence[SimRequest], slo: Slo, slo_flags: bool = True
) -> Summary:
    """``slo_flags``: the cluster runs with ``slo`` as its SLO flags (`pdserve up --ttft-slo-s
    --tpot-slo-s`, as --autoscale always does): its router sheds by them (planner.simulate)."""
    outcomes = simulate(profile, cluster, requests, slo if slo_flags else None)
    records = [to_record(i, o) for i, o in enumerate(outcomes)]
    start = min(r.arrival_s for r in requests)
    duration = max(o.token_times_s[-1] if o.token_times_s else o.request.arrival_s for o in outcomes) - start
    return summarize(records, duration, slo)


def slo_fraction(summary: Summary) -> float:
    """Share of the requests that met both targets."""
    return summary.goodput * summary.duration_s / summary.num_sent if summary.num_sent else 0.0


def table(label: str, summary: Summary) -> str:
    """A prediction as lines of text (the figures of ``pdserve bench serve``'s table)."""
    s = summary
    lines = [
        f"== {label} ".ljust(60, "="),
        f"throughput    {s.request_throughput:.3f} req/s, {s.output_throughput:.1f} output tok/s over {s.duration_s:.1f} s",
        f"goodput       {s.goodput:.3f} req/s, {100 * slo_fraction(s):.0f}% of requests "
        f"(TTFT <= {s.slo.ttft_s * 1e3:g} ms and TPOT <= {s.slo.tpot_s * 1e3:g} ms)",
        f"{'':14}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}   ms",
    ]
    for name, stats in (("TTFT", s.ttft), ("TPOT", s.tpot), ("E2E", s.e2e)):
        cells = (
            "".join(f"{v * 1e3:9.1f}" for v in (stats.mean, stats.p50, stats.p90, stats.p99))
            if stats
            else "-"
        )
        lines.append(f"{name:14}{cells}")
    return "\n".join(lines)
