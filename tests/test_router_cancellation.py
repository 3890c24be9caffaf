"""A sample whose client left must stop, even when a node's reply lands in the same instant.

The race cannot be caused on purpose through real processes (it needs a reply and the
cancellation within one event-loop turn, which a loaded machine makes happen about once in a
dozen streams: ``test_router_cluster::test_client_disconnect_frees_the_blocks`` catches it
then). Here the loop is stepped by hand to put both in one turn, every time.
"""

from __future__ import annotations

import asyncio
import types

import pytest

from pdserve.router import generation
from pdserve.router.config import RouterConfig


def _backend_and_route():
    backend = generation.Backend(
        config=RouterConfig(model="unused", decode_addrs=("tcp://127.0.0.1:1",)),
        nodes=None,
        registry=types.SimpleNamespace(is_alive=lambda node_id: True),
        policy=None,
        metrics=None,
    )
    route = types.SimpleNamespace(decode=types.SimpleNamespace(node_id="decode-0"), prefill=None)
    return backend, route


@pytest.mark.parametrize("turns_between", [0, 1, 2, 3])
def test_a_reply_landing_with_the_cancellation_does_not_swallow_it(turns_between):
    backend, route = _backend_and_route()

    async def relay(queue):  # as a sample relays: reply after reply until it is stopped
        while True:
            await generation._next_reply(backend, route, queue, True, backend.config.chunk_timeout_s)

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        sample = asyncio.create_task(relay(queue))
        for _ in range(3):
            await asyncio.sleep(0)  # parked on the empty queue
        queue.put_nowait("a token chunk")
        for _ in range(turns_between):
            await asyncio.sleep(0)  # the reply is on its way into the waiting sample
        sample.cancel()
        await asyncio.wait({sample}, timeout=2)
        assert sample.cancelled()  # a swallowed cancellation leaves it waiting for the next reply

    asyncio.run(main())


def test_a_reply_waiting_in_the_queue_is_returned():
    backend, route = _backend_and_route()

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait("a token chunk")
        return await generation._next_reply(backend, route, queue, True, backend.config.chunk_timeout_s)

    assert asyncio.run(main()) == "a token chunk"
