"""OpenTelemetry traces of one pdserve process: turned on by the standard ``OTEL_*`` variables or
vLLM's ``--otlp-traces-endpoint`` flag, exported over OTLP (gRPC or HTTP/protobuf), and continued
across processes as a W3C trace context (``protocol.messages.TraceContext``).

    client ─traceparent─► router: its spans ─GenerateRequest.trace─► prefill node: its spans
                                             ─RequestMeta.trace (in KVReserve)─► decode node: its spans

Off unless asked for, and then free: ``open_tracer`` answers None, the OpenTelemetry SDK is never
imported, and callers make no span object (each hook is one ``is None`` test). The SDK is the
optional extra ``pdserve[otel]``; asking for traces without it is an error at start, not a silence.

When on, ``open_tracer`` asks ``trace_settings`` what to export where:

- ``--otlp-traces-endpoint URL`` (vLLM's flag), else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
  ``OTEL_EXPORTER_OTLP_ENDPOINT``, turn it on; so does ``OTEL_TRACES_EXPORTER=otlp`` (the default
  endpoint) or ``console`` (spans printed to stdout). ``OTEL_SDK_DISABLED=true`` turns everything
  off, ``OTEL_TRACES_EXPORTER=none`` the variables' endpoints.
- The protocol is ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``
  (``grpc`` or ``http/protobuf``); unset, gRPC for an endpoint on port 4317 (OTLP/gRPC's port,
  and vLLM's default protocol), else HTTP/protobuf (the OpenTelemetry default).
- The flag's URL is the traces endpoint itself, as vLLM's is; over HTTP one without a path gets
  OTLP's ``/v1/traces``. Everything else (headers, TLS, timeouts, the batch processor's delays,
  ``OTEL_TRACES_SAMPLER``, ``OTEL_RESOURCE_ATTRIBUTES``) the SDK reads from its variables itself.
- ``service.name`` is the process's (pdserve-router, pdserve-prefill, pdserve-decode) unless
  ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` names one; ``service.instance.id`` is the
  node's id.

Here, beside the wire, because the router and both node roles share it and it needs no torch.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pdserve.protocol.messages import MAX_TRACESTATE_CHARS, TraceContext

TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
PROTOCOLS = ("grpc", "http/protobuf")
EXPORTERS = ("otlp", "console", "none")
OTLP_GRPC_PORT = 4317  # OTLP/gRPC's registered port (HTTP/protobuf's is 4318)
OTLP_HTTP_PATH = "/v1/traces"
# A traceparent of any version but ff, as W3C asks a version-00 reader to take a later one: its
# first four fields, version 00's, read as version 00.
_ANY_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


@dataclasses.dataclass(frozen=True, slots=True)
class TraceSettings:
    """What one process exports, worked out from its flag and its environment."""

    exporters: tuple[str, ...]  # "otlp" and/or "console"
    protocol: str  # OTLP's: "grpc" or "http/protobuf"
    endpoint: str | None  # --otlp-traces-endpoint, made whole; None: the exporter reads OTEL_*


def trace_settings(endpoint_flag: str | None, env: Mapping[str, str] = os.environ) -> TraceSettings | None:
    """None when this process exports no traces; ValueError for settings it cannot honour."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = tuple(n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").lower().split(",") if n.strip())
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER={unknown[0]}: pdserve exports traces by otlp or console only")
    exporters = tuple(n for n in names if n != "none")
    if endpoint_flag:
        exporters = exporters if "otlp" in exporters else ("otlp", *exporters)
    elif "none" in names or not (exporters or env.get(TRACES_ENDPOINT) or env.get(ENDPOINT)):
        return None
    exporters = exporters or ("otlp",)
    named = endpoint_flag or env.get(TRACES_ENDPOINT) or env.get(ENDPOINT) or ""
    protocol = _protocol(env, named)
    endpoint = _whole(endpoint_flag, protocol) if endpoint_flag else None
    return TraceSettings(exporters, protocol, endpoint)


def _protocol(env: Mapping[str, str], endpoint: str) -> str:
    variable = next(
        (v for v in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") if env.get(v)), None
    )
    if variable is None:
        return "grpc" if _port(endpoint) == OTLP_GRPC_PORT else "http/protobuf"
    protocol = env[variable].strip().lower()
    if protocol not in PROTOCOLS:
        raise ValueError(f"{variable}={protocol}: pdserve exports OTLP over {' or '.join(PROTOCOLS)}")
    return protocol


def _port(endpoint: str) -> int | None:
    try:
        return urlsplit(endpoint if "://" in endpoint else "//" + endpoint).port
    except ValueError:
        return None


def _whole(endpoint: str, protocol: str) -> str:
    """The flag's URL as the exporter takes it: over HTTP with a scheme and the traces path."""
    if protocol == "grpc":
        return endpoint
    url = endpoint if "://" in endpoint else "http://" + endpoint
    parts = urlsplit(url)
    return url if parts.path not in ("", "/") else url.rstrip("/") + OTLP_HTTP_PATH


def parse_traceparent(traceparent: str | None, tracestate: str | None = None) -> TraceContext | None:
    """A client's W3C trace context, from its ``traceparent`` and ``tracestate`` headers; None when
    absent or malformed (W3C: a receiver then starts a trace of its own). A tracestate past the
    limit is dropped, the traceparent kept."""
    if not traceparent:
        return None
    match = _ANY_TRACEPARENT.fullmatch(traceparent.strip())
    if match is None or match.group(1) == "ff" or (match.group(1) == "00" and match.group(5)):
        return None
    state = (tracestate or "").strip()
    try:
        return TraceContext(
            traceparent="00-" + "-".join(match.group(2, 3, 4)),
            tracestate=state if len(state) <= MAX_TRACESTATE_CHARS else "",
        )
    except ValueError:  # an all-zero trace or span id
        return None


class Tracer:
    """One process's spans, over the OpenTelemetry SDK; made by ``open_tracer`` only when tracing
    is on. Spans are either live (``start``, then ``end``: the router's, one per request stage) or
    recorded whole once they are over (``record``: a node's, from the times it kept anyway, so the
    engine loop holds no span open across steps). A parent is a ``TraceContext`` from another
    process, a live span of this one, or None (a new trace)."""

    def __init__(self, settings: TraceSettings, service_name: str, instance_id: str) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attributes = {"service.instance.id": instance_id, "service.version": _version()}
        if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            attributes["service.name"] = service_name
        # The sampler is OTEL_TRACES_SAMPLER's (default: parent-based, always on), read by the SDK.
        self._provider = TracerProvider(resource=Resource.create(attributes))
        for exporter in _exporters(settings):
            self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pdserve", _version())
        self._trace = trace
        self._last_remote: tuple[TraceContext | None, Any] = (None, None)  # the last parent's SDK context
        self.settings = settings

    def start(
        self,
        name: str,
        parent: TraceContext | Any | None,
        attributes: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
        kind: str = "internal",
    ) -> Any:
        """A live span (the SDK's), under ``parent``; ``end`` it."""
        return self._tracer.start_span(
            name,
            context=self._context(parent),
            kind=getattr(self._trace.SpanKind, kind.upper()),
            attributes=dict(attributes or {}),
            start_time=start_ns,
        )

    def end(
        self,
        span: Any,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
        end_ns: int | None = None,
    ) -> None:
        """End a live span, with its last attributes; ``error``: it failed, and why."""
        if attributes:
            span.set_attributes(dict(attributes))
        if error is not None:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    def record(
        self,
        name: str,
        parent: TraceContext | Any | None,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
        kind: str = "internal",
    ) -> None:
        """A span that is over already, from the times it began and ended."""
        self.end(self.start(name, parent, attributes, start_ns, kind), None, error, max(start_ns, end_ns))

    def context_of(self, span: Any) -> TraceContext | None:
        """The trace context that makes ``span`` the parent of another process's spans."""
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return None
        return TraceContext(
            traceparent=f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}",
            tracestate=ctx.trace_state.to_header(),
        )

    def _context(self, parent: TraceContext | Any | None) -> Any:
        api = self._trace
        if parent is None:
            return None
        if not isinstance(parent, TraceContext):
            return api.set_span_in_context(parent)
        last = self._last_remote  # a node records a request's spans one after another, under one parent
        if last[0] == parent:
            return last[1]
        _, trace_id, span_id, flags = parent.traceparent.split("-")
        state = api.TraceState.from_header([parent.tracestate]) if parent.tracestate else None
        remote = api.SpanContext(
            int(trace_id, 16), int(span_id, 16), True, api.TraceFlags(int(flags, 16)), state
        )
        context = api.set_span_in_context(api.NonRecordingSpan(remote))
        self._last_remote = (parent, context)  # one tuple, replaced whole: safe between threads
        return context

    def flush(self, timeout_ms: int = 5000) -> bool:
        """Export every span ended so far (tests, and a process about to exit)."""
        return self._provider.force_flush(timeout_ms)

    def close(self) -> None:
        """Export what is left and stop the exporters' threads."""
        self._provider.shutdown()


def open_tracer(service_name: str, instance_id: str, endpoint_flag: str | None = None) -> Tracer | None:
    """This process's tracer, or None when it exports no traces (then nothing of the SDK is
    imported). ValueError for settings it cannot honour, the SDK missing included."""
    settings = trace_settings(endpoint_flag)
    if settings is None:
        return None
    try:
        return Tracer(settings, service_name, instance_id)
    except ImportError as exc:
        raise ValueError(
            f"traces are asked for ({settings.endpoint or 'OTEL_* variables'}) but the OpenTelemetry "
            f"SDK cannot be imported ({exc}): install pdserve[otel]"
        ) from None


def _exporters(settings: TraceSettings) -> list[Any]:
    out: list[Any] = []
    if "otlp" in settings.exporters and settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter

        out.append(GRPCExporter(endpoint=settings.endpoint))
    elif "otlp" in settings.exporters:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

        out.append(HTTPExporter(endpoint=settings.endpoint))
    if "console" in settings.exporters:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        out.append(ConsoleSpanExporter())
    return out


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # a checkout that was never installed
        return "0.1.0"
