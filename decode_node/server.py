"""The decode node: receives prompt KV from prefill nodes, decodes in one continuous batch, streams tokens.

One loop, one thread (the engine and the KV receiver share the block manager):

    ┌─► control socket: GenerateRequest (local prefill) / AbortRequest
    │   KV receiver: reservations (into the engine's queue through its KV connector), chunks,
    │       KVDone ─► the connector hears the KV landed; the next step decodes it
    │   engine.step(): one iteration of the continuous batch; the blocks its schedule grants
    │       queued reservations come back in its result, and the receiver sends each KVGrant
    │       (a step that grants reservations heading the queue computes nothing, so the grants
    │       go out before the next step computes)
    │   TokenChunks to each request's router; deadlines; status for heartbeats
    └── until drained

A request's state has three holders: the engine (its scheduler and connector), the receiver
(where a transfer's replies go and what has landed) and ``streams`` (where the client's tokens
go). An abort goes to the engine, which says whether a transfer must stop too.
"""

from __future__ import annotations

import dataclasses
import time

from pdserve.engine.core.requests import Aborted
from pdserve.kv_transfer.receiver import KVReceiver, ReceivedKV
from pdserve.node.parts import NodeParts
from pdserve.node.spans import NodeSpans
from pdserve.node.streams import (
    Stream,
    beam_output,
    engine_logprob,
    local_deadline,
    next_chunk,
    node_status,
)
from pdserve.protocol.messages import AbortRequest, GenerateRequest
from pdserve.protocol.reasons import FailureCode

# Longest sleep of an idle loop: any message wakes it at once; this bounds how late deadlines
# (transfer chunk timeouts, request TTLs) and the status refresh are looked at.
IDLE_WAIT_S = 0.05


class DecodeNode:
    """The decode role (decode or colocated, as ``opts.role`` says) on a node's parts
    (node.parts): the host's loop drives it."""

    def __init__(self, parts: NodeParts) -> None:
        self.opts, self.log, self.engine, self.runtime = parts.opts, parts.log, parts.engine, parts.runtime
        self.fingerprint = parts.fingerprint
        caches = parts.transfer_caches
        self.receiver = KVReceiver(
            f"tcp://{self.opts.host}:{self.opts.kv_port}",
            self.fingerprint,
            self.engine.kv_connector,
            [k for k, _ in caches],
            [v for _, v in caches],
            platform=self.engine.platform,
            auth=self.runtime.auth,
        )
        self.kv_addr = f"tcp://{self.opts.advertise_host}:{self.receiver.address.rsplit(':', 1)[1]}"
        self.streams: dict[str, Stream] = {}  # adopted or prefilled here: where the tokens go
        self.spans = None if parts.tracer is None else NodeSpans(parts.tracer, self.opts)  # node/spans.py

    def status(self):
        return node_status(
            self.opts,
            self.engine,
            self.runtime.control_addr,
            self.kv_addr,
            self.fingerprint,
            self.runtime.closing,
        )

    def start_draining(self) -> None:
        self.receiver.set_draining()
        self.runtime.set_status(self.status())  # routers see draining at the next beat

    def close(self, message: str) -> None:
        for request_id in list(self.streams):
            self._fail(request_id, FailureCode.DRAINING, message)
        self.receiver.close()

    def busy(self) -> bool:
        return bool(self.streams) or self.receiver.num_transfers > 0

    def wait_if_idle(self) -> None:
        if not self.engine.has_work():
            if not self.busy():
                self.engine.note_idle()
            self.runtime.wait_for_input(IDLE_WAIT_S, self.receiver.socket)

    def work(self) -> None:
        result = self.receiver.poll(0.0)
        for received in result.completed:
            self._adopt(received)
        for problem in result.refused:
            self.log.throttled("bad_message", port="kv", error=problem)
        for failure in result.failed:
            self.log("kv_failed", failure.request_id, error=repr(failure.error))
            meta = failure.request_meta  # the engine has dropped the request already
            if self.spans is not None:
                self.spans.land_failed(meta, failure.request_id, str(failure.error))
            if meta is not None:
                self.runtime.reply_failed(
                    meta.reply_addr,
                    failure.request_id,
                    FailureCode.KV_TRANSFER,
                    str(failure.error),
                    retryable=False,
                )
        if self.engine.has_work():
            step = self.engine.step()
            for reservation in step.kv.granted:  # KVGrant goes out
                self.receiver.grant(reservation)
            for out in step.outputs:
                self._emit(out)
        self._expire()
        self.runtime.refresh_status(self.status)

    # ----------------------------------------------------------------- control
    def on_control(self, msg) -> None:
        if isinstance(msg, AbortRequest):
            self._abort(msg.request_id, msg.reason)
        elif isinstance(msg, GenerateRequest):
            self._generate(msg)
        else:
            self.log("unexpected_message", tag=msg.TAG)

    def _generate(self, msg: GenerateRequest) -> None:
        """Conditional disaggregation: prefill here, then decode."""
        rid = msg.request_id
        if msg.decode_addr is not None:  # for a prefill node: this one was one, or the router's view lags
            return self.runtime.reply_failed(
                msg.reply_addr,
                rid,
                FailureCode.WRONG_ROLE,
                f"a {self.opts.role} node takes no decode_addr",
                True,
            )
        if self.runtime.admit(self.engine, msg) is None:
            return
        deadline = local_deadline(msg.deadline, self.opts.request_ttl_s)
        resumed = len(msg.output_token_ids)
        self.streams[rid] = Stream(
            rid, msg.reply_addr, len(msg.token_ids), deadline, num_sent=resumed, num_resumed=resumed
        )
        self.streams[rid].trace = msg.trace  # where its spans hang (node/spans.py)
        self.log(
            "request_added", rid, prompt_tokens=len(msg.token_ids), local_prefill=True, resumed_tokens=resumed
        )

    def _adopt(self, received: ReceivedKV) -> None:
        rid, meta = received.request_id, received.request_meta
        if meta is None:
            self.engine.abort_request(rid)
            self.log("kv_dropped", rid, reason="no reply address")
            return
        beams = received.sampling_params is not None and received.sampling_params.beam_search is not None
        stream = Stream(
            rid,
            meta.reply_addr,
            received.num_prompt_tokens,
            local_deadline(meta.deadline, self.opts.request_ttl_s),
            # the prefill node reported the first token, but not a beam search's: its beams answer here
            num_sent=0 if beams else 1,
            num_cached_tokens=received.prefill_cached_tokens,
            trace=meta.trace,
        )
        stream.timings = meta.timings.known()  # wall clocks of one host (or NTP-close hosts):
        stream.timings["transfer"] = round(max(0.0, time.time() - meta.shipped_at), 6)
        stream.timings["kv_bytes"] = received.bytes_received
        stream.adopted_at = time.monotonic()
        self.streams[rid] = stream
        if self.spans is not None:
            self.spans.landed(stream, meta, received)
        self.log("kv_adopted", rid, blocks_reused=received.num_held_blocks, bytes=received.bytes_received)
        first_logprob = engine_logprob(received.first_logprobs) if received.first_logprobs else None
        try:  # the next step takes the first token (and emits the request if that ends it)
            self.engine.kv_connector.kv_arrived(rid, received.first_token, first_logprob)
        except ValueError as exc:  # what the prefill node sent cannot start it
            return self._fail(rid, FailureCode.KV_TRANSFER, str(exc))

    def _abort(self, request_id: str, reason: str) -> None:
        """An abort that beats its KV here finds nothing: the prefill node, told too, skips or
        aborts the shipment, and a request adopted anyway is aborted by the router at its first
        stray token."""
        if self._stop(request_id, reason):
            self.log("request_aborted", request_id, reason=reason)
        self.streams.pop(request_id, None)

    def _stop(self, request_id: str, reason: str) -> Aborted:
        """Drop the request in the engine and stop the transfer writing its blocks, if any."""
        where = self.engine.abort_request(request_id)
        if where is Aborted.KV_INBOUND:
            self.receiver.stop(request_id, reason)
        return where

    # ----------------------------------------------------------------- output
    def _emit(self, out) -> None:
        stream = self.streams.get(out.request_id)
        if stream is None:
            return
        if stream.adopted_at is not None and "decode_queue" not in stream.timings:
            stream.timings["decode_queue"] = round(time.monotonic() - stream.adopted_at, 6)
        if out.finished:
            stream.timings["decode"] = round(time.monotonic() - stream.started, 6)
        if stream.adopted_at is None:  # prefilled here: the hit is this engine's own
            stream.num_cached_tokens = out.num_cached_tokens
        is_first = stream.num_sent == 0
        prompt_logprobs = out.prompt_logprobs if is_first else None  # prefilled here (else None)
        chunk = next_chunk(stream, out.outputs[0], self.opts.node_id, is_first, prompt_logprobs)
        if chunk is not None and len(out.outputs) > 1:  # a beam search's answer: every beam at once
            chunk = dataclasses.replace(chunk, beams=tuple(beam_output(o) for o in out.outputs[1:]))
        if chunk is not None:
            self.runtime.reply(stream.reply_addr, chunk)
        if self.spans is not None:
            self.spans.emitted(stream, out)
        if out.finished:
            del self.streams[out.request_id]
            self.log(
                "request_finished",
                out.request_id,
                finish_reason=out.outputs[0].finish_reason,
                output_tokens=len(out.outputs[0].token_ids),
                local_prefill=stream.adopted_at is None,
                cached_tokens=stream.num_cached_tokens,
            )

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, s in self.streams.items() if s.deadline < now]:
            self._fail(rid, FailureCode.TIMEOUT, "request exceeded its time to live on the decode node")

    def _fail(self, request_id: str, code: FailureCode, message: str) -> None:
        stream = self.streams.pop(request_id, None)
        self._stop(request_id, message)
        if stream is not None and self.spans is not None:
            self.spans.failed(stream, message)
        if stream is not None:
            self.runtime.reply_failed(stream.reply_addr, request_id, code, message, retryable=False)
