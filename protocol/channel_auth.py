"""CURVE on every socket of one cluster: a peer without the cluster key cannot connect.

Every process of a cluster derives the same CURVE keypair from the cluster key
(protocol/cluster_key.py). The sockets that bind (a node's control and KV ROUTER, the router's
reply PULL) are CURVE servers with it, and a ZAP check lets in only a client whose long-term key
is the cluster's, so a client must hold the secret half, not merely know the server's public
key. The sockets that connect (DEALER, PUSH) use the same pair. What fails, and how it is seen:

    plain ZMTP (no key at all)          handshake: mechanism mismatch (or, where the peer read the
                                        mismatch first and hung up, a handshake cut short)
    CURVE with another server key       handshake: cryptographic error (another cluster's key)
    CURVE, right server key, own pair   ZAP: refused (a client key that is not the cluster's)

A watcher thread per server socket reads its monitor events and says each refusal through
``log``, rate-limited (a peer may retry at every reconnect interval). Everything on an
authenticated socket is encrypted too, KV frames included: CURVE has no MAC-only mode
(bench/notes/kv-transfer.md, "Authenticated transport", has what it costs). Same-host shared-memory
transfers do not ride the socket and keep their own checks.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from pdserve.protocol.throttle import Throttle

ZAP_DOMAIN = "pdserve"
_CONTEXT = b"pdserve-curve-v1"
# A keyless peer and this socket read each other's greeting in either order: when the peer reads
# the mismatch first, it hangs up, and this side sees only a handshake cut short (NO_DETAIL). Left
# unwatched, half of such refusals went unsaid (the compose test's rogue peer, 5 runs in 6).
_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_WATCH_POLL_MS = 500  # how often a watcher looks whether it should stop
_ZAP_BIND_WAIT_S = 2.0  # how long a new ZAP handler waits for the last one's address to be freed
_LOG_BURST, _LOG_WINDOW_S = 5, 30.0


def _reason(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "its client key is not the cluster's"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # value: the errno
        return "it hung up before the handshake finished (a peer without the cluster key does)"
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "it does not speak CURVE (no cluster key)"
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "it holds another cluster key"
    return f"handshake failed (zmq protocol error {value})"


class ChannelAuth:
    """One process's CURVE setup: ``secure`` each socket before it binds or connects."""

    def __init__(self, cluster_key: bytes, log: Callable[[str], None] | None = None) -> None:
        self.secret = z85.encode(hmac.new(cluster_key, _CONTEXT, hashlib.sha256).digest())
        self.public = zmq.curve_public(self.secret)
        self._log = log or logging.getLogger(__name__).warning
        self._throttle = Throttle(_LOG_BURST, _LOG_WINDOW_S)
        self._lock = threading.Lock()
        self._zap: dict[int, ThreadAuthenticator] = {}  # libzmq context address -> its ZAP handler
        self._stop = threading.Event()
        self._watchers: list[threading.Thread] = []

    def secure(self, socket: zmq.Socket, server: bool, name: str) -> None:
        """CURVE with the cluster's pair; a server also gets the ZAP check and a watcher."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        if not server:
            socket.curve_serverkey = self.public
            return
        socket.curve_server = True
        socket.zap_domain = ZAP_DOMAIN.encode()
        # a synchronous context over the socket's (an asyncio socket's context too)
        sync: zmq.SyncContext = zmq.Context.shadow(socket.context.underlying)
        self._start_zap(sync)
        endpoint = f"inproc://pdserve-handshakes-{id(socket)}"
        socket.monitor(endpoint, _FAILURES)
        listening = threading.Event()
        watcher = threading.Thread(
            target=self._watch, args=(sync, endpoint, name, listening), daemon=True, name="curve-watch"
        )
        watcher.start()
        # before the socket binds: a refusal the monitor reports with no reader yet would be lost
        listening.wait(5.0)
        self._watchers.append(watcher)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: the client proved it holds this long-term key; only the cluster's gets in."""
        return hmac.compare_digest(client_key, self.public)

    def close(self) -> None:
        """Stop the watchers and ZAP handlers (before their contexts are terminated)."""
        self._stop.set()
        for watcher in self._watchers:
            watcher.join(2 * _WATCH_POLL_MS / 1000)
        with self._lock:
            handlers, self._zap = list(self._zap.values()), {}
        for handler in handlers:
            handler.stop()

    def _start_zap(self, context: zmq.Context) -> None:
        with self._lock:
            if context.underlying in self._zap:
                return
            deadline = time.monotonic() + _ZAP_BIND_WAIT_S
            while True:
                handler = ThreadAuthenticator(context, log=logging.getLogger(__name__ + ".zap"))
                try:
                    handler.start()
                    break
                except zmq.ZMQError as exc:
                    # A ZAP handler stopped just before on this context: its socket's close is
                    # asynchronous, and its inproc address is free only once libzmq has reaped it.
                    handler.stop()
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            handler.configure_curve_callback(ZAP_DOMAIN, self)
            self._zap[context.underlying] = handler

    def _watch(self, context: zmq.Context, endpoint: str, name: str, listening: threading.Event) -> None:
        events = context.socket(zmq.PAIR)
        events.linger = 0
        events.connect(endpoint)
        listening.set()
        try:
            while not self._stop.is_set():
                if not events.poll(_WATCH_POLL_MS):
                    continue
                event = parse_monitor_message(events.recv_multipart())
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                admitted, left_out = self._throttle.admit(name)
                if admitted:
                    more = f" ({left_out} more before)" if left_out else ""
                    reason = _reason(event["event"], event["value"])
                    self._log(f"refused a peer on the {name} socket: {reason}{more}")
        except zmq.ZMQError:
            return  # the context is going away
        finally:
            events.close(linger=0)
