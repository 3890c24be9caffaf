"""The router's OpenTelemetry spans of one generation request, and the trace context it sends the
nodes with each attempt (protocol/tracing.py sets the tracer up; docs/operations.md, "Traces",
lists every span and attribute).

    chat {model}          SERVER, under the client's traceparent: the HTTP request, arrival to last byte
      ├─ pdserve.admission      the in-flight check (a 429 when shed)
      ├─ pdserve.queue          a sample's wait from arrival to its first GenerateRequest
      ├─ pdserve.route          an attempt's choice of nodes (path, reason, prefill and decode node)
      └─ pdserve.attempt        an attempt, send to outcome (done, retry, migrate, replay, error);
            ├─ the prefill node's spans       (node/spans.py: they hang under the attempt
            └─ the decode node's spans         through GenerateRequest.trace)

Attributes follow OpenTelemetry's gen_ai semantic conventions where they name the thing
(gen_ai.request.model, gen_ai.usage.input_tokens, gen_ai.response.finish_reasons,
gen_ai.response.time_to_first_chunk for the TTFT ...), ``pdserve.*`` where they do not.

A request the router does not trace still passes a client's traceparent on (W3C: an intermediary
that takes no part forwards it), so nodes that trace put their spans in the client's trace. A
request with neither has no ``RequestTrace`` at all: each hook is one ``is None`` test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from pdserve.protocol.messages import TraceContext
from pdserve.protocol.tracing import Tracer, parse_traceparent
from pdserve.router.attempts import Done, Migrate, Outcome, Replay, Retry
from pdserve.router.errors import APIError
from pdserve.router.policy import Route
from pdserve.router.route_trail import headers, leg_of

if TYPE_CHECKING:
    from pdserve.router.generation import Sample
    from pdserve.router.serving import JobRun

SCOPE_KEY = "pdserve_trace"  # where the middleware leaves a request's RequestTrace in the ASGI scope
PROVIDER = "pdserve"  # gen_ai.provider.name: the server that ran the model
_UNTRACED = contextlib.nullcontext()


def _defined(attributes: dict[str, Any]) -> dict[str, Any]:
    """OpenTelemetry takes no None values: the attributes that have one."""
    return {k: v for k, v in attributes.items() if v is not None}


class RequestTrace:
    """One generation request's spans. ``tracer`` None: this router does not trace, and only the
    client's context (``parent``) is passed on to the nodes."""

    def __init__(self, tracer: Tracer | None, parent: TraceContext | None, method: str, path: str) -> None:
        self.tracer = tracer
        self.parent = parent  # the client's context, None when it sent none
        self.started_ns = time.time_ns()
        self.first_token_ns: int | None = None  # the request's first token (any sample), for TTFT
        self.run: JobRun | None = None  # once the body made a run (not for a 400)
        attributes = {"http.request.method": method, "http.route": path}
        self.span = (
            None
            if tracer is None
            else tracer.start(f"{method} {path}", parent, attributes, self.started_ns, kind="server")
        )

    def describe(self, run: JobRun) -> None:
        """The request, as the body asked for it: gen_ai's request attributes, and the span's name
        ("{operation} {model}", as the conventions name an inference span)."""
        self.run = run
        if self.span is None:
            return
        job, params = run.job, run.job.params
        operation = "chat" if job.chat else "text_completion"
        self.span.update_name(f"{operation} {run.model}")
        self.span.set_attributes(
            _defined(
                {
                    "gen_ai.operation.name": operation,
                    "gen_ai.provider.name": PROVIDER,
                    "gen_ai.request.model": run.model,
                    "gen_ai.request.max_tokens": job.max_tokens,
                    "gen_ai.request.temperature": params.temperature,
                    "gen_ai.request.top_p": params.top_p,
                    "gen_ai.request.top_k": params.top_k,
                    "gen_ai.request.seed": params.seed,
                    "gen_ai.request.choice.count": params.n if params.n != 1 else None,
                    "gen_ai.request.stream": job.stream,
                    "gen_ai.response.id": run.id,
                    "pdserve.prompts": len(job.prompts),
                }
            )
        )

    def finish(self, status: int) -> None:
        """The response is over (its last byte sent): usage, finish reasons, where it ran."""
        if self.span is None or self.tracer is None:
            return
        attributes: dict[str, Any] = {"http.response.status_code": status}
        if status >= 400:
            attributes["error.type"] = str(status)
        if self.first_token_ns is not None:
            attributes["gen_ai.response.time_to_first_chunk"] = (self.first_token_ns - self.started_ns) / 1e9
        if self.run is not None and status < 400:
            attributes |= _outcome(self.run)
        # A server span's 4xx is the client's error, not the server's (HTTP's conventions).
        self.tracer.end(self.span, attributes, f"HTTP {status}" if status >= 500 else None)


def _outcome(run: JobRun) -> dict[str, Any]:
    from pdserve.router.responses import openai_finish

    usage = run.usage()
    reasons = tuple(openai_finish(c.state.finish_reason) or "" for c in run.choices)
    trails = list(run.trails.values())
    return {
        "gen_ai.response.model": run.model,
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cached_tokens,
        "gen_ai.response.finish_reasons": reasons,
        "pdserve.path": headers(trails)["x-pdserve-path"],
        "pdserve.retries": sum(t.num_retries for t in trails),
        "pdserve.migrations": sum(t.num_migrations for t in trails),
    }


def open_request(tracer: Tracer | None, scope: MutableMapping[str, Any]) -> RequestTrace | None:
    """The trace of a generation request arriving, or None when it has none: this router does
    not trace and the client sent no traceparent."""
    parent = None
    state = None
    for name, value in scope["headers"]:
        if name == b"traceparent":
            parent = value.decode("latin-1")
        elif name == b"tracestate":
            state = value.decode("latin-1")
    context = parse_traceparent(parent, state) if parent is not None else None
    if tracer is None and context is None:
        return None
    return RequestTrace(tracer, context, scope["method"], scope["path"])


def of(scope: MutableMapping[str, Any]) -> RequestTrace | None:
    """The request's trace, as the middleware left it in the ASGI scope."""
    return scope.get("state", {}).get(SCOPE_KEY)


def admission(trace: RequestTrace | None, num_samples: int) -> contextlib.AbstractContextManager:
    """Around the request's admission: a span saying admitted or shed."""
    if trace is None or trace.span is None:
        return _UNTRACED
    return _admission(trace, num_samples)


@contextlib.contextmanager
def _admission(trace: RequestTrace, num_samples: int) -> Iterator[None]:
    assert trace.tracer is not None
    started = time.time_ns()
    attributes: dict[str, Any] = {"pdserve.samples": num_samples}
    try:
        yield
    except APIError as exc:
        attributes["pdserve.admission"] = "shed"
        trace.tracer.record("pdserve.admission", trace.span, started, time.time_ns(), attributes, exc.message)
        raise
    attributes["pdserve.admission"] = "admitted"
    trace.tracer.record("pdserve.admission", trace.span, started, time.time_ns(), attributes)


def sample(trace: RequestTrace | None, sample: Sample) -> SampleTrace | None:
    """A sample's trace, when its request has one."""
    return None if trace is None else SampleTrace(trace, sample)


@dataclasses.dataclass(slots=True)
class SampleTrace:
    """One sample's attempts (router.generation calls it at each step of its retry loop)."""

    request: RequestTrace
    sample: Sample
    attempt: Any = None  # the live pdserve.attempt span (the SDK's), None between attempts
    num_attempts: int = 0
    prefill_failed: bool = False  # an earlier attempt through a prefill node failed before its first token

    def routed(self, route: Route, request_id: str, routing_started_ns: int, resumed: int) -> None:
        """An attempt's nodes are chosen: the route span, and the attempt's own starts (its context
        is what the nodes get). ``resumed``: output tokens a migrated sample resumes after."""
        request, tracer = self.request, self.request.tracer
        self.num_attempts += 1
        if tracer is None:
            return
        now = time.time_ns()
        ids = {"pdserve.sample": self.sample.request_id, "pdserve.request_id": request_id}
        if self.num_attempts == 1:  # the router's queue: arrival to the first send (vLLM's time in queue)
            arrival = int(self.sample.arrival_time * 1e9)
            tracer.record("pdserve.queue", request.span, arrival, now, ids)
        leg = leg_of(route, self.prefill_failed)
        where = {
            **ids,
            "pdserve.attempt": self.num_attempts,
            "pdserve.path": str(leg.path),
            "pdserve.path_reason": None if leg.reason is None else str(leg.reason),
            "pdserve.placement": route.placement.value,
            "pdserve.prefill_node": leg.prefill_node,
            "pdserve.decode_node": leg.decode_node,
        }
        tracer.record("pdserve.route", request.span, routing_started_ns, now, _defined(where))
        self.prefill_failed |= route.prefill is not None
        attempt = {**where, "pdserve.resumed_tokens": resumed} if resumed else where
        self.attempt = tracer.start("pdserve.attempt", request.span, _defined(attempt), now, kind="client")

    def context(self) -> TraceContext | None:
        """What the nodes' spans of the current attempt hang under: the attempt span, or the
        client's context when this router does not trace."""
        tracer = self.request.tracer
        if tracer is None or self.attempt is None:
            return self.request.parent
        return tracer.context_of(self.attempt)

    def first_token(self, resumed: bool) -> None:
        """The attempt relayed its first token (of the sample, or after a migration)."""
        now = time.time_ns()
        if not resumed and self.request.first_token_ns is None:
            self.request.first_token_ns = now
        if self.attempt is not None:
            self.attempt.add_event("first_token", timestamp=now)

    def ended(self, outcome: Outcome | None, failure: BaseException | None) -> None:
        """The attempt is over: ``outcome`` as router.generation typed it, or None when it did
        not get one (``failure``: the error the sample fails with, or the sample was closed)."""
        tracer, span, self.attempt = self.request.tracer, self.attempt, None
        if tracer is None or span is None:
            return
        if isinstance(outcome, Retry):
            return tracer.end(
                span, {"pdserve.outcome": "retry", "pdserve.retry_reason": outcome.reason}, outcome.reason
            )
        if isinstance(outcome, Migrate):
            return tracer.end(span, {"pdserve.outcome": "migrate"}, outcome.error.message)
        if isinstance(outcome, Replay):
            return tracer.end(span, {"pdserve.outcome": "replay"}, outcome.reason)
        if isinstance(outcome, Done) or failure is None or isinstance(failure, GeneratorExit):
            # a sample closed early ended as the client wanted (a stop string, n choices done)
            return tracer.end(span, {"pdserve.outcome": "done"})
        if not isinstance(failure, Exception):  # CancelledError: the client left
            return tracer.end(span, {"pdserve.outcome": "cancelled"})
        message = failure.message if isinstance(failure, APIError) else repr(failure)
        tracer.end(span, {"pdserve.outcome": "error"}, message)
