"""A run's figures from its records: throughput, latency distributions, goodput, errors.

Definitions (every latency is measured at the client, from the moment the request is sent):
    TTFT   first event carrying an output token
    TPOT   (end-to-end - TTFT) / (n - 1), n = output tokens counted in the stream (n >= 2)
    ITL    gap between consecutive events that carried output tokens
    E2E    end of the stream ([DONE])
    goodput  requests per second that completed with TTFT <= its target and TPOT <= its target
             (a one-token reply has no TPOT and meets that target)
Percentiles interpolate linearly between the two nearest ranks (numpy's default method).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

from pdserve.bench_serve.records import RequestRecord


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of non-empty ``values``, linearly interpolated."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclasses.dataclass(frozen=True, slots=True)
class Stats:
    """One latency's distribution over a run, in seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats | None:
        if not values:
            return None
        return cls(
            len(values),
            sum(values) / len(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Slo:
    """The service-level targets goodput counts against."""

    ttft_s: float
    tpot_s: float

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok or record.ttft_s is None or record.ttft_s > self.ttft_s:
            return False
        return record.tpot_s is None or record.tpot_s <= self.tpot_s


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    num_sent: int  # requests sent
    num_ok: int  # of them, completed
    duration_s: float  # run start -> the last request's end
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens (counted in the stream, completed requests) per second
    total_output_tokens: int
    total_prompt_tokens: int  # exact for token-id prompts, else as the server's usage reported
    total_cached_tokens: int  # prompt tokens the server's usage says came from its prefix cache
    ttft: Stats | None
    tpot: Stats | None
    itl: Stats | None
    e2e: Stats | None
    goodput: float  # completed requests per second that met the SLO
    slo: Slo
    errors: dict[str, int]  # error kind -> requests
    num_usage_mismatch: int  # completed requests whose usage.completion_tokens != the counted tokens
    num_usage_missing: int  # completed requests whose stream carried no usage
    num_logprobs_missing: int  # completed requests with events that lacked the logprobs asked for
    num_off_length: int  # completed requests with more or fewer tokens than requested (with ignore_eos: none)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> Summary:
    ok = [r for r in records if r.ok]
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    total_output = sum(r.num_output_tokens for r in ok)
    return Summary(
        num_sent=len(records),
        num_ok=len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) * per_second,
        output_throughput=total_output * per_second,
        total_output_tokens=total_output,
        total_prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        total_cached_tokens=sum(r.usage_cached_tokens or 0 for r in ok),
        ttft=Stats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Stats.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=Stats.of([gap for r in ok for gap in r.itl_s]),
        e2e=Stats.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        goodput=sum(slo.met_by(r) for r in ok) * per_second,
        slo=slo,
        errors=dict(sorted(collections.Counter(r.error_kind for r in records if not r.ok).items())),
        num_usage_mismatch=sum(r.usage_mismatch for r in ok),
        num_usage_missing=sum(r.usage_completion_tokens is None for r in ok),
        num_logprobs_missing=sum(r.events_without_logprobs > 0 for r in ok),
        num_off_length=sum(r.num_output_tokens != r.requested_tokens for r in ok),
    )
