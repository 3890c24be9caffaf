"""The router's spans (router/spans.py) against fake nodes (real sockets, real uvicorn, no model)
and an OTLP receiver in this process: the request under the client's traceparent, admission,
queue, node choice and each attempt (retries, migration), the context the nodes are sent, and a
router that does not trace passing the client's context on untouched."""

from __future__ import annotations

import os

import httpx
import pytest

from pdserve.protocol import messages as pm
from pdserve.router.tokenizer import Tokenizer
from tests.otlp_receiver import OTLPReceiver, ReceivedSpan
from tests.test_router_support import LONG_PROMPT, TEXT, FakeNode, fake_cluster, fake_pair, run_async

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture(scope="module")
def tokens(default_model_dir) -> list[int]:
    return Tokenizer(default_model_dir).encode(TEXT)


@pytest.fixture
def receiver(monkeypatch):
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    with_receiver = OTLPReceiver()
    yield with_receiver
    with_receiver.close()


def _post(nodes, model_dir, body: dict, headers: dict | None = None, **config):
    async def go():
        async with fake_cluster(model_dir, nodes, **config) as cluster, httpx.AsyncClient() as http:
            return await http.post(cluster.base_url + "/v1/completions", json=body, headers=headers or {})

    return run_async(go())  # the router's tracer is closed with the app: its spans are out


def _named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def test_a_request_is_a_server_span_under_the_clients_trace_with_its_stages(
    default_model_dir, tokens, receiver
):
    nodes = fake_pair(tokens)
    body = {"prompt": LONG_PROMPT, "max_tokens": len(tokens), "temperature": 0, "seed": 5}
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
    reply = _post(nodes, default_model_dir, body, headers, otlp_traces_endpoint=receiver.http_endpoint)
    assert reply.status_code == 200, reply.text
    spans = receiver.wait_for(lambda got: any(s.name.startswith("text_completion") for s in got))
    (server,) = [s for s in spans if s.kind == 2]
    model = default_model_dir.name
    assert server.name == f"text_completion {model}" and server.service == "pdserve-router"
    assert (server.trace_id, server.parent_span_id) == (TRACE_ID, CLIENT_SPAN)
    assert {s.trace_id for s in spans} == {TRACE_ID}
    usage = reply.json()["usage"]
    assert server.attributes | {"gen_ai.response.time_to_first_chunk": 0} == {
        "http.request.method": "POST",
        "http.route": "/v1/completions",
        "http.response.status_code": 200,
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "pdserve",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": len(tokens),
        "gen_ai.request.temperature": 0.0,
        "gen_ai.request.top_p": 1.0,
        "gen_ai.request.seed": 5,
        "gen_ai.request.stream": False,
        "gen_ai.response.id": reply.json()["id"],
        "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.response.time_to_first_chunk": 0,
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.usage.cache_read.input_tokens": 4,
        "pdserve.prompts": 1,
        "pdserve.path": "disaggregated",
        "pdserve.retries": 0,
        "pdserve.migrations": 0,
    }
    assert 0 < server.attributes["gen_ai.response.time_to_first_chunk"] < 5
    for name in ("pdserve.admission", "pdserve.queue", "pdserve.route", "pdserve.attempt"):
        (span,) = _named(spans, name)
        assert (
            span.parent_span_id == server.span_id
            and server.start_ns <= span.start_ns <= span.end_ns <= server.end_ns
        )
    assert _named(spans, "pdserve.admission")[0].attributes == {
        "pdserve.samples": 1,
        "pdserve.admission": "admitted",
    }
    (attempt,) = _named(spans, "pdserve.attempt")
    assert attempt.attributes["pdserve.outcome"] == "done" and attempt.status_code == 0
    assert {
        k: attempt.attributes[k] for k in ("pdserve.path", "pdserve.prefill_node", "pdserve.decode_node")
    } == {
        "pdserve.path": "disaggregated",
        "pdserve.prefill_node": "p0",
        "pdserve.decode_node": "d0",
    }
    # the nodes are told to hang their spans under the attempt, in the client's trace
    (sent,) = nodes[0].received
    assert sent.trace == pm.TraceContext(
        traceparent=f"00-{TRACE_ID}-{attempt.span_id}-01", tracestate="vendor=abc"
    )


def test_a_retry_and_a_migration_are_attempts_with_their_outcomes(default_model_dir, tokens, receiver):
    bad_prefill = FakeNode("p0", "prefill", tokens, num_queued_prefill_tokens=0)
    bad_prefill.fail_with = pm.RequestFailed(
        request_id="", node_id="p0", code="kv_transfer", message="decode refused", retryable=True
    )
    good_prefill = FakeNode("p1", "prefill", tokens, num_queued_prefill_tokens=10)
    dying, healthy = FakeNode("d0", "decode", tokens), FakeNode("d1", "decode", tokens, num_blocks_free=1)
    dying.fail_after, dying.fail_once = 4, True
    nodes = [bad_prefill, good_prefill, dying, healthy]
    body = {"prompt": LONG_PROMPT, "max_tokens": len(tokens)}
    reply = _post(nodes, default_model_dir, body, otlp_traces_endpoint=receiver.http_endpoint)
    assert reply.status_code == 200, reply.text
    spans = receiver.wait_for(lambda got: any(s.kind == 2 for s in got))
    (server,) = [s for s in spans if s.kind == 2]
    assert server.parent_span_id == "" and (
        server.attributes["pdserve.retries"],
        server.attributes["pdserve.migrations"],
    ) == (1, 1)
    attempts = sorted(_named(spans, "pdserve.attempt"), key=lambda s: s.start_ns)
    assert [a.attributes["pdserve.outcome"] for a in attempts] == ["retry", "migrate", "done"]
    assert [a.attributes["pdserve.attempt"] for a in attempts] == [1, 2, 3]
    assert [a.status_code for a in attempts] == [2, 2, 0]  # a failed attempt is an error span
    assert "decode refused" in attempts[0].attributes["pdserve.retry_reason"]
    assert attempts[2].attributes["pdserve.resumed_tokens"] == 4
    assert attempts[2].attributes["pdserve.path_reason"] == "migrated"
    assert attempts[1].attributes["pdserve.prefill_node"] == "p1"
    assert len(_named(spans, "pdserve.route")) == 3 and len(_named(spans, "pdserve.queue")) == 1
    assert [
        r.trace.traceparent.split("-")[2]
        for r in (*bad_prefill.received, *good_prefill.received, *healthy.received)
    ] == [a.span_id for a in attempts]


def test_a_shed_request_has_its_admission_span_and_a_429(default_model_dir, tokens, receiver):
    body = {"prompt": LONG_PROMPT, "max_tokens": 2, "n": 2}
    reply = _post(
        fake_pair(tokens),
        default_model_dir,
        body,
        otlp_traces_endpoint=receiver.http_endpoint,
        max_inflight_decode=1,
    )
    assert reply.status_code == 429
    spans = receiver.wait_for(lambda got: any(s.kind == 2 for s in got))
    (server,) = [s for s in spans if s.kind == 2]
    (admission,) = _named(spans, "pdserve.admission")
    assert (
        admission.attributes == {"pdserve.samples": 2, "pdserve.admission": "shed"}
        and admission.status_code == 2
    )
    assert server.attributes["http.response.status_code"] == 429 and server.attributes["error.type"] == "429"
    assert server.status_code == 0  # a 4xx is the client's error, not the server's


def test_a_router_that_does_not_trace_passes_the_clients_context_on(default_model_dir, tokens, receiver):
    body = {"prompt": LONG_PROMPT, "max_tokens": 2}
    sent = []
    for headers in ({"traceparent": TRACEPARENT}, {}, {"traceparent": TRACEPARENT.upper()}):
        nodes = fake_pair(tokens)
        assert _post(nodes, default_model_dir, body, headers).status_code == 200
        sent.append(nodes[0].received[0].trace)
    # passed on as the client sent it; none sent, none passed; a malformed one ignored (W3C)
    assert sent == [pm.TraceContext(traceparent=TRACEPARENT), None, None]
    assert receiver.spans == []
