"""protocol/tracing.py: which settings turn traces on and where they go, a client's traceparent
read as W3C says, spans exported over both OTLP transports to a receiver in this process, and
nothing of the SDK imported while tracing is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.protocol.messages import TraceContext
from pdserve.protocol.tracing import Tracer, TraceSettings, open_tracer, parse_traceparent, trace_settings
from tests.cluster import ROOT
from tests.otlp_receiver import OTLPReceiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = TraceContext(traceparent=f"00-{TRACE_ID}-00f067aa0ba902b7-01", tracestate="congo=t61rcWkgMzE")


@pytest.fixture
def receiver():
    with_receiver = OTLPReceiver()
    yield with_receiver
    with_receiver.close()


@pytest.fixture(autouse=True)
def no_otel_variables(monkeypatch):
    """The SDK reads OTEL_* itself: none from the environment the tests run in."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)


# ------------------------------------------------------------------ settings
def test_no_flag_and_no_variable_means_no_traces():
    assert trace_settings(None, {}) is None
    assert trace_settings(None, {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}) is None


def test_vllms_flag_turns_traces_on_and_port_4317_means_grpc():
    assert trace_settings("http://collector:4317", {}) == TraceSettings(
        ("otlp",), "grpc", "http://collector:4317"
    )


def test_an_http_endpoint_from_the_flag_gets_the_traces_path_and_a_scheme():
    assert trace_settings("collector:4318", {}).endpoint == "http://collector:4318/v1/traces"
    assert trace_settings("http://c:4318/", {}).endpoint == "http://c:4318/v1/traces"
    assert trace_settings("https://c/otlp/v1/traces", {}).endpoint == "https://c/otlp/v1/traces"


def test_the_standard_endpoint_variables_turn_traces_on_and_the_exporter_reads_them():
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        settings = trace_settings(None, {variable: "http://collector:4318"})
        assert settings == TraceSettings(("otlp",), "http/protobuf", None)  # None: the SDK reads it


def test_the_protocol_variables_win_over_the_port():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert trace_settings(None, env).protocol == "http/protobuf"
    env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "grpc"
    assert trace_settings(None, env).protocol == "grpc"
    with pytest.raises(ValueError, match="http/json"):
        trace_settings("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_the_exporter_variable_names_console_or_none_and_sdk_disabled_wins():
    assert trace_settings(None, {"OTEL_TRACES_EXPORTER": "console"}).exporters == ("console",)
    assert trace_settings(None, {"OTEL_TRACES_EXPORTER": "otlp"}).exporters == ("otlp",)
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert trace_settings(None, {**endpoint, "OTEL_TRACES_EXPORTER": "none"}) is None
    assert trace_settings("http://c:4318", {"OTEL_TRACES_EXPORTER": "none"}).exporters == ("otlp",)
    assert trace_settings("http://c:4318", {"OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(ValueError, match="zipkin"):
        trace_settings(None, {"OTEL_TRACES_EXPORTER": "zipkin"})


# ------------------------------------------------------------------ a client's traceparent
def test_a_clients_traceparent_and_tracestate_are_read_as_w3c_says():
    assert parse_traceparent(PARENT.traceparent, " congo=t61rcWkgMzE ") == PARENT
    assert parse_traceparent(None) is None
    for bad in (
        PARENT.traceparent.upper(),  # lower-case hex only
        f"ff-{TRACE_ID}-00f067aa0ba902b7-01",  # version ff is invalid
        f"00-{'0' * 32}-00f067aa0ba902b7-01",  # an all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # an all-zero parent id
        f"00-{TRACE_ID}-00f067aa0ba902b7-01-extra",  # version 00 has exactly four fields
        "garbage",
    ):
        assert parse_traceparent(bad) is None, bad
    # a later version: its first four fields, read as version 00
    later = parse_traceparent(f"cc-{TRACE_ID}-00f067aa0ba902b7-01-what-the-future-holds")
    assert later == TraceContext(traceparent=f"00-{TRACE_ID}-00f067aa0ba902b7-01")
    assert parse_traceparent(PARENT.traceparent, "k=" + "v" * 600).tracestate == ""


# ------------------------------------------------------------------ export
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_spans_reach_an_otlp_receiver_under_the_callers_trace(receiver, transport, monkeypatch):
    if transport == "grpc":
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        endpoint = receiver.grpc_endpoint
    else:
        endpoint = receiver.http_endpoint
    tracer = open_tracer("pdserve-test", "node-7", endpoint)
    assert isinstance(tracer, Tracer) and tracer.settings.protocol == (
        "grpc" if transport == "grpc" else "http/protobuf"
    )
    live = tracer.start("outer", PARENT, {"a": 1}, kind="server")
    tracer.record("inner", tracer.context_of(live), 1_000, 3_000, {"b": "x"}, error="it broke")
    tracer.end(live, {"c": (1.5, 2.5)})
    assert tracer.flush()
    spans = {s.name: s for s in receiver.wait_for(lambda got: len(got) == 2)}
    outer, inner = spans["outer"], spans["inner"]
    assert outer.trace_id == inner.trace_id == TRACE_ID
    assert outer.parent_span_id == "00f067aa0ba902b7" and inner.parent_span_id == outer.span_id
    assert (
        outer.resource["service.name"] == "pdserve-test" and outer.resource["service.instance.id"] == "node-7"
    )
    assert outer.attributes == {"a": 1, "c": (1.5, 2.5)} and outer.kind == 2
    assert (inner.start_ns, inner.end_ns, inner.attributes) == (1_000, 3_000, {"b": "x"})
    assert (inner.status_code, inner.status_message) == (2, "it broke")
    tracer.close()


def test_the_context_passed_on_names_the_span_and_keeps_the_tracestate(receiver):
    tracer = open_tracer("pdserve-test", "n", receiver.http_endpoint)
    span = tracer.start("s", PARENT)
    context = tracer.context_of(span)
    assert context.traceparent.startswith(f"00-{TRACE_ID}-") and context.traceparent.endswith("-01")
    assert context.traceparent.split("-")[2] == format(span.get_span_context().span_id, "016x")
    assert context.tracestate == PARENT.tracestate
    tracer.end(span)
    tracer.close()


def test_otel_service_name_wins_over_the_process_default(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-router")
    tracer = open_tracer("pdserve-router", "r", receiver.http_endpoint)
    tracer.record("s", None, 1, 2)
    tracer.flush()
    (span,) = receiver.wait_for(lambda got: len(got) == 1)
    assert span.service == "my-router" and span.parent_span_id == ""
    tracer.close()


# ------------------------------------------------------------------ off
def test_off_opens_no_tracer_and_imports_nothing_of_the_sdk(processes):
    """In a clean process: importing every module with tracing hooks and asking for a tracer with
    no flag and no variable leaves the SDK unimported (FastAPI imports OpenTelemetry's API itself)."""
    probe = (
        "import sys, json\n"
        "import pdserve.router.app, pdserve.router.spans, pdserve.node.spans\n"
        "from pdserve.protocol.tracing import open_tracer\n"
        "assert open_tracer('pdserve-router', 'r') is None\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')"
        " or m.startswith('opentelemetry.exporter'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_asking_for_traces_without_the_sdk_is_an_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pdserve\[otel\]"):
        open_tracer("pdserve-router", "r", "http://127.0.0.1:1")
