"""How the compose test's client judges one answer (scripts/compose_traffic.py), on canned bodies.

`make compose-test` counts a request as lost when this says BROKEN or TIMEOUT, so its rules are
pinned here without a Docker engine.
"""

from __future__ import annotations

import json

from scripts.compose_traffic import Outcome, Spec, body, classify, mixed_specs

CHAT_STREAM, TEXT = Spec(chat=True, stream=True, max_tokens=4), Spec(chat=False, stream=False, max_tokens=4)


def sse(*chunks: dict) -> list[str]:
    return [line for c in chunks for line in (f"data: {json.dumps(c)}", "")] + ["data: [DONE]", ""]


def delta(content: str | None, finish: str | None = None) -> dict:
    return {
        "choices": [
            {"index": 0, "delta": {} if content is None else {"content": content}, "finish_reason": finish}
        ]
    }


def test_a_stream_with_tokens_a_finish_reason_and_done_is_ok():
    lines = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
        delta("Hel"),
        delta("lo"),
        delta(None, "length"),
    )
    assert classify(CHAT_STREAM, 200, lines) == (Outcome.OK, 2, "")


def test_an_error_event_after_tokens_is_a_clean_stream_error():
    lines = sse(delta("Hi"), {"error": {"message": "decode node d1 went away mid-stream", "type": "x"}})
    assert classify(CHAT_STREAM, 200, lines) == (
        Outcome.STREAM_ERROR,
        1,
        "decode node d1 went away mid-stream",
    )


def test_a_stream_cut_before_done_or_without_finish_reason_is_broken():
    assert classify(CHAT_STREAM, 200, sse(delta("Hi"))[:-2])[0] is Outcome.BROKEN
    assert classify(CHAT_STREAM, 200, sse(delta("Hi")))[0] is Outcome.BROKEN


def test_a_whole_answer_needs_text_a_finish_reason_and_usage():
    answer = {
        "choices": [{"index": 0, "text": "blue", "finish_reason": "length"}],
        "usage": {"completion_tokens": 4},
    }
    assert classify(TEXT, 200, [json.dumps(answer)]) == (Outcome.OK, 4, "")
    answer["choices"][0]["text"] = ""
    assert classify(TEXT, 200, [json.dumps(answer)])[0] is Outcome.BROKEN
    assert classify(TEXT, 200, ["{not json"])[0] is Outcome.BROKEN


def test_an_error_status_counts_as_clean_only_with_an_openai_error_body():
    error = {"error": {"message": "no decode node", "type": "service_unavailable"}}
    assert classify(TEXT, 503, [json.dumps(error)]) == (Outcome.ERROR_STATUS, 0, "no decode node")
    assert classify(TEXT, 502, ["Bad Gateway"])[0] is Outcome.BROKEN


def test_mixed_rounds_cycle_all_four_kinds_and_prompts_differ_from_the_first_token():
    assert [s.label for s in mixed_specs(4, 8)] == ["chat/stream", "completion/stream", "chat", "completion"]
    assert {s.stream for s in mixed_specs(6, 8, stream_only=True)} == {True}
    assert body(TEXT, 1)["prompt"].split()[:2] != body(TEXT, 2)["prompt"].split()[:2]
