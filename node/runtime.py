"""What every node process has: a control socket, reply channels, heartbeats, a drain signal.

    router DEALER ──GenerateRequest / AbortRequest / StatusQuery──► ROUTER control socket
    node   PUSH   ──TokenChunk / RequestFailed──────────────────► router's reply address

The node's own loop calls ``poll_control`` and ``reply``; heartbeats run on a thread that
publishes the latest ``NodeInfo`` the loop handed to ``set_status``.

Busy is not dead. A heartbeat vouches for the engine's progress, not for the thread: the loop
stamps it each round, and the engine stamps it before every decoder layer of a step
(``in_step``), so a long step on a slow or shared machine keeps the node in the pool while a
hung kernel or a deadlock does not. Each record's TTL ends at most ``stall_timeout_s`` after the
last stamp, so a stuck node leaves the pool then although its heartbeat thread runs on, and
comes back when the engine moves again. Between layers ``in_step`` also answers status queries
(at most every ``IN_STEP_SERVICE_S``): in static mode, where the router learns liveness from
those answers alone, a computing node answers and a stuck one does not. Other control messages
that arrive mid-step wait (bounded) for the loop's next ``poll_control``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time

import zmq

from pdserve.engine.core.kv_connector import KVTransfer
from pdserve.engine.core.requests import QueueFullError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.node.log import EventLog
from pdserve.node.options import NodeOptions
from pdserve.protocol import registry
from pdserve.protocol.channel import ListenChannel, PushChannels
from pdserve.protocol.channel_auth import ChannelAuth
from pdserve.protocol.cluster_key import load_key
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.messages import (
    GenerateRequest,
    Message,
    NodeStatus,
    RequestFailed,
    StatusQuery,
    decode_frames,
    reply_address_of,
)
from pdserve.protocol.reasons import FailureCode
from pdserve.protocol.sampling_params import SamplingParams

MAX_REPLY_CHANNELS = 64  # routers a node talks back to at once (LRU beyond)
IN_STEP_SERVICE_S = 0.05  # how often a step's layers answer status queries
MAX_STASHED = 1024  # control messages read mid-step and kept for the loop; more stay in ZeroMQ


class NodeRuntime:
    def __init__(self, opts: NodeOptions, log: EventLog) -> None:
        self.opts = opts
        self.log = log
        # the cluster key signs the registry record and authenticates every socket; read first,
        # so a bad key file fails before anything is bound
        self._key = load_key(opts.cluster_key_file) if opts.cluster_key_file else None
        refused = lambda message: log.throttled("peer_refused", error=message)  # noqa: E731
        self.auth = ChannelAuth(self._key, refused) if self._key is not None else None
        self.control = ListenChannel(opts.control_addr, decoder=decode_frames, auth=self.auth)
        port = self.control.address.rsplit(":", 1)[1]
        self.control_addr = f"tcp://{opts.advertise_host}:{port}"  # what others connect to
        self._replies = PushChannels(MAX_REPLY_CHANNELS, self.auth)
        self.draining = threading.Event()  # SIGTERM: finish what is held, then exit
        self.switching = False  # between roles (node.host): finish what is held, take nothing new
        self.stopped = threading.Event()
        self._beat_now = threading.Event()  # publish the record without waiting out the interval
        self._status: registry.NodeInfo | None = None
        self._status_at = 0.0  # time.monotonic() of the last refresh
        self._progress_at = time.monotonic()  # when the loop went round or a step's layer started
        self._serviced_at = 0.0  # when a step last answered status queries
        self._stash: list[Message] = []  # control messages read mid-step, for the next poll_control
        self._redis = None
        self._heartbeat: threading.Thread | None = None
        self.integrity_error: str | None = None  # set when an invariant check failed in the loop

    # ----------------------------------------------------------------- lifecycle
    def start(self, status: registry.NodeInfo, ready_file: str | None) -> None:
        self._status = status
        self._progress_at = time.monotonic()
        signal.signal(signal.SIGTERM, lambda *_: self.draining.set())
        signal.signal(signal.SIGINT, lambda *_: self.draining.set())
        if self.opts.redis_url:
            self._redis = registry.connect(
                self.opts.redis_url,
                self.opts.redis_password_file,
                socket_timeout=2.0,
                socket_connect_timeout=2.0,
            )
            registry.publish(self._redis, status, self.opts.heartbeat_ttl_s, self._key)
            self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
            self._heartbeat.start()
        if ready_file:
            self.write_ready_file(status, ready_file)
        self.log(
            "node_started",
            role=status.role,
            control_addr=status.control_addr,
            kv_addr=status.kv_addr,
            redis=bool(self._redis),
            signed=self._key is not None,
        )

    def write_ready_file(self, status: registry.NodeInfo, ready_file: str) -> None:
        """The node's role and addresses as JSON, replaced whole (readers never see half of it)."""
        tmp = f"{ready_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(
                {
                    "node_id": status.node_id,
                    "role": status.role,
                    "control_addr": status.control_addr,
                    "kv_addr": status.kv_addr,
                    "pid": os.getpid(),
                },
                f,
            )
        os.replace(tmp, ready_file)

    @property
    def closing(self) -> bool:
        """Takes no new requests: draining for exit or between roles (the record says draining)."""
        return self.draining.is_set() or self.switching

    def publish_soon(self) -> None:
        """Have the heartbeat thread publish the latest status now (a new role, a drain): the one
        writer of the record, so stamps reach Redis in the order they were taken."""
        self._beat_now.set()

    def run(self, iterate, in_flight, on_drain) -> None:
        """The node loop: ``iterate()`` until SIGTERM, then until ``in_flight()`` is false or the
        drain timeout passes. ``on_drain()`` runs once when draining starts."""
        drain_deadline: float | None = None
        while True:
            self._progress_at = time.monotonic()
            if self.draining.is_set():
                if drain_deadline is None:
                    drain_deadline = time.monotonic() + self.opts.drain_timeout_s
                    on_drain()
                    self.log("draining")
                if not in_flight() or time.monotonic() > drain_deadline:
                    return
            try:
                iterate()
            except AssertionError as exc:  # an invariant broke: this node's state cannot be trusted
                self.report_fatal(str(exc) or type(exc).__name__)
                raise

    def report_fatal(self, why: str) -> None:
        """The node cannot serve any more (a broken invariant, a lost tensor-parallel rank):
        publish a last record saying why (it stays until its TTL, not withdrawn at close)."""
        self.integrity_error = why
        self.log("integrity_failed", error=self.integrity_error)
        if self._status is not None:
            self._status = dataclasses.replace(
                self._status, draining=True, integrity_error=self.integrity_error
            )
            if self._redis is not None:
                try:
                    registry.publish(self._redis, self._status, self.opts.heartbeat_ttl_s, self._key)
                except Exception as exc_publish:
                    self.log("heartbeat_failed", error=repr(exc_publish))

    def refresh_status(self, make_status, every_s: float = 0.1) -> None:
        """Recompute the status record (for heartbeats and StatusQuery) at most every ``every_s``."""
        if self.integrity_error is not None:
            return
        now = time.monotonic()
        if now - self._status_at >= every_s:
            self._status = make_status()
            self._status_at = now

    def set_status(self, status: registry.NodeInfo) -> None:
        self._status = status

    def _beat(self) -> None:
        stalled = False
        while True:
            self._beat_now.wait(self.opts.heartbeat_interval_s)
            self._beat_now.clear()
            if self.stopped.is_set() or self.integrity_error is not None:
                break
            ttl_s = self.beat_ttl_s(time.monotonic())
            if ttl_s is None:
                if not stalled:
                    self.log("loop_stalled", seconds=round(time.monotonic() - self._progress_at, 3))
                stalled = True
                continue  # the last record expires on its own
            if stalled:
                self.log("loop_resumed")
                stalled = False
            assert self._status is not None  # start() set it before it started this thread
            try:
                registry.publish(self._redis, self._status, ttl_s, self._key)
            except Exception as exc:  # Redis down: keep serving, retry next beat
                self.log("heartbeat_failed", error=repr(exc))

    def beat_ttl_s(self, now: float) -> float | None:
        """The TTL of a record published ``now``: the heartbeat TTL, cut so that it ends
        ``stall_timeout_s`` after the engine last made progress; None once that has passed."""
        left_s = self._progress_at + self.opts.stall_timeout_s - now
        if left_s <= 0.001:
            return None
        return min(self.opts.heartbeat_ttl_s, left_s)

    def close(self) -> None:
        self.stopped.set()
        self._beat_now.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self._redis is not None and self.integrity_error is None:
            try:
                registry.withdraw(self._redis, self.opts.node_id)
            except Exception as exc:
                self.log("withdraw_failed", error=repr(exc))
        self.control.close()
        self._replies.close()
        if self.auth is not None:
            self.auth.close()
        self.log("node_stopped")

    # ----------------------------------------------------------------- messages
    def in_step(self) -> None:
        """The engine is computing (called before each decoder layer of a step): stamp progress
        and, at most every IN_STEP_SERVICE_S, answer status queries (on this thread, the one
        that owns the control socket)."""
        now = time.monotonic()
        self._progress_at = now
        if now - self._serviced_at >= IN_STEP_SERVICE_S and len(self._stash) < MAX_STASHED:
            self._serviced_at = now
            self._stash += self._read_control(0.0, MAX_STASHED - len(self._stash))

    def poll_control(self, timeout_s: float) -> list[Message]:
        """Control messages that arrived (waiting up to timeout_s for the first), those read
        mid-step first; answers StatusQuery itself and malformed input with an error, never raising."""
        stashed, self._stash = self._stash, []
        return stashed + self._read_control(0.0 if stashed else timeout_s, 256)

    def _read_control(self, timeout_s: float, limit: int) -> list[Message]:
        out: list[Message] = []
        wait = timeout_s
        while len(out) < limit:
            try:
                inbound = self.control.recv(wait)
            except ProtocolError as exc:
                self.log.throttled("bad_message", error=str(exc))
                peer = getattr(exc, "peer", b"")
                self._safe_send(
                    peer,
                    RequestFailed(
                        request_id="",
                        node_id=self.opts.node_id,
                        code=FailureCode.BAD_MESSAGE,
                        message=str(exc),
                        retryable=False,
                    ),
                )
                named = reply_address_of(getattr(exc, "header", b""))
                if named is not None:  # a request the router waits on: end it now, naming the field
                    self.reply_failed(named[1], named[0], FailureCode.BAD_REQUEST, str(exc), False)
                continue
            if inbound is None:
                break
            wait = 0.0
            if isinstance(inbound.msg, StatusQuery):
                info = self._status
                if inbound.msg.reply_addr is None:
                    self._safe_send(inbound.peer, NodeStatus(nonce=inbound.msg.nonce, info=info))
                else:
                    self.reply(inbound.msg.reply_addr, NodeStatus(nonce=inbound.msg.nonce, info=info))
            else:
                out.append(inbound.msg)
        return out

    def wait_for_input(self, timeout_s: float, *sockets: zmq.Socket) -> None:
        """Sleep until a message is waiting on the control socket or on ``sockets``, or timeout_s.
        An idle node loop waits here instead of spinning on short polls."""
        poller = zmq.Poller()
        for socket in (self.control.socket, *sockets):
            poller.register(socket, zmq.POLLIN)
        poller.poll(max(0, int(timeout_s * 1000)))

    def _safe_send(self, peer: bytes, msg: Message) -> None:
        try:
            self.control.send(peer, msg)
        except Exception as exc:  # a vanished peer must not take the node down
            self.log("control_reply_failed", error=repr(exc))

    def reply_failed(
        self, reply_addr: str, request_id: str, code: FailureCode, message: str, retryable: bool
    ) -> None:
        """Tell the router a request ended in error here (``retryable``: it may go elsewhere)."""
        self.log("request_failed", request_id, code=code, message=message)
        self.reply(
            reply_addr,
            RequestFailed(
                request_id=request_id,
                node_id=self.opts.node_id,
                code=code,
                message=message,
                retryable=retryable,
            ),
        )

    def admit(
        self, engine: LLMEngine, msg: GenerateRequest, kv_transfer: KVTransfer | None = None
    ) -> SamplingParams | None:
        """Add a GenerateRequest to ``engine``; its sampling params, or None after telling the router
        why not (draining or overloaded: retryable; bad input: not). Stop strings stay with the router."""
        if self.closing:
            why = "node is switching roles" if self.switching else "node is draining"
            self.reply_failed(msg.reply_addr, msg.request_id, FailureCode.DRAINING, why, True)
            return None
        try:
            params = dataclasses.replace(msg.sampling_params, stop=())
            engine.add_request(
                msg.request_id,
                list(msg.token_ids),
                params,
                resume_output_ids=msg.output_token_ids,
                kv_transfer=kv_transfer,
            )
        except QueueFullError as exc:
            self.reply_failed(msg.reply_addr, msg.request_id, FailureCode.OVERLOADED, str(exc), True)
            return None
        except (TypeError, ValueError) as exc:
            self.reply_failed(msg.reply_addr, msg.request_id, FailureCode.BAD_REQUEST, str(exc), False)
            return None
        return params

    def reply(self, reply_addr: str, msg: Message) -> None:
        """Send to a router's reply address; never blocks, logs what it had to drop."""
        if not self._replies.send(reply_addr, msg):
            self.log("reply_dropped", request_id=getattr(msg, "request_id", None), reply_addr=reply_addr)
