"""The router's view of the live nodes, refreshed every ``poll_interval_s``.

Two sources: Redis records (``protocol.registry``; nodes come and go at runtime) or a static
list of control addresses, each asked for its status with a StatusQuery. A successful Redis
poll is the whole truth: a node whose key expired (TTL) or was withdrawn (drain) is dropped at
once. Otherwise (a static node that did not answer, Redis unreachable) a node not heard from
for ``node_expiry_s`` is dropped. The node client's sockets follow.

While Redis is unreachable the router keeps the membership it last saw and asks those nodes for
their status directly (as in static mode), so a node that dies or hangs meanwhile still drops
out. For ``node_expiry_s`` after Redis answers again its polls count as partial: a restarted,
empty Redis holds no record until each node's next heartbeat, and live nodes must not drop out
in between.

A node takes requests only once its status came back through the router's reply address, the
path its tokens will take (static polls ask for that; Redis-found nodes are probed once): a router
advertising an address the node cannot reach stays unhealthy instead of timing out every request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from pdserve.protocol import messages as pm
from pdserve.protocol.registry import KEY_PREFIX, NodeInfo, ReplayGuard, Role, connect, list_nodes
from pdserve.protocol.throttle import Throttle
from pdserve.router.node_client import NodeClient

log = logging.getLogger(__name__)
# Refused registry records are found again by every poll: at most this many lines per window.
_REFUSED_LOG_BURST, _REFUSED_LOG_WINDOW_S = 5, 30.0


class NodeRegistry:
    COMPLETE_POLLS = False  # True when one successful poll lists every live node
    ROLES_FIXED = False  # True where the router's configuration names each node's role

    def __init__(self, nodes: NodeClient, poll_interval_s: float, node_expiry_s: float) -> None:
        self._nodes = nodes
        self._poll_interval_s = poll_interval_s
        self._expiry_s = node_expiry_s
        self._by_id: dict[str, NodeInfo] = {}  # live nodes
        self._last_seen: dict[str, float] = {}  # node id -> router clock when last heard of
        self._task: asyncio.Task | None = None
        self._probes: dict[str, asyncio.Task] = {}  # node id -> its reply-path probe in flight
        self._probe_failures: dict[str, int] = {}  # node id -> probes that got no answer
        self._ever_verified: set[str] = set()  # node ids whose reply path once answered a probe
        self.expected_model: str | None = None  # the router's model digest: nodes of another are refused
        self._refused: set[str] = set()  # node ids already logged as refused
        self._partial_until = 0.0  # router clock until which polls may miss live nodes (outage)
        self.ready = asyncio.Event()  # set after the first poll and its reply-path probes
        nodes.on_stray = self._abort_stray

    def _abort_stray(self, chunk: pm.TokenChunk) -> None:
        """A node streams tokens of a request nobody here waits for (it was aborted before that
        node knew of it, e.g. while its KV was still on the way): tell the node to stop."""
        node = self._by_id.get(chunk.node_id)
        if node is not None:
            self._nodes.send_nowait(
                node.control_addr, pm.AbortRequest(request_id=chunk.request_id, reason="nobody waits for it")
            )

    def snapshot(self) -> list[NodeInfo]:
        """The usable nodes: registered, answering through the reply path, connection not dropped."""
        live = [
            n
            for n in self._by_id.values()
            if self.reply_verified(n) and not self._nodes.link_lost(n.control_addr)
        ]
        return sorted(live, key=lambda n: n.node_id)

    def _same_model(self, node: NodeInfo) -> bool:
        model = node.fingerprint.model_id
        if self.expected_model is None or model == self.expected_model:
            return True
        if node.node_id not in self._refused:
            self._refused.add(node.node_id)
            log.error(
                "refusing node %s (%s): it serves model %s, this router's model is %s",
                node.node_id,
                node.role,
                model,
                self.expected_model,
            )
        return False

    def _log_unpaired(self, node: NodeInfo) -> None:
        """A new node whose KV fingerprint no node of the other kind shares takes no transfers:
        say which field differs (block size, dtype, hash algorithm...) instead of staying silent."""
        if node.role is Role.COLOCATED:
            return
        others = [
            n
            for n in self._by_id.values()
            if n.role is not Role.COLOCATED and (n.role is Role.PREFILL) != (node.role is Role.PREFILL)
        ]
        if not others or any(n.fingerprint == node.fingerprint for n in others):
            return
        field = node.fingerprint.first_difference(others[0].fingerprint)
        assert field is not None  # the fingerprints differ: none of the others matched
        log.error(
            "node %s (%s) pairs with no %s node: its KV fingerprint differs in %s (%r, %s has %r)",
            node.node_id,
            node.role,
            others[0].role,
            field,
            getattr(node.fingerprint, field),
            others[0].node_id,
            getattr(others[0].fingerprint, field),
        )

    def reply_verified(self, node: NodeInfo) -> bool:
        return node.node_id in self._nodes.reply_path_ok

    def node(self, node_id: str) -> NodeInfo | None:
        """The live node's latest record."""
        return self._by_id.get(node_id)

    def is_alive(self, node_id: str) -> bool:
        node = self._by_id.get(node_id)
        return node is not None and not self._nodes.link_lost(node.control_addr)

    def update(self, seen: Sequence[NodeInfo], now: float, complete: bool = False) -> None:
        """Merge a poll's records; drop nodes not seen within the expiry (at once when the poll
        was ``complete``: it lists every live node)."""
        seen = [n for n in seen if self._same_model(n)]
        for node in seen:
            if node.node_id not in self._by_id:
                self._by_id[node.node_id] = node
                self._log_unpaired(node)
            self._by_id[node.node_id] = node
            self._last_seen[node.node_id] = now
        for node_id, last in list(self._last_seen.items()):
            if (complete and last != now) or now - last > self._expiry_s:
                gone = self._by_id.pop(node_id)
                del self._last_seen[node_id]
                self._nodes.reply_path_ok.discard(node_id)
                self._probe_failures.pop(node_id, None)
                log.warning("node %s (%s) expired", node_id, gone.role)
                if not any(n.control_addr == gone.control_addr for n in self._by_id.values()):
                    self._nodes.disconnect(gone.control_addr)
        for node in seen:
            self._nodes.connect(node.control_addr)

    async def poll_once(self) -> list[NodeInfo]:
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._probes.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _probe_reply_paths(self) -> None:
        """Ask each node not yet heard through the reply path for its status through it."""
        for node in self._by_id.values():
            if not self.reply_verified(node) and node.node_id not in self._probes:
                task = asyncio.create_task(self._probe(node))
                self._probes[node.node_id] = task
                # the default binds this node's id; mypy cannot infer such a lambda (python/mypy#15459)
                task.add_done_callback(lambda _, node_id=node.node_id: self._probes.pop(node_id, None))  # type: ignore[misc]

    async def _probe(self, node: NodeInfo) -> None:
        timeout_s = max(2 * self._poll_interval_s, 1.0)
        if await self._nodes.query_status(node.control_addr, timeout_s) is not None:
            if len(self._ever_verified) >= 4096:  # bounded: node ids churn with restarts
                self._ever_verified.clear()
            self._ever_verified.add(node.node_id)
            return
        num = self._probe_failures[node.node_id] = self._probe_failures.get(node.node_id, 0) + 1
        if num in (3, 30, 300) and node.node_id in self._ever_verified:  # it answered before
            log.warning(
                "node %s (%s) has stopped answering status queries (%d tries): its engine makes no "
                "progress (nodes answer between the layers of a step)",
                node.node_id,
                node.role,
                num,
            )
        elif num in (3, 30, 300):  # a misconfigured address is loud, not a flood
            log.warning(
                "node %s (%s) sent no status back through the reply address %s in %d tries: "
                "can it reach that address? (router --host / --advertise-host)",
                node.node_id,
                node.role,
                self._nodes.reply_addr,
                num,
            )

    async def _run(self) -> None:
        while True:
            seen, complete = await self._poll()
            self.update(seen, time.monotonic(), complete)
            self._probe_reply_paths()
            if not self.ready.is_set():
                # Ready once the first poll's nodes have answered through the reply path (or their
                # probes timed out): a router that has just started serves them from its first
                # request, instead of answering 503 until the probes come back.
                await asyncio.gather(*list(self._probes.values()), return_exceptions=True)
                self.ready.set()
            await asyncio.sleep(self._poll_interval_s)

    async def _poll(self) -> tuple[list[NodeInfo], bool]:
        """This round's records and whether they list every live node."""
        now = time.monotonic()
        try:
            seen = await self.poll_once()
        except Exception as exc:  # a registry outage must not kill the router: ask the nodes instead
            if now >= self._partial_until:
                log.warning("registry poll failed (%s): serving the %d known nodes", exc, len(self._by_id))
            self._partial_until = now + self._expiry_s
            return await self.ask_nodes(list(self._by_id.values())), False
        if now >= self._partial_until:
            return seen, self.COMPLETE_POLLS
        listed = {n.node_id for n in seen}
        missing = [n for n in self._by_id.values() if n.node_id not in listed]
        return seen + await self.ask_nodes(missing), False

    async def ask_nodes(self, nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
        """The status of each of ``nodes`` that answers through the reply path in time."""
        results = await asyncio.gather(*(self.ask(n.control_addr, n.role) for n in nodes))
        return [info for info in results if info is not None]

    async def ask(self, addr: str, role: Role) -> NodeInfo | None:
        """The status of the node at ``addr``, asked over its control socket; None: no (usable) answer."""
        asked_at = time.time()
        status = await self._nodes.query_status(addr, timeout_s=max(self._poll_interval_s, 0.5))
        if status is None:
            return None
        info = status.info
        if info is None:  # the node is still starting
            return None
        if info.role != role and not (role is Role.DECODE and info.role.decodes):  # both roles in one
            log.warning("node at %s is a %s node, listed as %s", addr, info.role, role)
            return None
        # The status covers every request sent before the query went out (see policy.Outstanding).
        return dataclasses.replace(info, heartbeat_time=asked_at)


class RedisRegistry(NodeRegistry):
    """Node records from Redis; keys expire with their TTL, and a record whose heartbeat has not
    changed for the expiry is ignored (a node that hangs while its key lives on).

    Staleness is judged by the router's own monotonic clock, from when it saw each record's
    ``heartbeat_time`` change, never by comparing that wall-clock stamp with the router's wall
    clock: the nodes' clocks may be skewed from the router's (other machines) or stepped (NTP), and
    a live node must not drop out, with its streams, for that. (Under a cluster key, a node seen
    for the first time is refused when its stamp is further behind than the skew allowed: see
    protocol.registry.ReplayGuard.)"""

    COMPLETE_POLLS = True

    def __init__(
        self,
        redis_url: str,
        nodes: NodeClient,
        poll_interval_s: float,
        node_expiry_s: float,
        key: bytes | None = None,
        password_file: str | None = None,
        max_record_skew_s: float = 60.0,
    ) -> None:
        super().__init__(nodes, poll_interval_s, node_expiry_s)
        self._client = connect(redis_url, password_file, socket_timeout=max(1.0, poll_interval_s))
        self._key = key  # the cluster key: records not signed with it are refused
        self._replays = ReplayGuard(max_record_skew_s)  # and signed ones written back by another
        self._last_taken: dict[str, NodeInfo] = {}  # node id -> its record the last poll took
        self._refused_log = Throttle(_REFUSED_LOG_BURST, _REFUSED_LOG_WINDOW_S)
        self._beats: dict[
            str, tuple[float, float]
        ] = {}  # node id -> (its heartbeat_time, router clock it changed)

    async def poll_once(self) -> list[NodeInfo]:
        refused: list[str] = []
        records = await asyncio.to_thread(list_nodes, self._client, self._key, refused)
        if self._key is not None:  # without a key anyone may write any record: nothing to replay
            records = self._unreplayed(records, refused)
        for problem in refused:
            self._log_refused(problem)
        return self.fresh(records, time.monotonic())

    def _unreplayed(self, records: list[NodeInfo], refused: list[str]) -> list[NodeInfo]:
        """``records`` less the replayed ones. A live node whose record was overwritten by a replay
        keeps the record last taken (the replay is not its absence; if the replays go on, it
        expires as a node unheard of). One that had left stays gone."""
        now, taken = time.time(), []
        for node in records:
            problem = self._replays.check(node, now, node.node_id in self._last_taken)
            if problem is None:
                taken.append(node)
                continue
            refused.append(f"{KEY_PREFIX}{node.node_id}: {problem}")
            if node.node_id in self._last_taken:
                taken.append(self._last_taken[node.node_id])
        self._last_taken = {node.node_id: node for node in taken}
        return taken

    def _log_refused(self, problem: str) -> None:
        """A record a writer without the cluster key put in Redis: never routed to; said in the
        log, at most a burst per window and kind (every poll finds it again while it lives, and a
        flood of one kind must not hide another): unsigned, bad MAC, replayed."""
        kind = problem.split(": ", 1)[-1].split(" ", 1)[0].rstrip(":")
        admitted, left_out = self._refused_log.admit(kind)
        if left_out:
            log.warning("left out %d more refused node records (%s)", left_out, kind)
        if admitted:
            log.warning("refused node record %s", problem)

    def fresh(self, records: Sequence[NodeInfo], now: float) -> list[NodeInfo]:
        """The records whose heartbeat changed within the expiry, ``now`` on the router's clock (a
        record seen for the first time counts as changed now)."""
        beats = {}
        for node in records:
            stamp, changed_at = self._beats.get(node.node_id, (None, now))
            beats[node.node_id] = (node.heartbeat_time, changed_at if stamp == node.heartbeat_time else now)
        self._beats = beats  # nodes whose keys are gone are forgotten
        return [n for n in records if now - beats[n.node_id][1] <= self._expiry_s]


class StaticRegistry(NodeRegistry):
    """Fixed control addresses, each asked for its NodeStatus every poll."""

    ROLES_FIXED = True  # --prefill-addrs / --decode-addrs

    def __init__(
        self,
        prefill_addrs: Sequence[str],
        decode_addrs: Sequence[str],
        nodes: NodeClient,
        poll_interval_s: float,
        node_expiry_s: float,
    ) -> None:
        super().__init__(nodes, poll_interval_s, node_expiry_s)
        self._roles = {**{a: Role.PREFILL for a in prefill_addrs}, **{a: Role.DECODE for a in decode_addrs}}

    async def poll_once(self) -> list[NodeInfo]:
        results = await asyncio.gather(*(self.ask(addr, role) for addr, role in self._roles.items()))
        return [info for info in results if info is not None]
