"""Bad HTTP input against a real router over real nodes: hand-written abuse (huge prompts and
numbers, NaN, wrong types, invalid UTF-8, deep nesting, 10 MB bodies with and without a length,
slow-loris clients). Required: no 5xx, no process down, and normal requests served throughout."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.chaos.harness import Spec, request_once, write_report_row

pytestmark = pytest.mark.slow


def _body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4, **fields}).encode()


CASES: dict[str, tuple[str, bytes]] = {
    "huge prompt text": ("/v1/completions", _body(prompt="word " * 300_000)),
    "huge prompt ids": ("/v1/completions", _body(prompt=list(range(200_000)))),
    "huge max_tokens": ("/v1/completions", _body(max_tokens=10**12)),
    "max_tokens 2**64": ("/v1/completions", _body(max_tokens=2**64)),
    "negative max_tokens": ("/v1/completions", _body(max_tokens=-1)),
    "negative temperature": ("/v1/completions", _body(temperature=-1)),
    "NaN top_p": ("/v1/completions", b'{"prompt": "hi", "top_p": NaN}'),
    "Infinity temperature": ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}'),
    "-Infinity penalty": ("/v1/completions", b'{"prompt": "hi", "presence_penalty": -Infinity}'),
    "n zero": ("/v1/completions", _body(n=0)),
    "n huge": ("/v1/completions", _body(n=10**6)),
    "negative logprobs": ("/v1/completions", _body(logprobs=-5)),
    "token id past vocab": ("/v1/completions", _body(prompt=[10**9])),
    "negative token id": ("/v1/completions", _body(prompt=[-3, 5])),
    "prompt number": ("/v1/completions", _body(prompt=123)),
    "prompt nested lists": ("/v1/completions", _body(prompt=[[[1]]])),
    "stop number": ("/v1/completions", _body(stop=5)),
    "stream string": ("/v1/completions", _body(stream="yes")),
    "seed float": ("/v1/completions", _body(seed=1.5)),
    "logit_bias junk": ("/v1/completions", _body(logit_bias={"x": "y"})),
    "invalid utf-8": ("/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}'),
    "lone surrogate": ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    "NUL in prompt": ("/v1/completions", b'{"prompt": "a\\u0000b", "max_tokens": 2}'),
    "deeply nested array": ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    "deeply nested object": ("/v1/completions", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    "json null": ("/v1/completions", b"null"),
    "json array": ("/v1/completions", b"[]"),
    "empty body": ("/v1/completions", b""),
    "truncated json": ("/v1/completions", b'{"prompt": "hi", "max_'),
    "messages string": ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode()),
    "messages empty": ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    "message role unknown": (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
    ),
    "message content parts junk": (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "x": 1}]}]}).encode(),
    ),
    "many messages": (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "hi"}] * 20_000, "max_tokens": 2}).encode(),
    ),
    "10 MB body": ("/v1/completions", b'{"prompt": "' + b"a" * (10 << 20) + b'"}'),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_body_gets_a_client_error(small, name):
    cluster, _ = small
    path, raw = CASES[name]
    reply = httpx.post(
        cluster.router.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    assert 400 <= reply.status_code < 500 or reply.status_code == 200, (reply.status_code, reply.text[:300])
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["message"] and error["type"], error


def test_a_10_mb_body_without_a_length_header_is_refused_too(small):
    cluster, _ = small

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'

    reply = httpx.post(cluster.router.url + "/v1/completions", content=chunks(), timeout=60)
    assert reply.status_code == 413, reply.text[:300]
    assert reply.json()["error"]["code"] == "body_too_large"


def test_slow_loris_clients_do_not_stop_the_router_serving(small, expected):
    cluster, _ = small
    host, port = "127.0.0.1", cluster.router.port
    loris = []
    for _ in range(100):
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n")
        loris.append(s)
    spec = Spec(tuple(range(300, 360)), 8, stream=True, logprobs=True)
    try:
        for _ in range(5):
            for s in loris:  # a byte of header now and then, never the end of it
                try:
                    s.sendall(b"X")
                except OSError:
                    pass
            started = time.monotonic()
            outcome = request_once(cluster.router.url, cluster.model.name, spec, timeout_s=30)
            assert outcome.kind == "complete" and time.monotonic() - started < 10, outcome
            expected.check(outcome)
            time.sleep(0.5)
    finally:
        for s in loris:
            s.close()
    write_report_row(
        {
            "fault": "100 slow-loris connections",
            "where": "router HTTP intake",
            "requests": 5,
            "in_flight": 100,
            "outcomes": {"complete": 5},
            "blocks_leaked": 0,
        }
    )


def test_after_all_the_abuse_every_process_is_up_and_idle(small, expected):
    cluster, tight = small
    assert all(p.poll() is None for p in [cluster.router.proc, tight.proc, *(n.proc for n in cluster.nodes)])
    spec = Spec(tuple(range(500, 600)), 8, stream=False, logprobs=True)
    outcome = request_once(cluster.router.url, cluster.model.name, spec)
    assert outcome.kind == "complete", outcome
    expected.check(outcome)
    assert not any(cluster.wait_idle().values())
    write_report_row(
        {
            "fault": f"{len(CASES) + 1} hand-written bad bodies",
            "where": "router HTTP intake",
            "requests": len(CASES) + 1,
            "in_flight": 1,
            "outcomes": {"4xx or 200": len(CASES) + 1, "5xx": 0},
            "blocks_leaked": 0,
        }
    )
