"""The router's side of the control plane: one channel per node control address, one for replies.

    router DEALER ──GenerateRequest / AbortRequest / StatusQuery / SetRole──► node ROUTER (control_addr)
    router DEALER ◄──NodeStatus───────────────────────────────────── node ROUTER
    router PULL (reply_addr) ◄──TokenChunk / RequestFailed / RoleChange── prefill and decode nodes

The sockets are protocol.channel's asyncio flavour. A reader task hands each TokenChunk /
RequestFailed to the bounded queue of its request id; replies for request ids nobody waits for
(aborted, finished, timed out) are dropped, and a node still streaming one is told to stop
(``on_stray``). Each node channel's connection monitor tells when a
node's connection drops (its process died: the kernel resets the TCP connection), so waiting
requests need not wait for the node's heartbeat to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from pdserve.protocol import messages as pm
from pdserve.protocol.addresses import advertised_host, zmq_host
from pdserve.protocol.channel import AsyncDealerChannel, AsyncPullChannel
from pdserve.protocol.channel_auth import ChannelAuth
from pdserve.protocol.reasons import FailureCode
from pdserve.protocol.registry import Role
from pdserve.protocol.throttle import Throttle

log = logging.getLogger(__name__)
_SEND_RETRY_S = 0.01  # while a node's connection is being set up
# Malformed node messages (a peer can send them at any rate) are logged at most this many times
# per window; the first line of a later window says how many were left out.
_BAD_LOG_BURST, _BAD_LOG_WINDOW_S = 20, 10.0


class NodeUnavailable(ConnectionError):
    """A message could not be handed to a node's socket in time (not connected or not reading)."""


class NodeClient:
    def __init__(
        self,
        host: str = "127.0.0.1",
        reply_port: int = 0,
        advertise_host: str | None = None,
        queue_size: int = 1024,
        send_timeout_s: float = 2.0,
        auth: ChannelAuth | None = None,
    ) -> None:
        self._context = zmq.asyncio.Context()
        self._auth = auth  # the cluster's CURVE on every node socket (None: none)
        self._pull = AsyncPullChannel(
            self._context, f"tcp://{zmq_host(host)}:{reply_port or '*'}", decoder=pm.decode_frames, auth=auth
        )
        # Bound where the router's HTTP side is (all interfaces in a container), advertised as an
        # address the nodes can reach: never a loopback address they would take for their own.
        self.reply_addr = f"tcp://{zmq_host(advertised_host(host, advertise_host))}:{self._pull.port}"
        self.reply_path_ok: set[str] = set()  # ids of nodes whose status came back through reply_addr
        self._queue_size = queue_size  # replies buffered per request before it is failed
        self._send_timeout_s = send_timeout_s
        self._channels: dict[str, AsyncDealerChannel] = {}  # control address -> its channel
        self._tasks: dict[str, tuple[asyncio.Task, asyncio.Task]] = {}  # address -> (reader, link watcher)
        self._link_up: dict[str, bool] = {}  # control address -> connected (absent: never was)
        # request id -> its replies (the only messages delivered to a request)
        self._queues: dict[str, asyncio.Queue[pm.TokenChunk | pm.RequestFailed]] = {}
        self._status_waiters: dict[int, asyncio.Future[pm.NodeStatus]] = {}  # nonce -> waiter
        self._role_waiters: dict[int, asyncio.Queue[pm.RoleChange]] = {}  # nonce -> its answers
        self._nonces = itertools.count(1)
        self._pull_task: asyncio.Task | None = None
        self._bad_log = Throttle(_BAD_LOG_BURST, _BAD_LOG_WINDOW_S)  # malformed node messages
        # a node's tokens for a request that ended here, more to come (the registry aborts it there)
        self.on_stray: Callable[[pm.TokenChunk], None] = lambda chunk: None

    def start(self) -> None:
        self._pull_task = asyncio.create_task(self._read(self._pull, reply_path=True))

    async def close(self) -> None:
        tasks = [t for t in [self._pull_task, *(t for pair in self._tasks.values() for t in pair)] if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in [self._pull, *self._channels.values()]:
            channel.close()
        self._channels.clear()
        self._tasks.clear()
        if self._auth is not None:
            self._auth.close()  # its ZAP handler's socket lives in this context
        self._context.term()

    # ------------------------------------------------------------------ per-request replies
    def open(self, request_id: str) -> asyncio.Queue[pm.TokenChunk | pm.RequestFailed]:
        assert request_id not in self._queues, f"request id {request_id} is in use"
        queue: asyncio.Queue[pm.TokenChunk | pm.RequestFailed] = asyncio.Queue(self._queue_size)
        self._queues[request_id] = queue
        return queue

    def close_request(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def _deliver(self, msg: pm.Message, reply_path: bool) -> None:
        if isinstance(msg, pm.NodeStatus):
            if reply_path and msg.info is not None:
                self.reply_path_ok.add(msg.info.node_id)
            waiter = self._status_waiters.pop(msg.nonce, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
            return
        if isinstance(msg, pm.RoleChange):
            answers = self._role_waiters.get(msg.nonce)
            if answers is not None and not answers.full():
                answers.put_nowait(msg)
            return
        if not isinstance(msg, (pm.TokenChunk, pm.RequestFailed)):
            log.warning("unexpected %s from a node", msg.TAG)
            return
        queue = self._queues.get(msg.request_id)
        if queue is None:  # late reply of a request that ended
            if isinstance(msg, pm.TokenChunk) and msg.finish_reason is None and not msg.is_first:
                self.on_stray(msg)
            return
        try:
            queue.put_nowait(msg)
        except asyncio.QueueFull:  # the reader fell behind by a whole queue: end the request
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(
                pm.RequestFailed(
                    request_id=msg.request_id,
                    node_id=msg.node_id,
                    code=FailureCode.OVERFLOW,
                    message="the client is not reading the output fast enough",
                    retryable=False,
                )
            )

    async def _read(self, channel: AsyncDealerChannel | AsyncPullChannel, reply_path: bool = False) -> None:
        while True:
            try:
                msg = await channel.recv()
            except pm.ProtocolError as exc:
                self._log_malformed(exc)
                continue
            self._deliver(msg, reply_path)

    def _log_malformed(self, exc: pm.ProtocolError) -> None:
        admitted, left_out = self._bad_log.admit()
        if left_out:
            log.warning("left out %d more malformed node messages", left_out)
        if admitted:
            log.warning("dropped a malformed node message: %s", exc)

    # ------------------------------------------------------------------ sending
    def _channel(self, addr: str) -> AsyncDealerChannel:
        channel = self._channels.get(addr)
        if channel is None:
            channel = self._channels[addr] = AsyncDealerChannel(
                self._context, addr, decoder=pm.decode_frames, auth=self._auth
            )
            self._tasks[addr] = (
                asyncio.create_task(self._read(channel)),
                asyncio.create_task(self._watch(channel)),
            )
        return channel

    async def _watch(self, channel: AsyncDealerChannel) -> None:
        while True:
            up = await channel.next_link_event()
            if not up and self._link_up.get(channel.address):
                log.warning("lost the connection to node %s", channel.address)
            self._link_up[channel.address] = up

    def link_lost(self, addr: str) -> bool:
        """The connection to ``addr`` was up and dropped (and has not come back)."""
        return self._link_up.get(addr) is False

    def connect(self, addr: str) -> None:
        """Start connecting to a node ahead of its first request."""
        self._channel(addr)

    def disconnect(self, addr: str) -> None:
        channel = self._channels.pop(addr, None)
        self._link_up.pop(addr, None)
        for task in self._tasks.pop(addr, ()):
            task.cancel()
        if channel is not None:
            channel.close()

    async def send(self, addr: str, msg: pm.Message) -> None:
        """Hand ``msg`` to the node at ``addr``, waiting a little for a connection; else NodeUnavailable."""
        deadline = time.monotonic() + self._send_timeout_s
        while not self._channel(addr).try_send(msg):
            if time.monotonic() > deadline:
                raise NodeUnavailable(f"cannot reach {addr} within {self._send_timeout_s:g} s")
            await asyncio.sleep(_SEND_RETRY_S)

    def send_nowait(self, addr: str, msg: pm.Message) -> None:
        """Best effort (aborts): dropped when the node is not connected."""
        with contextlib.suppress(zmq.ZMQError):
            self._channel(addr).try_send(msg)

    async def query_status(self, addr: str, timeout_s: float) -> pm.NodeStatus | None:
        """The node's status, asked to come back through the reply path (None: no answer in time)."""
        nonce = next(self._nonces)
        waiter: asyncio.Future[pm.NodeStatus] = asyncio.get_running_loop().create_future()
        self._status_waiters[nonce] = waiter
        try:
            await self.send(addr, pm.StatusQuery(nonce=nonce, reply_addr=self.reply_addr))
            async with asyncio.timeout(timeout_s):  # not wait_for: it can swallow a cancellation
                return await waiter
        except (TimeoutError, NodeUnavailable):
            return None
        finally:
            self._status_waiters.pop(nonce, None)

    async def set_role(self, addr: str, role: Role, timeout_s: float) -> pm.RoleChange | None:
        """Ask the node at ``addr`` to serve as ``role``; its last answer within ``timeout_s``:
        "done" or "refused", "draining" when its drain outlasted the wait, None when none came."""
        nonce = next(self._nonces)
        answers: asyncio.Queue[pm.RoleChange] = asyncio.Queue(4)
        self._role_waiters[nonce] = answers
        last = None
        try:
            await self.send(addr, pm.SetRole(nonce=nonce, role=role, reply_addr=self.reply_addr))
            async with asyncio.timeout(timeout_s):
                while last is None or last.phase is pm.RolePhase.DRAINING:
                    last = await answers.get()
        except (TimeoutError, NodeUnavailable):
            pass
        finally:
            self._role_waiters.pop(nonce, None)
        return last
