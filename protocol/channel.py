"""The one place that opens ZeroMQ sockets (KV transfer, node control, router), with
protocol/channel_auth.py for their CURVE under a cluster key; torch-free.

    prefill node  DEALER ──connect──►  ROUTER  decode node (bind; tcp:// or ipc://)  PeerChannel → ListenChannel
    router        DEALER ──connect──►  ROUTER  node control socket                   AsyncDealerChannel → ListenChannel
    node          PUSH   ──connect──►  PULL    router's reply address                PushChannel → AsyncPullChannel

Two flavours: the nodes' channels are synchronous (their loops poll with timeouts), the router's
are asyncio (``Async*``). Receiving channels take the decoder of their message family
(``kv_transfer.messages.decode``, ``protocol.messages.decode_frames``): both are the wire shape of
``protocol.codec``, so every receive returns a typed message or raises ProtocolError.

Every synchronous receive takes a timeout (no call blocks forever) and every send has a send
timeout or does not wait at all, so a dead or stuck peer shows up as a deadline, never as a hang.
Data frames go out zero-copy (``copy=False``): the caller must not modify a buffer after handing
it over. Under a cluster key every channel takes ``auth`` (protocol/channel_auth.py): CURVE,
and a peer without the key is refused at the handshake.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.protocol import codec
from pdserve.protocol.channel_auth import ChannelAuth
from pdserve.protocol.codec import Message, ProtocolError

_SEND_TIMEOUT_MS = 5000
_SERVERS = (zmq.ROUTER, zmq.PULL)  # the sockets that bind: CURVE servers under a cluster key


class PeerUnavailable(ConnectionError):
    """A send could not be queued within the send timeout (peer gone or not draining)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Inbound:
    """One received message."""

    peer: bytes  # ROUTER identity of the sender (b"" on the DEALER side)
    msg: Message  # the decoded header
    frames: list[memoryview]  # raw data frames, zero-copy views valid while this object lives


Decoder = Callable[[memoryview, Sequence[memoryview], int], Message]


class _Channel:
    def __init__(
        self,
        socket_type: int,
        context: zmq.Context | None,
        max_frame_bytes: int,
        decoder: Decoder | None,
        auth: ChannelAuth | None = None,
        name: str = "",
    ) -> None:
        self._decoder = decoder  # None: a send-only channel
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(socket_type)
        if auth is not None:  # before bind or connect
            auth.secure(self._socket, server=socket_type in _SERVERS, name=name)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._max_frame_bytes = max_frame_bytes
        # Let frames up to the limit through; bigger multipart parts are cut off by ZeroMQ itself.
        self._socket.setsockopt(zmq.MAXMSGSIZE, max(max_frame_bytes, codec.MAX_HEADER_BYTES))
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)

    @property
    def socket(self) -> zmq.Socket:
        """For waiting on several channels at once (zmq.Poller); receive through the channel."""
        return self._socket

    def _send(self, parts: list[Any]) -> None:
        try:
            self._socket.send_multipart(parts, copy=False)
        except zmq.Again:
            raise PeerUnavailable("send timed out; peer not draining") from None

    def _recv_parts(self, timeout_s: float) -> list[zmq.Frame] | None:
        if not self._poller.poll(max(0, int(timeout_s * 1000))):
            return None
        return self._socket.recv_multipart(copy=False)

    def _decode(self, peer: bytes, parts: Sequence[zmq.Frame]) -> Inbound:
        if not parts:
            raise ProtocolError("empty message")
        frames = [p.buffer for p in parts[1:]]
        assert self._decoder is not None, "a send-only channel received"
        return Inbound(peer, self._decoder(parts[0].buffer, frames, self._max_frame_bytes), frames)

    def close(self) -> None:
        self._socket.close(linger=0)


class ListenChannel(_Channel):
    """ROUTER socket of a decode node: many prefill peers, replies addressed by peer id."""

    def __init__(
        self,
        address: str,
        context: zmq.Context | None = None,
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
        *,
        decoder: Decoder,
        auth: ChannelAuth | None = None,
        name: str = "control",
    ) -> None:
        super().__init__(zmq.ROUTER, context, max_frame_bytes, decoder, auth, name)
        self._socket.bind(address)
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # port resolved

    def send(self, peer: bytes, msg: Message, frames: Sequence[Any] = ()) -> None:
        """Best effort: ROUTER drops messages to peers that are gone."""
        self._send([peer, codec.encode(msg), *frames])

    def recv(self, timeout_s: float) -> Inbound | None:
        """Next message, None on timeout; ProtocolError (with ``.peer`` and the raw ``.header``)
        when malformed."""
        parts = self._recv_parts(timeout_s)
        if parts is None:
            return None
        peer = parts[0].bytes
        try:
            return self._decode(peer, parts[1:])
        except ProtocolError as exc:
            exc.peer = peer  # type: ignore[attr-defined]
            exc.header = parts[1].bytes if len(parts) > 1 else b""  # type: ignore[attr-defined]
            raise


class PeerChannel(_Channel):
    """DEALER socket of a prefill node, connected to one decode node."""

    def __init__(
        self,
        address: str,
        context: zmq.Context | None = None,
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
        *,
        decoder: Decoder,
        auth: ChannelAuth | None = None,
    ) -> None:
        super().__init__(zmq.DEALER, context, max_frame_bytes, decoder, auth)
        self._socket.connect(address)
        self.address = address

    def send(self, msg: Message, frames: Sequence[Any] = ()) -> None:
        self._send([codec.encode(msg), *frames])

    def send_raw(self, parts: Sequence[bytes]) -> None:
        """Arbitrary frames, for tests of the receiver's input checks."""
        self._send(list(parts))

    def recv(self, timeout_s: float) -> Inbound | None:
        parts = self._recv_parts(timeout_s)
        return None if parts is None else self._decode(b"", parts)


class PushChannel(_Channel):
    """PUSH socket to a router's reply address. Sends never wait: a router that is gone or
    not draining costs dropped messages (it has its own deadlines), never a stuck node."""

    def __init__(
        self,
        address: str,
        context: zmq.Context | None = None,
        queue_limit: int = 10000,
        auth: ChannelAuth | None = None,
    ) -> None:
        super().__init__(zmq.PUSH, context, codec.DEFAULT_MAX_FRAME_BYTES, None, auth)
        self._socket.setsockopt(zmq.SNDHWM, queue_limit)
        self._socket.setsockopt(zmq.SNDTIMEO, 0)
        self._socket.connect(address)
        self.address = address

    def send(self, msg: Message) -> bool:
        """True when queued; False when the queue to this router is full."""
        try:
            self._socket.send(codec.encode(msg), copy=False)
            return True
        except zmq.Again:
            return False


class PushChannels:
    """PushChannels to routers' reply addresses, opened on first use and kept for the most recent
    ``max_channels`` addresses (LRU). Not thread-safe: one per thread that replies."""

    def __init__(self, max_channels: int, auth: ChannelAuth | None = None) -> None:
        self._max_channels = max_channels
        self._auth = auth
        self._channels: OrderedDict[str, PushChannel] = OrderedDict()  # reply address -> channel

    def send(self, address: str, msg: Message) -> bool:
        """True when queued; False when the queue to that router is full (never waits)."""
        channel = self._channels.pop(address, None) or PushChannel(address, auth=self._auth)
        self._channels[address] = channel  # most recent last
        while len(self._channels) > self._max_channels:
            self._channels.popitem(last=False)[1].close()
        return channel.send(msg)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


# --------------------------------------------------------------------------- asyncio flavour
class _AsyncChannel:
    """An asyncio socket that receives typed messages of one family."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        socket_type: int,
        decoder: Decoder,
        max_frame_bytes: int,
        auth: ChannelAuth | None = None,
        name: str = "",
    ) -> None:
        self._decoder = decoder
        self._max_frame_bytes = max_frame_bytes
        self._socket = context.socket(socket_type)
        if auth is not None:  # before bind or connect
            auth.secure(self._socket, server=socket_type in _SERVERS, name=name)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max(max_frame_bytes, codec.MAX_HEADER_BYTES))

    async def recv(self) -> Message:
        """The next message; ProtocolError when it is malformed."""
        parts = await self._socket.recv_multipart(copy=False)
        return self._decoder(parts[0].buffer, [p.buffer for p in parts[1:]], self._max_frame_bytes)

    def close(self) -> None:
        self._socket.close(linger=0)


class AsyncDealerChannel(_AsyncChannel):
    """The router's DEALER to one node's control socket. Sends never wait: a node that is not
    connected (yet, or any more) refuses them (``try_send`` is False; the caller decides how long
    to retry), because an awaited send to a dead peer queues forever and cancelling it can leave
    the sends behind it stuck. A socket monitor reports the connection going up and down
    (``next_link_event``): a node whose process died shows up as a dropped TCP connection at once."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        address: str,
        *,
        decoder: Decoder,
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
        auth: ChannelAuth | None = None,
    ) -> None:
        super().__init__(context, zmq.DEALER, decoder, max_frame_bytes, auth)
        self.address = address
        self._socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not connected
        self._socket.connect(address)
        # synchronous, for NOBLOCK sends
        self._sender: zmq.SyncSocket = zmq.Socket.shadow(self._socket.underlying)
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )

    def try_send(self, msg: Message) -> bool:
        """Queue ``msg`` for the node; False when it is not connected."""
        try:
            self._sender.send(codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def next_link_event(self) -> bool:
        """Waits for the connection to come up (True) or drop (False)."""
        event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
        return event == zmq.EVENT_HANDSHAKE_SUCCEEDED

    def close(self) -> None:
        self._socket.disable_monitor()
        super().close()
        self._monitor.close(linger=0)


class AsyncPullChannel(_AsyncChannel):
    """The router's PULL socket, bound where the nodes push their replies."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        bind_addr: str,
        *,
        decoder: Decoder,
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
        auth: ChannelAuth | None = None,
    ) -> None:
        super().__init__(context, zmq.PULL, decoder, max_frame_bytes, auth, "reply")
        self._socket.bind(bind_addr)
        self.port = int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
