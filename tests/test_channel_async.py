"""protocol.channel's asyncio flavour (the router's sockets) against the nodes' synchronous one."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq.asyncio

from pdserve.protocol import messages as pm
from pdserve.protocol.channel import AsyncDealerChannel, AsyncPullChannel, ListenChannel, PushChannel
from pdserve.protocol.codec import PROTOCOL_VERSION, ProtocolError
from tests.cluster import free_port

pytestmark = pytest.mark.timeout(30)


def test_dealer_refuses_sends_until_connected_and_reports_the_link_dropping():
    async def go():
        context = zmq.asyncio.Context()
        port = free_port()  # nobody listens there yet
        dealer = AsyncDealerChannel(context, f"tcp://127.0.0.1:{port}", decoder=pm.decode_frames)
        assert not dealer.try_send(
            pm.AbortRequest(request_id="r", reason="test")
        )  # never queued for a missing peer
        node = ListenChannel(f"tcp://127.0.0.1:{port}", decoder=pm.decode_frames)
        assert await asyncio.wait_for(dealer.next_link_event(), 10) is True
        deadline = time.monotonic() + 5  # the pipe attaches just after the handshake event
        while not dealer.try_send(pm.StatusQuery(nonce=5)):
            assert time.monotonic() < deadline, "connected, yet sends are refused"
            await asyncio.sleep(0.01)
        inbound = await asyncio.to_thread(node.recv, 5.0)
        assert inbound.msg == pm.StatusQuery(nonce=5)
        node.send(inbound.peer, pm.NodeStatus(nonce=5, info=None))
        assert await asyncio.wait_for(dealer.recv(), 5) == pm.NodeStatus(nonce=5, info=None)
        node.close()  # the node's process is gone: the connection drops
        assert await asyncio.wait_for(dealer.next_link_event(), 10) is False
        dealer.close()
        context.term()

    asyncio.run(go())


def test_pull_receives_typed_replies_and_raises_on_malformed_ones():
    async def go():
        context = zmq.asyncio.Context()
        pull = AsyncPullChannel(context, "tcp://127.0.0.1:*", decoder=pm.decode_frames)
        push = PushChannel(f"tcp://127.0.0.1:{pull.port}")
        chunk = pm.TokenChunk(
            request_id="r1",
            node_id="d0",
            token_ids=(4, 5),
            logprobs=(),
            finish_reason=None,
            num_prompt_tokens=3,
            num_cached_tokens=0,
        )
        assert push.send(chunk)
        assert await asyncio.wait_for(pull.recv(), 5) == chunk
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(f"tcp://127.0.0.1:{pull.port}")
        raw.send(msgpack.packb([PROTOCOL_VERSION + 1, "tokens", {}]))  # a stale protocol version
        with pytest.raises(ProtocolError):
            await asyncio.wait_for(pull.recv(), 5)
        raw.close(linger=0)
        push.close()
        pull.close()
        context.term()

    asyncio.run(go())
