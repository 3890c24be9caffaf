"""A node's OpenTelemetry spans of its requests (protocol/tracing.py sets the tracer up; the
router's spans are router/spans.py; docs/operations.md, "Traces", lists them all).

Each span is recorded whole once its stage is over, from times the node keeps anyway (its
``Stream``, the engine's first-scheduled time, the shipper's outcome): the engine loop holds no span
open across steps, and a request nobody traces (``Stream.trace`` None) costs one test per hook.
Every span hangs under the trace context its request came with (the router's attempt span), so one
request's spans from the router, the prefill node and the decode node share the client's trace.

    prefill node (service pdserve-prefill)
      pdserve.prefill.queue    arrival on the node → the prompt's first step
      pdserve.prefill          first step → first token (gen_ai.usage.input_tokens, cached tokens)
      pdserve.kv.reserve       KVReserve sent → the decode node granted blocks (or refused)
      pdserve.kv.send          grant → KVAck (bytes, blocks sent and reused, path: shm/direct/socket)
    decode node (service pdserve-decode, or pdserve-colocated)
      pdserve.kv.land          the prefill node shipped → the KV is this node's (bytes received)
      pdserve.decode.queue     landed → the request's first decode step
      pdserve.prefill          a prompt prefilled here: arrival → first token (queue included)
      pdserve.decode           landed (or first token) → last token (output tokens, finish reason)

Wall clocks of two hosts meet in pdserve.kv.land (the prefill node's shipping time), as in the
``transfer`` stage timing: NTP-close clocks keep it right.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.engine.core.outputs import RequestOutput
from pdserve.kv_transfer.outcomes import ReceivedKV
from pdserve.node.options import NodeOptions
from pdserve.node.streams import Stream
from pdserve.prefill_node.shipper import Outcome
from pdserve.protocol.messages import RequestMeta, TraceContext
from pdserve.protocol.registry import Role
from pdserve.protocol.tracing import Tracer


def _wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as the wall clock's nanoseconds, as spans take them."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def transfer_path(shm: bool, direct: bool) -> str:
    """How the KV went: direct (the decode node copied from our shared cache), shm (chunks through
    a shared staging ring), socket (chunks over ZeroMQ)."""
    return "direct" if direct else "shm" if shm else "socket"


class NodeSpans:
    """One role's spans (a node that switches roles makes another)."""

    def __init__(self, tracer: Tracer, opts: NodeOptions) -> None:
        self.tracer = tracer
        self._prefills_only = opts.role is Role.PREFILL  # what stage a failed request was in
        self._node = {"pdserve.node_id": opts.node_id, "pdserve.node.role": str(opts.role)}

    def _record(
        self,
        name: str,
        trace: TraceContext,
        request_id: str,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        fields = {"pdserve.request_id": request_id, **self._node, **(attributes or {})}
        self.tracer.record(name, trace, start_ns, end_ns, fields, error)

    # ----------------------------------------------------------------- prefill
    def prefilled(self, stream: Stream, first_step: float, first_token: float) -> None:
        """The prompt is computed (``first_step``, ``first_token``: time.monotonic())."""
        if stream.trace is None:
            return
        arrived, started, done = _wall_ns(stream.started), _wall_ns(first_step), _wall_ns(first_token)
        self._record("pdserve.prefill.queue", stream.trace, stream.request_id, arrived, started)
        self._record("pdserve.prefill", stream.trace, stream.request_id, started, done, self._prompt(stream))

    def _prompt(self, stream: Stream) -> dict[str, Any]:
        return {
            "gen_ai.usage.input_tokens": stream.num_prompt_tokens,
            "gen_ai.usage.cache_read.input_tokens": stream.num_cached_tokens,
        }

    def shipped(self, stream: Stream, outcome: Outcome, decode_addr: str) -> None:
        """The shipper's outcome of a transfer that began: reserve and send, or where it failed."""
        if stream.trace is None or outcome.started_at is None:
            return
        rid, started, ended = stream.request_id, int(outcome.started_at * 1e9), time.time_ns()
        granted = None if outcome.granted_at is None else int(outcome.granted_at * 1e9)
        peer = {"pdserve.kv.decode_addr": decode_addr}
        if granted is None:  # refused, or no grant in time: the reservation is where it failed
            return self._record("pdserve.kv.reserve", stream.trace, rid, started, ended, peer, outcome.error)
        self._record("pdserve.kv.reserve", stream.trace, rid, started, granted, peer)
        s = outcome.stats
        sent = (
            peer
            if s is None
            else peer
            | {
                "pdserve.kv.path": transfer_path(s.shm, s.direct),
                "pdserve.kv.bytes": s.bytes_sent,
                "pdserve.kv.blocks_sent": s.num_sent_blocks,
                "pdserve.kv.blocks_reused": s.num_held_blocks,
            }
        )
        self._record("pdserve.kv.send", stream.trace, rid, granted, ended, sent, outcome.error)

    # ----------------------------------------------------------------- decode
    def landed(self, stream: Stream, meta: RequestMeta, received: ReceivedKV) -> None:
        """A prefill node's KV is this node's now."""
        if stream.trace is None:
            return
        attributes = {
            "pdserve.kv.bytes": received.bytes_received,
            "pdserve.kv.blocks_reused": received.num_held_blocks,
        }
        shipped = int(meta.shipped_at * 1e9)
        self._record("pdserve.kv.land", stream.trace, stream.request_id, shipped, time.time_ns(), attributes)

    def land_failed(self, meta: RequestMeta | None, request_id: str, error: str) -> None:
        """A transfer into this node failed (timeout, bad checksum, the peer's abort)."""
        if meta is None or meta.trace is None:
            return
        shipped = int(meta.shipped_at * 1e9)
        self._record("pdserve.kv.land", meta.trace, request_id, shipped, time.time_ns(), None, error)

    def emitted(self, stream: Stream, out: RequestOutput) -> None:
        """The node sent the request's tokens of a step: a local prefill is over at the first, the
        decode at the last."""
        if stream.trace is None:
            return
        now = time.monotonic()
        if stream.first_emit_at is None:
            stream.first_emit_at = now
            if stream.adopted_at is None:  # prefilled here: its first token just left
                prompt = self._prompt(stream) | {"pdserve.local_prefill": True}
                started = _wall_ns(stream.started)
                self._record(
                    "pdserve.prefill", stream.trace, stream.request_id, started, _wall_ns(now), prompt
                )
        if not out.finished:
            return
        if stream.adopted_at is not None:
            self._record(
                "pdserve.decode.queue",
                stream.trace,
                stream.request_id,
                _wall_ns(stream.adopted_at),
                _wall_ns(stream.first_emit_at),
            )
        outcome = {
            "gen_ai.usage.output_tokens": len(out.outputs[0].token_ids),
            "gen_ai.response.finish_reasons": tuple(str(o.finish_reason) for o in out.outputs),
        }
        start = stream.adopted_at if stream.adopted_at is not None else stream.first_emit_at
        self._record(
            "pdserve.decode", stream.trace, stream.request_id, _wall_ns(start), _wall_ns(now), outcome
        )

    # ----------------------------------------------------------------- either
    def failed(self, stream: Stream, error: str) -> None:
        """The node gave the request up (timeout, draining, a bad handover): its stage under way
        ends in error. A transfer's failure is ``shipped``'s."""
        if stream.trace is None:
            return
        now = time.time_ns()
        if self._prefills_only:
            if "prefill_compute" not in stream.timings:  # not prefilled yet
                self._record(
                    "pdserve.prefill",
                    stream.trace,
                    stream.request_id,
                    _wall_ns(stream.started),
                    now,
                    None,
                    error,
                )
            return
        start = stream.adopted_at if stream.adopted_at is not None else stream.started
        self._record("pdserve.decode", stream.trace, stream.request_id, _wall_ns(start), now, None, error)
