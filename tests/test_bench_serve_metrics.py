"""`pdserve bench serve` metrics on hand-made records: exact figures, by their definitions."""

from __future__ import annotations

import pytest

from pdserve.bench_serve.metrics import Slo, percentile, summarize
from pdserve.bench_serve.records import RequestRecord


def record(
    index: int,
    ttft: float | None,
    token_times: tuple[float, ...],
    e2e: float | None,
    event_tokens: tuple[int, ...] | None = None,
    requested: int | None = None,
    usage: int | None = None,
    error_kind: str | None = None,
) -> RequestRecord:
    tokens = event_tokens if event_tokens is not None else (1,) * len(token_times)
    ok = error_kind is None
    return RequestRecord(
        index=index,
        conversation=None,
        turn=0,
        ok=ok,
        error_kind=error_kind,
        error=None if ok else "boom",
        sent_s=float(index),
        ttft_s=ttft,
        e2e_s=e2e,
        token_times_s=token_times,
        event_tokens=tokens,
        requested_tokens=requested if requested is not None else sum(tokens),
        prompt_tokens=10,
        usage_completion_tokens=usage if usage is not None else sum(tokens),
        usage_cached_tokens=4,
        finish_reason="length" if ok else None,
    )


def test_percentile_interpolates_between_ranks_like_numpy_linear():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, ranks 0..3
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5  # rank 1.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_is_end_to_end_minus_ttft_over_tokens_after_the_first():
    # 5 tokens: first at 1.0 s, stream ends at 3.0 s -> (3.0 - 1.0) / 4
    r = record(0, 1.0, (1.0, 1.5, 2.0, 2.5, 2.9), 3.0)
    assert r.tpot_s == pytest.approx(0.5)
    # tokens in fewer events count one by one: 1 + 3 + 1 = 5 tokens
    assert record(0, 1.0, (1.0, 2.0, 2.9), 3.0, event_tokens=(1, 3, 1)).tpot_s == pytest.approx(0.5)


def test_tpot_is_undefined_for_a_one_token_reply():
    assert record(0, 0.4, (0.4,), 0.5).tpot_s is None


def test_itl_is_the_gaps_between_token_events():
    assert record(0, 1.0, (1.0, 1.25, 2.0), 2.0).itl_s == pytest.approx([0.25, 0.75])


def test_summary_throughputs_count_completed_requests_and_streamed_tokens_over_the_duration():
    records = [
        record(0, 1.0, (1.0, 2.0), 2.0),
        record(1, 0.5, (0.5, 1.0, 1.5, 2.0), 2.5),
        record(2, None, (), None, error_kind="http_429"),
    ]
    s = summarize(records, duration_s=4.0, slo=Slo(ttft_s=10.0, tpot_s=10.0))
    assert (s.num_sent, s.num_ok) == (3, 2)
    assert s.request_throughput == 0.5  # 2 ok / 4 s
    assert s.output_throughput == 1.5  # (2 + 4) tokens / 4 s
    assert s.errors == {"http_429": 1}
    assert (s.total_prompt_tokens, s.total_cached_tokens) == (20, 8)
    assert s.ttft.mean == 0.75 and s.ttft.p50 == 0.75
    assert s.e2e.p90 == pytest.approx(2.45)  # sorted 2.0, 2.5: rank 0.9
    assert s.itl.count == 4 and s.itl.mean == pytest.approx((1.0 + 0.5 * 3) / 4)


def test_goodput_counts_requests_meeting_both_the_ttft_and_the_tpot_target():
    records = [
        record(0, 0.5, (0.5, 0.6, 0.7), 0.7),  # ttft 0.5, tpot 0.1: meets both
        record(1, 2.0, (2.0, 2.1, 2.2), 2.2),  # ttft too slow
        record(2, 0.5, (0.5, 1.5, 2.5), 2.5),  # tpot 1.0: too slow
        record(3, 0.9, (0.9,), 1.0),  # one token, no tpot: meets both
        record(4, 0.1, (), None, error_kind="read"),  # failed: never counts
    ]
    s = summarize(records, duration_s=2.0, slo=Slo(ttft_s=1.0, tpot_s=0.5))
    assert s.goodput == 1.0  # 2 requests / 2 s


def test_summary_reports_usage_that_disagrees_with_the_stream_and_off_length_replies():
    records = [
        record(0, 0.1, (0.1, 0.2), 0.2, usage=3),
        record(1, 0.1, (0.1, 0.2), 0.2, requested=4),
        record(2, 0.1, (0.1, 0.2), 0.2),
    ]
    s = summarize(records, duration_s=1.0, slo=Slo(1.0, 1.0))
    assert records[0].usage_mismatch and not records[1].usage_mismatch
    assert (s.num_usage_mismatch, s.num_off_length, s.num_usage_missing) == (1, 1, 0)


def test_a_record_survives_its_json_form():
    r = record(3, 0.5, (0.5, 0.75), 1.0, usage=5)
    body = r.to_json()
    assert body["num_output_tokens"] == 2 and body["usage_mismatch"] is True and body["tpot_s"] == 0.5
    assert RequestRecord.from_json(body) == r
