"""One request's trace across real processes: ``pdserve router`` + a prefill and a decode node +
redis-server, each exporting to an OTLP receiver in this process. Through P→D and decode-only,
the spans of the router, the prefill node, the transfer and the decode node share the client's
trace id, hang under the router's attempt, and carry the request's numbers.

The router turns tracing on the standard way (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, gRPC), the
nodes by vLLM's flag (--otlp-traces-endpoint, HTTP/protobuf): both transports, both switches.
This module starts its own small cluster: the shared ones run without tracing."""

from __future__ import annotations

import os

import pytest

from tests import web
from tests.cluster import RedisServer
from tests.otlp_receiver import OTLPReceiver, ReceivedSpan
from tests.test_router_cluster import (
    LONG_PROMPT,
    NodeProcess,
    RouterProcess,
    serving,
    tiny_model_with_tokenizer,
)

pytestmark = pytest.mark.usefixtures("processes")
TRACE_ID = "5b8efff798038103d269b633813fc60c"
PREFILL_SPANS = {"pdserve.prefill.queue", "pdserve.prefill", "pdserve.kv.reserve", "pdserve.kv.send"}
DECODE_SPANS = {"pdserve.kv.land", "pdserve.decode.queue", "pdserve.decode"}
ROUTER_SPANS = {"pdserve.admission", "pdserve.queue", "pdserve.route", "pdserve.attempt"}


@pytest.fixture(scope="module")
def traced_cluster(tmp_path_factory, default_model_dir):
    """Yields (router, nodes by role, receiver); the processes export every span at once
    (OTEL_BSP_SCHEDULE_DELAY), so a test waits for its spans, not for a batch timer."""
    tmp = tmp_path_factory.mktemp("traced-cluster")
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)
    receiver = OTLPReceiver()
    redis = RedisServer(tmp)
    extra = ["--num-kv-blocks", "64", "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2"]
    traces = ["--otlp-traces-endpoint", receiver.http_endpoint]
    with pytest.MonkeyPatch.context() as env:  # what the children inherit; this process keeps its own
        for name in [n for n in os.environ if n.startswith("OTEL_")]:
            env.delenv(name)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        nodes = {
            role: NodeProcess(role, str(model), tmp, redis.url, [*extra, *traces])
            for role in ("prefill", "decode")
        }
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.grpc_endpoint)
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        router = RouterProcess(
            model, redis.url, tmp, "--disagg-threshold", "8", "--local-prefill-margin-s", "-1"
        )
    try:
        with serving(redis, nodes.values(), [router]):
            yield router, nodes, receiver
    finally:
        receiver.close()


def _traced(receiver: OTLPReceiver, trace_id: str, services: set[str], names: set[str]) -> list[ReceivedSpan]:
    """Every span of the trace, once each service sent one, every name arrived and the router's
    server span too (it ends last, after the reply: on a loaded machine it comes a batch later)."""

    def complete(spans: list[ReceivedSpan]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        server = any(s.kind == 2 and s.service == "pdserve-router" for s in mine)
        return server and {s.service for s in mine} >= services and {s.name for s in mine} >= names

    return [s for s in receiver.wait_for(complete, timeout_s=30) if s.trace_id == trace_id]


def _one(spans: list[ReceivedSpan], name: str, service: str) -> ReceivedSpan:
    (span,) = [s for s in spans if s.name == name and s.service == service]
    return span


def test_a_disaggregated_requests_spans_from_the_router_both_nodes_and_the_transfer_share_its_trace(
    traced_cluster,
):
    router, nodes, receiver = traced_cluster
    client_span = "a3ce929d0e0e4736"
    reply = web.post(
        router.url + "/v1/completions",
        json={"prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        headers={"traceparent": f"00-{TRACE_ID}-{client_span}-01"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-pdserve-path"] == "disaggregated"
    usage = reply.json()["usage"]
    services = {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    spans = _traced(receiver, TRACE_ID, services, ROUTER_SPANS | PREFILL_SPANS | DECODE_SPANS)
    assert {s.service for s in spans} == services

    (server,) = [s for s in spans if s.kind == 2]
    assert server.parent_span_id == client_span and server.service == "pdserve-router"
    assert server.attributes["gen_ai.usage.output_tokens"] == 6 == usage["completion_tokens"]
    assert server.attributes["pdserve.path"] == "disaggregated"
    attempt = _one(spans, "pdserve.attempt", "pdserve-router")
    for span in spans:
        if span.service != "pdserve-router":  # the nodes' spans hang under the router's attempt
            assert span.parent_span_id == attempt.span_id, span.name
            assert span.attributes["pdserve.request_id"] == attempt.attributes["pdserve.request_id"]

    prefill, decode = nodes["prefill"].addrs["node_id"], nodes["decode"].addrs["node_id"]
    assert {s.resource["service.instance.id"] for s in spans if s.service == "pdserve-prefill"} == {prefill}
    assert {s.resource["service.instance.id"] for s in spans if s.service == "pdserve-decode"} == {decode}
    assert {s.name for s in spans if s.service == "pdserve-prefill"} == PREFILL_SPANS
    assert {s.name for s in spans if s.service == "pdserve-decode"} == DECODE_SPANS
    computed = _one(spans, "pdserve.prefill", "pdserve-prefill")
    assert computed.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    sent = _one(spans, "pdserve.kv.send", "pdserve-prefill")
    assert (
        sent.attributes["pdserve.kv.path"] in ("direct", "shm", "socket")
        and sent.attributes["pdserve.kv.bytes"] > 0
    )
    landed = _one(spans, "pdserve.kv.land", "pdserve-decode")
    assert landed.attributes["pdserve.kv.bytes"] == sent.attributes["pdserve.kv.bytes"]
    decoded = _one(spans, "pdserve.decode", "pdserve-decode")
    assert decoded.attributes["gen_ai.usage.output_tokens"] == 6
    assert decoded.attributes["gen_ai.response.finish_reasons"] == ("length",)
    # the stages follow one another in time (one host's clock)
    reserve = _one(spans, "pdserve.kv.reserve", "pdserve-prefill")
    assert computed.end_ns <= reserve.start_ns <= reserve.end_ns <= sent.start_ns <= sent.end_ns
    # the reply ends once the last token reached the router, so the decode had begun by then; the
    # decode span closes just after its node sent that token, so its end is not ordered against
    # the reply's (it closed 0.2 ms after it in a CI run)
    assert attempt.start_ns <= computed.start_ns and decoded.start_ns <= server.end_ns


def test_a_decode_only_requests_spans_come_from_the_router_and_the_decode_node(traced_cluster):
    router, nodes, receiver = traced_cluster
    trace_id = "6c9f1e0a2b3d4c5e6f708192a3b4c5d6"
    reply = web.post(
        router.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True},  # under --disagg-threshold 8
        headers={"traceparent": f"00-{trace_id}-0102030405060708-01"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert (reply.headers["x-pdserve-path"], reply.headers["x-pdserve-path-reason"]) == (
        "local-prefill",
        "short-prompt",
    )
    spans = _traced(
        receiver, trace_id, {"pdserve-router", "pdserve-decode"}, {"pdserve.prefill", "pdserve.decode"}
    )
    assert {s.service for s in spans} == {"pdserve-router", "pdserve-decode"}  # the prefill node took no part
    assert {s.name for s in spans if s.service == "pdserve-decode"} == {"pdserve.prefill", "pdserve.decode"}
    local = _one(spans, "pdserve.prefill", "pdserve-decode")
    assert local.attributes["pdserve.local_prefill"] is True
    assert local.attributes["gen_ai.usage.input_tokens"] == reply.json()["usage"]["prompt_tokens"]
    route = _one(spans, "pdserve.route", "pdserve-router")
    assert (route.attributes["pdserve.path"], route.attributes["pdserve.path_reason"]) == (
        "local-prefill",
        "short-prompt",
    )
    attempt = _one(spans, "pdserve.attempt", "pdserve-router")
    assert all(s.parent_span_id == attempt.span_id for s in spans if s.service == "pdserve-decode")
