"""The prefill node: batched, chunked prefill with prefix caching; ships KV; reports the first token.

control socket ──GenerateRequest──► engine (prefill-only: stops after the first token, its
                                    sequence HELD_FOR_TRANSFER) ──► Shipper thread ──KV──► decode node
                                    first token to the router once the decode node granted blocks
Shipper outcome ──► engine.kv_connector.release (the blocks stay as evictable prefix cache)

A request's state is the engine's (its scheduler's WAITING / RUNNING / HELD_FOR_TRANSFER); this
node keeps only where its reply goes (``pending``). Held blocks are released only through the
shipper's outcome while a transfer may read them, so an abort or a timeout meanwhile waits for it.
"""

from __future__ import annotations

import dataclasses
import queue
import time

from pdserve.kv_transfer.messages import KVShipment
from pdserve.node.parts import NodeParts
from pdserve.node.streams import (
    Stream,
    local_deadline,
    next_chunk,
    node_status,
    wire_logprob,
)
from pdserve.node.transfer_caches import transfer_caches
from pdserve.prefill_node.shipper import FirstToken, Granted, Outcome, Shipment, Shipper
from pdserve.protocol.messages import AbortRequest, GenerateRequest, RequestMeta, StageTimings
from pdserve.protocol.reasons import FailureCode
from pdserve.protocol.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)
class _Pending:
    stream: Stream
    decode_addr: str
    params: SamplingParams  # for the decode node
    deadline: float  # the request's wall-clock deadline, passed on to the decode node


IDLE_WAIT_S = 0.05  # longest sleep of an idle loop: a control message wakes it at once


class PrefillNode:
    """The prefill role on a node's parts (node.parts): the host's loop drives it."""

    def __init__(self, parts: NodeParts) -> None:
        self.opts, self.log, self.engine, self.runtime = parts.opts, parts.log, parts.engine, parts.runtime
        self.cache = parts.cache
        self.fingerprint = parts.fingerprint
        caches = transfer_caches(self.engine.executor.rank_pools)
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
        if not self.engine.has_unfinished_requests() and not self.pending:
            self.engine.note_idle()
            self.runtime.wait_for_input(IDLE_WAIT_S)

    def work(self) -> None:
        if self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    self._prefilled(out)
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
            if msg.request_id in self.pending:
                self._drop(msg.request_id)
                del self.pending[msg.request_id]
                self.log("request_aborted", msg.request_id, reason=msg.reason)
        else:
            self.log("unexpected_message", tag=msg.TAG)

    def _accept(self, msg: GenerateRequest) -> None:
        rid = msg.request_id
        if msg.decode_addr is None:  # for a decode node: this one was one, or the router's view lags
            return self.runtime.reply_failed(
                msg.reply_addr, rid, FailureCode.WRONG_ROLE, "a prefill node needs decode_addr", True
            )
        params = self.runtime.admit(self.engine, msg, prefill_only=True)
        if params is None:
            return
        stream = Stream(
            rid, msg.reply_addr, len(msg.token_ids), local_deadline(msg.deadline, self.opts.request_ttl_s)
        )
        self.pending[rid] = _Pending(stream, msg.decode_addr, params, msg.deadline)
        self.log("request_added", rid, prompt_tokens=len(msg.token_ids), decode_addr=msg.decode_addr)

    def _prefilled(self, out) -> None:
        """First token sampled: ship the KV, and report the token once the decode node has granted
        blocks for it. A refusal before then (draining, full) leaves the router free to retry the
        request on another pair: no token of it was seen. A token that ends the request goes at once."""
        rid = out.request_id
        pending = self.pending.get(rid)
        if pending is None:
            self.engine.kv_connector.release(rid)
            return
        stream, completion = pending.stream, out.outputs[0]
        stream.num_cached_tokens = out.num_cached_tokens
        seq = self.engine.kv_connector.held(rid)
        now = time.monotonic()
        started = seq.first_scheduled_time if seq is not None and seq.first_scheduled_time else stream.started
        stream.timings["prefill_queue"] = round(started - stream.started, 6)
        stream.timings["prefill_compute"] = round(now - started, 6)
        # the engine says whether the request goes on on the decode node (the first token did not
        # end it): then the first chunk carries no finish reason
        # A beam search always goes on: its first step is the decode node's, from the candidates
        # the first token's logprobs list; the router hears of it only from there.
        beams = pending.params.beam_search is not None
        continues = completion.continues or beams
        first = completion if not continues else dataclasses.replace(completion, finish_reason=None)
        if not continues:
            chunk = next_chunk(stream, first, self.opts.node_id, True, out.prompt_logprobs)
            assert chunk is not None  # nothing was sent yet: the first token is new
            self.runtime.reply(stream.reply_addr, chunk)
            self.log("first_token_sent", rid, cached_tokens=stream.num_cached_tokens)
            self.engine.kv_connector.release(rid)
            del self.pending[rid]
            return
        # The chunk goes out from the shipper's worker the moment blocks are granted (not after this
        # loop's next engine step); until then the router has seen nothing (the engine's
        # first_token_sent stays False).
        first_chunk = next_chunk(
            dataclasses.replace(stream), first, self.opts.node_id, True, out.prompt_logprobs
        )
        assert first_chunk is not None  # nothing was sent yet: the first token is new
        assert seq is not None  # a request that goes on holds its blocks for the transfer
        kv = KVShipment(
            rid,
            tuple(seq.token_ids[: seq.num_prompt_tokens]),
            tuple(seq.block_table),
            completion.token_ids[0],
            out.num_cached_tokens,
            pending.params,
            RequestMeta(
                reply_addr=stream.reply_addr,
                deadline=pending.deadline,
                shipped_at=time.time(),
                timings=StageTimings(**stream.timings),
            ),
            wire_logprob(completion.logprobs[0]) if completion.logprobs else None,
        )
        report = None if beams else FirstToken(stream.reply_addr, first_chunk)
        shipment = Shipment(kv, pending.decode_addr, report)
        if not self.shipper.submit(shipment):
            self.engine.kv_connector.release(rid)  # no transfer reads them
            self._fail(rid, FailureCode.OVERLOADED, "too many KV transfers queued for that decode node")

    def _settle(self, outcome: Granted | Outcome) -> None:
        if outcome.first_token_sent:
            # the worker sent the first token: the engine knows the request may not retry elsewhere
            self.engine.kv_connector.note_first_token_sent(outcome.request_id)
        if isinstance(outcome, Granted):
            return
        rid = outcome.request_id
        first_token_sent = self.engine.kv_connector.first_token_sent(rid)  # asked before the blocks go
        if not self.engine.kv_connector.release(rid):  # KV is on the decode node now, or the request failed
            self.log("release_without_held_blocks", rid)  # would mean a block accounting bug
        pending = self.pending.pop(rid, None)
        if pending is None:
            return
        if outcome.error is None:
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
            self.pending[rid] = pending
            # Refused before its first token was sent: the router retries elsewhere, blaming D.
            self._fail(
                rid,
                FailureCode.DECODE_REJECTED if outcome.rejected else FailureCode.KV_TRANSFER,
                outcome.error,
                first_token_sent,
            )

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, p in self.pending.items() if p.stream.deadline < now]:
            self._fail(rid, FailureCode.TIMEOUT, "request exceeded its time to live on the prefill node")

    def _fail(self, rid: str, code: FailureCode, message: str, first_token_sent: bool | None = None) -> None:
        """Tell the router; retryable only while it has seen no token from us (the engine's
        record, or ``first_token_sent`` where the held request was released already)."""
        if first_token_sent is None:
            first_token_sent = self.engine.kv_connector.first_token_sent(rid)
        pending = self.pending.pop(rid, None)
        self._drop(rid)
        if pending is not None:
            self.runtime.reply_failed(pending.stream.reply_addr, rid, code, message, not first_token_sent)

    def _drop(self, rid: str) -> None:
        """Stop work on a request; held blocks (a shipper may be reading them) wait for its outcome."""
        if self.engine.kv_connector.held(rid) is not None:
            self.shipper.cancel(rid)
        else:
            self.engine.abort_request(rid)
