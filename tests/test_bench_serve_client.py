"""`pdserve bench serve`'s client on canned SSE streams: token counting, usage, error kinds."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest

from pdserve.bench_serve.client import Api, Endpoint, send
from pdserve.bench_serve.runner import Limits, run
from pdserve.bench_serve.workload import ChatMessage, WorkItem

COMPLETIONS = Endpoint("http://bench.test", Api.COMPLETIONS, "m")
CHAT = Endpoint("http://bench.test", Api.CHAT, "m")


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def text_event(text: str, num_logprobs: int | None, finish: str | None = None) -> dict:
    logprobs = None if num_logprobs is None else {"tokens": ["t"] * num_logprobs}
    return {"choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def usage(completion_tokens: int) -> dict:
    return {
        "choices": [],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    }


def send_to(
    handler, endpoint: Endpoint = COMPLETIONS, item: WorkItem | None = None, deadline: float | None = None
):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await send(
                http, endpoint, item or WorkItem((1, 2, 3), 4), 0, time.perf_counter(), deadline
            )

    return asyncio.run(go())


def answer(body: bytes, status: int = 200):
    return lambda request: httpx.Response(status, content=body)


def test_tokens_are_counted_from_logprob_entries_even_when_their_text_is_held_back():
    body = sse(text_event("a", 1), text_event("", 1), text_event("bc", 2, "length"), usage(4), "[DONE]")
    r = send_to(answer(body))
    assert r.ok and r.finish_reason == "length"
    assert r.event_tokens == (1, 1, 2) and r.num_output_tokens == 4
    assert r.usage_completion_tokens == 4 and not r.usage_mismatch
    assert r.prompt_tokens == 3 and r.usage_cached_tokens == 2 and r.events_without_logprobs == 0
    assert r.ttft_s == r.token_times_s[0] and r.e2e_s >= r.token_times_s[-1]


def test_text_without_logprobs_counts_one_token_per_event_and_is_flagged():
    body = sse(text_event("a", 1), text_event("b", 0), text_event("c", None, "length"), usage(4), "[DONE]")
    r = send_to(answer(body))
    assert r.num_output_tokens == 3 and r.events_without_logprobs == 2
    assert r.usage_mismatch  # the server says 4: the report shows the disagreement
    unasked = send_to(
        answer(body), Endpoint("http://bench.test", Api.COMPLETIONS, "m", count_with_logprobs=False)
    )
    assert unasked.num_output_tokens == 3 and unasked.events_without_logprobs == 0


def test_request_body_asks_for_logprobs_usage_and_exact_lengths():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        return httpx.Response(200, content=sse(text_event("a", 1, "length"), "[DONE]"))

    send_to(handler, COMPLETIONS, WorkItem((5, 6), 1))
    assert seen["path"] == "/v1/completions"
    assert (
        seen["body"]
        | {
            "prompt": [5, 6],
            "logprobs": 0,
            "max_tokens": 1,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        == seen["body"]
    )
    send_to(handler, CHAT, WorkItem((ChatMessage("system", "s"), ChatMessage("user", "u")), 2))
    assert seen["path"] == "/v1/chat/completions"
    assert seen["body"]["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert (seen["body"]["logprobs"], seen["body"]["top_logprobs"]) == (True, 0)


def test_chat_deltas_count_through_their_logprob_content():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    token = {
        "choices": [
            {
                "index": 0,
                "delta": {"content": "hi"},
                "logprobs": {"content": [{}, {}]},
                "finish_reason": "length",
            }
        ]
    }
    r = send_to(answer(sse(role, token, usage(2), "[DONE]")), CHAT, WorkItem("hello", 2))
    assert r.ok and r.event_tokens == (2,) and r.prompt_tokens == 3


@pytest.mark.parametrize(
    ("handler", "kind"),
    [
        (answer(b'{"error": "busy"}', 429), "http_429"),
        (answer(sse(text_event("a", 1), {"error": {"message": "node died"}})), "stream_error"),
        (answer(sse(text_event("a", 1))), "incomplete"),  # no finish reason, no [DONE]
        (answer(b"data: {not json\n\n"), "bad_event"),
    ],
)
def test_failed_requests_are_recorded_by_kind(handler, kind):
    r = send_to(handler)
    assert not r.ok and r.error_kind == kind and r.e2e_s is None


def test_a_request_past_the_runs_deadline_is_cut_off():
    async def slow_body():
        yield sse(text_event("a", 1))
        await asyncio.sleep(5)
        yield sse("[DONE]")

    r = send_to(lambda request: httpx.Response(200, content=slow_body()), deadline=time.perf_counter() + 0.2)
    assert r.error_kind == "cut_off" and r.num_output_tokens == 1


def test_connection_refused_is_a_connect_error():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    assert send_to(refuse).error_kind == "connect"


def test_runner_caps_concurrency_and_sends_nothing_after_the_time_limit(monkeypatch):
    in_flight, peak = 0, 0

    async def body():
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        yield sse(text_event("a", 1, "length"), "[DONE]")

    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(transport=transport))
    items = [WorkItem((1,), 1)] * 12
    result = run(items, [0.0] * 12, COMPLETIONS, Limits(max_concurrency=3), progress=False)
    assert peak == 3 and len(result.records) == 12 and all(r.ok for r in result.records)
    late = run(items, [0.0] * 6 + [0.5] * 6, COMPLETIONS, Limits(max_s=0.3, drain_s=1.0), progress=False)
    assert (len(late.records), late.num_unsent) == (6, 6)
    assert not math.isinf(late.duration_s)
