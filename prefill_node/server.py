"""The prefill node: batched, chunked prefill with prefix caching; ships KV; reports the first token.

control socket ──GenerateRequest──► engine (KVTransfer.SEND: stops after the first token; the
                                    step's result says its KV is held) ──► Shipper thread ──KV──►
                                    decode node; the first token to the router once the decode
                                    node granted blocks
Shipper outcome ──► engine.kv_connector.send_finished (the blocks stay as evictable prefix cache)

A request's state has three holders: the engine (its scheduler's WAITING / RUNNING /
HELD_FOR_TRANSFER, and its connector's send), the transport (the shipper's job), and the client
stream (``pending``: where the reply goes, and what of it the router has seen). Held blocks are
released only through the shipper's outcome while a transfer may read them, so an abort or a
timeout meanwhile waits for it.
"""

from __future__ import annotations

import dataclasses
import queue
import time

from pdserve.engine.core.kv_connector import HeldKV, KVTransfer
from pdserve.kv_transfer.messages import KVShipment
from pdserve.node.parts import NodeParts
from pdserve.node.spans import NodeSpans
from pdserve.node.streams import (
    Stream,
    local_deadline,
    next_chunk,
    node_status,
    wire_logprob,
)
from pdserve.prefill_node.shipper import FirstToken, Granted, Outcome, Shipment, Shipper
from pdserve.protocol.messages import AbortRequest, GenerateRequest, RequestMeta, StageTimings
from pdserve.protocol.reasons import FailureCode
from pdserve.protocol.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)
class _Pending:
    """The client stream's record of one request."""

    stream: Stream
    decode_addr: str
    params: SamplingParams  # for the decode node
    deadline: float  # the request's wall-clock deadline, passed on to the decode node
    shipping: bool = False  # its KV is with the shipper, which may be reading its blocks
    first_token_sent: bool = False  # the router has seen its first token: it may not retry elsewhere


IDLE_WAIT_S = 0.05  # longest sleep of an idle loop: a control message wakes it at once


class PrefillNode:
    """The prefill role on a node's parts (node.parts): the host's loop drives it."""

    def __init__(self, parts: NodeParts) -> None:
        self.opts, self.log, self.engine, self.runtime = parts.opts, parts.log, parts.engine, parts.runtime
        self.cache = parts.cache
        self.fingerprint = parts.fingerprint
        caches = parts.transfer_caches
        self.shipper = Shipper(
            self.fingerprint,
            [k for k, _ in caches],
            [v for _, v in caches],
            cache_ref=self.cache.ref if self.cache is not None else None,
            log=self.log,
            platform=self.engine.platform,
            auth=self.runtime.auth,
        )
        self.pending: dict[str, _Pending] = {}  # computing or shipping: where the reply goes
        self.spans = None if parts.tracer is None else NodeSpans(parts.tracer, self.opts)  # node/spans.py

    def status(self):
        return node_status(
            self.opts,
            self.engine,
            self.runtime.control_addr,
            None,
            self.fingerprint,
            self.runtime.closing,
        )

    def busy(self) -> bool:
        return bool(self.pending or self.engine.stats().num_held)

    def start_draining(self) -> None:
        self.runtime.set_status(self.status())  # routers see draining at the next beat

    def close(self, message: str) -> None:
        for rid in list(self.pending):
            self._fail(rid, FailureCode.DRAINING, message)
        self.shipper.close()
        while True:  # what the workers said before they stopped: held blocks go back
            try:
                self._settle(self.shipper.outcomes.get_nowait())
            except queue.Empty:
                break

    def wait_if_idle(self) -> None:
        if not self.engine.has_work() and not self.pending:
            self.engine.note_idle()
            self.runtime.wait_for_input(IDLE_WAIT_S)

    def work(self) -> None:
        if self.engine.has_work():
            step = self.engine.step()
            held = {h.request_id: h for h in step.kv.held}
            for out in step.outputs:
                if out.finished:
                    self._prefilled(out, held.get(out.request_id))
        elif self.pending:
            time.sleep(0.001)  # only transfers in flight: don't spin
        while True:
            try:
                self._settle(self.shipper.outcomes.get_nowait())
            except queue.Empty:
                break
        self._expire()
        self.runtime.refresh_status(self.status)

    def on_control(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            self._accept(msg)
        elif isinstance(msg, AbortRequest):
            pending = self.pending.pop(msg.request_id, None)
            if pending is not None:
                self._drop(msg.request_id, pending)
                self.log("request_aborted", msg.request_id, reason=msg.reason)
        else:
            self.log("unexpected_message", tag=msg.TAG)

    def _accept(self, msg: GenerateRequest) -> None:
        rid = msg.request_id
        if msg.decode_addr is None:  # for a decode node: this one was one, or the router's view lags
            return self.runtime.reply_failed(
                msg.reply_addr, rid, FailureCode.WRONG_ROLE, "a prefill node needs decode_addr", True
            )
        params = self.runtime.admit(self.engine, msg, KVTransfer.SEND)
        if params is None:
            return
        deadline = local_deadline(msg.deadline, self.opts.request_ttl_s)
        stream = Stream(rid, msg.reply_addr, len(msg.token_ids), deadline, trace=msg.trace)
        self.pending[rid] = _Pending(stream, msg.decode_addr, params, msg.deadline)
        self.log("request_added", rid, prompt_tokens=len(msg.token_ids), decode_addr=msg.decode_addr)

    def _prefilled(self, out, held: HeldKV | None) -> None:
        """First token sampled: ship the KV (``held``: the engine holds it for the transfer), and
        report the token once the decode node has granted blocks for it. A refusal before then
        (draining, full) leaves the router free to retry the request on another pair: no token of
        it was seen. A first token that ended the request (the engine holds nothing) goes at once."""
        rid = out.request_id
        pending = self.pending.get(rid)
        if pending is None:
            if held is not None:
                self.engine.abort_request(rid)  # nobody waits for it: the held blocks go
            return
        stream, completion = pending.stream, out.outputs[0]
        stream.num_cached_tokens = out.num_cached_tokens
        now = time.monotonic()
        started = (
            held.first_scheduled_time if held is not None and held.first_scheduled_time else stream.started
        )
        stream.timings["prefill_queue"] = round(started - stream.started, 6)
        stream.timings["prefill_compute"] = round(now - started, 6)
        if self.spans is not None:
            self.spans.prefilled(stream, started, now)
        if held is None:
            chunk = next_chunk(stream, completion, self.opts.node_id, True, out.prompt_logprobs)
            assert chunk is not None  # nothing was sent yet: the first token is new
            self.runtime.reply(stream.reply_addr, chunk)
            self.log("first_token_sent", rid, cached_tokens=stream.num_cached_tokens)
            del self.pending[rid]
            return
        # The request goes on on the decode node: the first chunk carries no finish reason. It goes
        # out from the shipper's worker the moment blocks are granted (not after this loop's next
        # engine step); until then the router has seen nothing. A beam search's first step is the
        # decode node's, from the candidates the first token's logprobs list; the router hears of
        # it only from there.
        first = dataclasses.replace(completion, finish_reason=None)
        first_chunk = next_chunk(
            dataclasses.replace(stream), first, self.opts.node_id, True, out.prompt_logprobs
        )
        assert first_chunk is not None  # nothing was sent yet: the first token is new
        kv = KVShipment(
            rid,
            held.prompt_token_ids,
            held.block_ids,
            completion.token_ids[0],
            out.num_cached_tokens,
            pending.params,
            RequestMeta(
                reply_addr=stream.reply_addr,
                deadline=pending.deadline,
                shipped_at=time.time(),
                timings=StageTimings(**stream.timings),
                trace=stream.trace,  # the decode node's spans join the same trace
            ),
            wire_logprob(completion.logprobs[0]) if completion.logprobs else None,
        )
        beams = pending.params.beam_search is not None
        report = None if beams else FirstToken(stream.reply_addr, first_chunk)
        if not self.shipper.submit(Shipment(kv, pending.decode_addr, report)):  # its held blocks go
            self._fail(rid, FailureCode.OVERLOADED, "too many KV transfers queued for that decode node")
            return
        pending.shipping = True

    def _settle(self, outcome: Granted | Outcome) -> None:
        pending = self.pending.get(outcome.request_id)
        if outcome.first_token_sent and pending is not None:
            pending.first_token_sent = True  # the router has seen it: no retry elsewhere now
        if isinstance(outcome, Granted):
            return
        rid = outcome.request_id
        if not self.engine.kv_connector.send_finished(rid):  # KV is on the decode node now, or it failed
            self.log("release_without_held_blocks", rid)  # would mean a block accounting bug
        if pending is None:
            return
        pending.shipping = False
        if self.spans is not None:
            self.spans.shipped(pending.stream, outcome, pending.decode_addr)
        if outcome.error is None:
            del self.pending[rid]
            s = outcome.stats
            assert s is not None  # a transfer that succeeded has its stats
            self.log(
                "kv_shipped",
                rid,
                blocks_sent=s.num_sent_blocks,
                blocks_reused=s.num_held_blocks,
                bytes=s.bytes_sent,
                seconds=round(s.seconds, 6),
                shm=s.shm,
                direct=s.direct,
            )
        else:
            # Refused before its first token was sent: the router retries elsewhere, blaming D.
            code = FailureCode.DECODE_REJECTED if outcome.rejected else FailureCode.KV_TRANSFER
            self._fail(rid, code, outcome.error)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, p in self.pending.items() if p.stream.deadline < now]:
            self._fail(rid, FailureCode.TIMEOUT, "request exceeded its time to live on the prefill node")

    def _fail(self, rid: str, code: FailureCode, message: str) -> None:
        """Tell the router; retryable only while it has seen no token from us."""
        pending = self.pending.pop(rid, None)
        if pending is None:
            return
        if self.spans is not None:
            self.spans.failed(pending.stream, message)
        self._drop(rid, pending)
        self.runtime.reply_failed(pending.stream.reply_addr, rid, code, message, not pending.first_token_sent)

    def _drop(self, rid: str, pending: _Pending) -> None:
        """Stop work on a request; held blocks (the shipper may be reading them) wait for its outcome."""
        if pending.shipping:
            self.shipper.cancel(rid)
        else:
            self.engine.abort_request(rid)
