"""The router's only ZeroMQ code: one DEALER per node control address, one PULL for replies.

    router DEALER ──GenerateRequest / AbortRequest / StatusQuery──► node ROUTER (control_addr)
    router DEALER ◄──NodeStatus───────────────────────────────────── node ROUTER
    router PULL (reply_addr) ◄──TokenChunk / RequestFailed────────── prefill and decode nodes

A reader task hands each TokenChunk / RequestFailed to the bounded queue of its request id;
replies for request ids nobody waits for (aborted, finished, timed out) are dropped. A socket
monitor per DEALER tells when a node's connection drops (its process died: the kernel resets the
TCP connection), so waiting requests need not wait for the node's heartbeat to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol import messages as pm
from protocol.addresses import advertised_host, zmq_host

log = logging.getLogger(__name__)
_SEND_RETRY_S = 0.01  # while a node's connection is being set up


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
    ) -> None:
        self._context = zmq.asyncio.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(f"tcp://{zmq_host(host)}:{reply_port or '*'}")
        port = self._pull.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        # Bound where the router's HTTP side is (all interfaces in a container), advertised as an
        # address the nodes can reach: never a loopback address they would take for their own.
        self.reply_addr = f"tcp://{zmq_host(advertised_host(host, advertise_host))}:{port}"
        self.reply_path_ok: set[str] = set()  # ids of nodes whose status came back through reply_addr
        self._queue_size = queue_size  # replies buffered per request before it is failed
        self._send_timeout_s = send_timeout_s
        self._dealers: dict[str, zmq.asyncio.Socket] = {}  # control address -> socket (receives)
        self._senders: dict[str, zmq.Socket] = {}  # control address -> the same socket, sync (sends)
        self._readers: dict[str, asyncio.Task] = {}  # control address -> its reply reader
        self._watchers: dict[str, asyncio.Task] = {}  # control address -> its connection monitor's reader
        self._monitors: dict[str, zmq.asyncio.Socket] = {}  # control address -> its monitor socket
        self._link_up: dict[str, bool] = {}  # control address -> connected (absent: never was)
        self._queues: dict[str, asyncio.Queue[pm.Message]] = {}  # request id -> its replies
        self._status_waiters: dict[int, asyncio.Future[pm.NodeStatus]] = {}  # nonce -> waiter
        self._nonces = itertools.count(1)
        self._pull_task: asyncio.Task | None = None

    def start(self) -> None:
        self._pull_task = asyncio.create_task(self._read(self._pull, reply_path=True))

    async def close(self) -> None:
        tasks = [
            t for t in [self._pull_task, *self._readers.values(), *self._watchers.values()] if t is not None
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for socket in self._dealers.values():
            socket.disable_monitor()
        for socket in [self._pull, *self._dealers.values(), *self._monitors.values()]:
            socket.close(linger=0)
        self._dealers.clear()
        self._watchers.clear()
        self._monitors.clear()
        self._senders.clear()
        self._readers.clear()
        self._context.term()

    # ------------------------------------------------------------------ per-request replies
    def open(self, request_id: str) -> asyncio.Queue[pm.Message]:
        assert request_id not in self._queues, f"request id {request_id} is in use"
        queue: asyncio.Queue[pm.Message] = asyncio.Queue(self._queue_size)
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
        if not isinstance(msg, (pm.TokenChunk, pm.RequestFailed)):
            log.warning("unexpected %s from a node", msg.TAG)
            return
        queue = self._queues.get(msg.request_id)
        if queue is None:
            return  # late reply of a request that ended
        try:
            queue.put_nowait(msg)
        except asyncio.QueueFull:  # the reader fell behind by a whole queue: end the request
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(
                pm.RequestFailed(
                    msg.request_id,
                    msg.node_id,
                    "overflow",
                    "the client is not reading the output fast enough",
                    False,
                )
            )

    async def _read(self, socket: zmq.asyncio.Socket, reply_path: bool = False) -> None:
        while True:
            parts = await socket.recv_multipart()
            try:
                self._deliver(pm.decode(parts[0]), reply_path)
            except pm.ProtocolError as exc:
                log.warning("dropped a malformed node message: %s", exc)

    # ------------------------------------------------------------------ sending
    def _dealer(self, addr: str) -> zmq.asyncio.Socket:
        socket = self._dealers.get(addr)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not connected
            socket.connect(addr)
            self._dealers[addr] = socket
            # Sends go through a synchronous shadow with NOBLOCK: an awaited asyncio send to a dead
            # peer queues forever, and cancelling it can leave the sends behind it stuck.
            self._senders[addr] = zmq.Socket.shadow(socket.underlying)
            self._readers[addr] = asyncio.create_task(self._read(socket))
            monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            self._monitors[addr] = monitor  # closed by disconnect/close: the task may never run
            self._watchers[addr] = asyncio.create_task(self._watch(addr, monitor))
        return socket

    async def _watch(self, addr: str, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            up = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if not up and self._link_up.get(addr):
                log.warning("lost the connection to node %s", addr)
            self._link_up[addr] = up

    def link_lost(self, addr: str) -> bool:
        """The connection to ``addr`` was up and dropped (and has not come back)."""
        return self._link_up.get(addr) is False

    def _try_send(self, addr: str, frame: bytes) -> bool:
        self._dealer(addr)
        try:
            self._senders[addr].send(frame, zmq.NOBLOCK)
        except zmq.Again:  # not connected (yet, or any more)
            return False
        return True

    def connect(self, addr: str) -> None:
        """Start connecting to a node ahead of its first request."""
        self._dealer(addr)

    def disconnect(self, addr: str) -> None:
        socket = self._dealers.pop(addr, None)
        self._senders.pop(addr, None)
        self._link_up.pop(addr, None)
        for task in (self._readers.pop(addr, None), self._watchers.pop(addr, None)):
            if task is not None:
                task.cancel()
        if socket is not None:
            socket.disable_monitor()
            socket.close(linger=0)
        monitor = self._monitors.pop(addr, None)
        if monitor is not None:
            monitor.close(linger=0)

    async def send(self, addr: str, msg: pm.Message) -> None:
        """Hand ``msg`` to the node at ``addr``, waiting a little for a connection; else NodeUnavailable."""
        frame = pm.encode(msg)
        deadline = time.monotonic() + self._send_timeout_s
        while not self._try_send(addr, frame):
            if time.monotonic() > deadline:
                raise NodeUnavailable(f"cannot reach {addr} within {self._send_timeout_s:g} s")
            await asyncio.sleep(_SEND_RETRY_S)

    def send_nowait(self, addr: str, msg: pm.Message) -> None:
        """Best effort (aborts): dropped when the node is not connected."""
        with contextlib.suppress(zmq.ZMQError):
            self._try_send(addr, pm.encode(msg))

    async def query_status(self, addr: str, timeout_s: float) -> pm.NodeStatus | None:
        """The node's status, asked to come back through the reply path (None: no answer in time)."""
        nonce = next(self._nonces)
        waiter: asyncio.Future[pm.NodeStatus] = asyncio.get_running_loop().create_future()
        self._status_waiters[nonce] = waiter
        try:
            await self.send(addr, pm.StatusQuery(nonce, self.reply_addr))
            return await asyncio.wait_for(waiter, timeout_s)
        except (TimeoutError, NodeUnavailable):
            return None
        finally:
            self._status_waiters.pop(nonce, None)
