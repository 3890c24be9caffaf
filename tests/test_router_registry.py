"""The router's view of the nodes: a complete (Redis) poll drops vanished nodes at once."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from pdserve.router.node_client import NodeClient
from pdserve.router.registry_client import NodeRegistry
from tests.test_router_support import node_info


def _run(complete: bool) -> tuple[list[str], list[str]]:
    async def go():
        nodes = NodeClient()
        registry = NodeRegistry(nodes, poll_interval_s=0.1, node_expiry_s=10.0)
        a, b = node_info("p1", "prefill"), node_info("d1", "decode")
        nodes.reply_path_ok.update({"p1", "d1"})  # both answered a status query through the reply path
        registry.update([a, b], now=100.0, complete=complete)
        first = [n.node_id for n in registry.snapshot()]
        registry.update([b], now=100.5, complete=complete)  # p1's key expired or was withdrawn
        second = [n.node_id for n in registry.snapshot()]
        await nodes.close()
        return first, second

    return asyncio.run(go())


def test_a_complete_poll_drops_a_vanished_node_at_once():
    first, second = _run(complete=True)
    assert first == ["d1", "p1"] and second == ["d1"]


def test_an_incomplete_poll_keeps_a_silent_node_until_its_expiry():
    first, second = _run(complete=False)
    assert first == ["d1", "p1"] and second == ["d1", "p1"]


class _SlowReplyPath(NodeClient):
    """Statuses come back through the reply path after ``delay_s``, as from a busy node."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def query_status(self, addr: str, timeout_s: float):
        await asyncio.sleep(self.delay_s)
        self.reply_path_ok.add(addr.removeprefix("inproc://"))  # what a status arriving there does
        return object()


class _Listed(NodeRegistry):
    def __init__(self, nodes: NodeClient, listed) -> None:
        super().__init__(nodes, poll_interval_s=0.05, node_expiry_s=10.0)
        self.listed = listed

    async def poll_once(self):
        return self.listed


def test_a_new_router_is_ready_only_once_its_first_nodes_answered_through_the_reply_path():
    """Else a router that has just (re)started answers 503 "no usable decode node" to requests
    that arrive before its probes come back, though every node is up."""

    async def go():
        nodes = _SlowReplyPath(delay_s=0.3)
        registry = _Listed(nodes, [node_info("p1", "prefill"), node_info("d1", "decode")])
        registry.start()
        await asyncio.wait_for(registry.ready.wait(), timeout=5)
        usable = [n.node_id for n in registry.snapshot()]
        await registry.stop()
        await nodes.close()
        return usable

    assert asyncio.run(go()) == ["d1", "p1"]


def _with_redis_registry(tmp_path, expiry_s: float, check) -> None:
    """``check(registry)`` against a RedisRegistry on a real redis-server; closes both after."""
    from pdserve.router.registry_client import RedisRegistry
    from tests.cluster import RedisServer

    redis = RedisServer(tmp_path)

    async def go():
        nodes = NodeClient()
        try:
            await check(RedisRegistry(redis.url, nodes, poll_interval_s=0.1, node_expiry_s=expiry_s), redis)
        finally:
            await nodes.close()

    try:
        asyncio.run(go())
    finally:
        redis.stop()


@pytest.mark.usefixtures("processes")
def test_a_redis_record_is_fresh_while_its_heartbeat_changes_whatever_the_clocks_say(tmp_path):
    async def check(registry, _redis):
        behind = node_info("d1", "decode", heartbeat_time=time.time() - 3600.0)  # its clock is an hour slow
        ahead = node_info("p1", "prefill", heartbeat_time=time.time() + 43.0)  # or was just stepped forward
        assert registry.fresh([behind, ahead], now=10.0) == [behind, ahead]  # first seen: fresh
        later = [dataclasses.replace(n, heartbeat_time=n.heartbeat_time + 1.0) for n in (behind, ahead)]
        assert registry.fresh(later, now=12.0) == later  # both beat again
        assert registry.fresh(later, now=14.9) == later  # no new beat, but within 3 s of the last
        assert registry.fresh(later, now=15.1) == []  # a hung node whose key lives on: gone
        assert registry.fresh([behind], now=15.2) == [behind]  # it beats again: back at once

    _with_redis_registry(tmp_path, 3.0, check)


@pytest.mark.usefixtures("processes")
def test_a_node_with_a_skewed_clock_stays_in_the_pool_through_real_redis_polls(tmp_path, monkeypatch):
    from pdserve.protocol import registry as records

    # The node's records are stamped by a wall clock an hour slow; the router's is right.
    # (Unsigned: under a cluster key a node first seen an hour behind is refused, see ReplayGuard.)
    monkeypatch.setattr(records, "_wall_clock", lambda: time.time() - 3600.0)
    monkeypatch.setattr(records, "_last_stamp", (time.time() - 3600.0, time.monotonic()))

    async def check(registry, redis):
        node = node_info("d1", "decode")
        for _ in range(4):  # beating every 0.2 s, within the expiry
            records.publish(redis.client, node, ttl_s=30.0)
            assert [n.node_id for n in await registry.poll_once()] == ["d1"]
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.6)  # it stops beating; its key lives for 30 s
        assert await registry.poll_once() == []

    _with_redis_registry(tmp_path, 0.5, check)


def test_a_node_streaming_a_request_nobody_waits_for_is_told_to_abort_it():
    """An abort can beat a request's KV to its decode node, which then adopts and decodes it: its
    first stray chunk at the router sends an AbortRequest back to that node, over real sockets.
    Chunks of a waiting request, a last chunk and a prefill node's first token send none."""
    from pdserve.protocol import messages as pm
    from pdserve.protocol.channel import ListenChannel, PushChannel
    from pdserve.protocol.reasons import FinishReason

    node = ListenChannel("tcp://127.0.0.1:0", decoder=pm.decode_frames)

    def chunk(request_id: str, **fields) -> pm.TokenChunk:
        base = dict(logprobs=(), finish_reason=None, num_prompt_tokens=3, num_cached_tokens=0)
        return pm.TokenChunk(request_id=request_id, node_id="d1", token_ids=(7,), **{**base, **fields})

    async def go() -> tuple[list[str], int]:
        nodes = NodeClient()
        nodes.start()
        registry = NodeRegistry(nodes, poll_interval_s=0.1, node_expiry_s=10.0)
        registry.update([node_info("d1", "decode", control_addr=node.address)], now=100.0, complete=True)
        waiting = nodes.open("waiting")
        push = PushChannel(nodes.reply_addr)
        for msg in [
            chunk("waiting"),
            chunk("ended", finish_reason=FinishReason.STOP),
            chunk("first-token", is_first=True),
            chunk("stray"),
        ]:
            assert push.send(msg)
        got = await asyncio.wait_for(waiting.get(), 5)
        aborted: list[str] = []
        deadline = time.monotonic() + 5
        while not aborted and time.monotonic() < deadline:
            inbound = await asyncio.to_thread(node.recv, 0.1)
            if inbound is not None and isinstance(inbound.msg, pm.AbortRequest):
                aborted.append(inbound.msg.request_id)
        while (inbound := await asyncio.to_thread(node.recv, 0.3)) is not None:  # nothing else comes
            aborted.append(getattr(inbound.msg, "request_id", inbound.msg.TAG))
        push.close()
        await nodes.close()
        return aborted, len(got.token_ids)

    try:
        aborted, num_tokens = asyncio.run(go())
    finally:
        node.close()
    assert aborted == ["stray"] and num_tokens == 1
