"""An OTLP trace receiver in the test process: what a collector is to pdserve, on loopback.

``OTLPReceiver`` takes OTLP/HTTP (protobuf, POST /v1/traces) and OTLP/gRPC (TraceService/Export)
on two free ports, decodes each export with opentelemetry-proto's own message classes, and keeps
every span as a ``ReceivedSpan``: what a collector would have stored, nothing pdserve-specific.
"""

from __future__ import annotations

import dataclasses
import gzip
import http.server
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclasses.dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    resource: dict[str, Any]  # every resource attribute
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int  # OTLP's SpanKind number (1 internal, 2 server, 3 client)
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # OTLP's: 0 unset, 1 ok, 2 error
    status_message: str


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        resource=resource,
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        status_code=span.status.code,
                        status_message=span.status.message,
                    )
                )
    return out


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep: Callable[[list[ReceivedSpan]], None]) -> None:
        self._keep = keep

    def Export(self, request, context):  # noqa: N802  (the generated service's name)
        self._keep(spans_of(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPReceiver:
    """Both OTLP transports on loopback; ``spans`` holds what arrived, in arrival order."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._keep(spans_of(request))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:  # quiet
                pass

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_endpoint = f"http://127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True, name="otlp-http").start()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self._keep), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self.grpc_endpoint = f"http://127.0.0.1:{port}"
        self._grpc.start()

    def _keep(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.spans.extend(spans)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0
    ) -> list[ReceivedSpan]:
        """Every span received, once ``predicate`` holds of them (AssertionError after the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            assert time.monotonic() < deadline, (
                f"spans received so far: {[(s.service, s.name) for s in spans]}"
            )
            time.sleep(0.05)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._grpc.stop(None)
