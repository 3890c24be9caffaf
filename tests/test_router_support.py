"""Helpers for the router tests (no tests here): node records, a fixed registry, an in-process app,
and a fake cluster (nodes without a model behind the real router on uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

import httpx
import uvicorn
import zmq
import zmq.asyncio

from pdserve.launcher.ports import free_port
from pdserve.protocol import messages as pm
from pdserve.protocol.fingerprint import KVFingerprint
from pdserve.protocol.model_digest import model_digest
from pdserve.protocol.registry import NodeInfo, Role
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.node_client import NodeClient
from pdserve.router.registry_client import NodeRegistry
from pdserve.router.tokenizer import Tokenizer

FINGERPRINT = KVFingerprint(
    model_id="tiny", dtype="float32", block_size=4, layout="test", num_layers=2, num_kv_heads=2, head_dim=16
)


def node_info(node_id: str, role: str, **fields) -> NodeInfo:
    defaults = dict(
        control_addr=f"inproc://{node_id}",
        kv_addr=f"inproc://{node_id}-kv" if role == "decode" else None,
        fingerprint=FINGERPRINT,
        max_model_len=512,
        num_blocks_total=100,
        num_blocks_free=100,
        num_blocks_cached=0,
        num_running=0,
        num_queued=0,
        num_queued_prefill_tokens=0,
        heartbeat_time=0.0,
    )
    return NodeInfo(node_id=node_id, role=Role(role), **{**defaults, **fields})


class FixedRegistry(NodeRegistry):
    """Serves ``records`` (change them at will); nodes expire like real ones when removed."""

    def __init__(
        self,
        nodes: NodeClient,
        records: Sequence[NodeInfo] = (),
        poll_interval_s: float = 0.05,
        node_expiry_s: float = 0.3,
    ) -> None:
        super().__init__(nodes, poll_interval_s, node_expiry_s)
        self.records = list(records)

    async def poll_once(self) -> list[NodeInfo]:
        return list(self.records)

    def reply_verified(self, node: NodeInfo) -> bool:
        return True  # records without a node behind them: nothing could answer a probe


def config_for(model_dir, **fields) -> RouterConfig:
    return RouterConfig(model=str(model_dir), decode_addrs=("inproc://unused",), **fields)


@dataclasses.dataclass
class AppHandle:
    client: httpx.AsyncClient
    registry: FixedRegistry
    app: object


@contextlib.asynccontextmanager
async def running_app(
    config: RouterConfig, tokenizer: Tokenizer, records: Sequence[NodeInfo] = ()
) -> AsyncIterator[AppHandle]:
    """The app with its lifespan running, a fixed registry, and an httpx client on it (no sockets)."""
    nodes = NodeClient()
    registry = FixedRegistry(nodes, records)
    app = create_app(config, tokenizer=tokenizer, registry=registry, nodes=nodes)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield AppHandle(client, registry, app)


# --------------------------------------------------------------------------- fake nodes


class FakeNode:
    """A node without a model: answers StatusQuery, records requests and aborts, and plays
    ``tokens`` (cycled up to max_tokens) as output. A prefill node sends the first token and hands
    the request to the decode node registered under the request's decode_addr, as the KV would."""

    peers: dict[str, FakeNode] = {}  # kv_addr -> decode node, shared by a test's fake cluster

    def __init__(
        self,
        node_id: str,
        role: str,
        tokens: Sequence[int],
        token_delay_s: float = 0.0,
        num_cached_tokens: int = 0,
        **fields,
    ) -> None:
        port = free_port()
        self.info = node_info(
            node_id,
            role,
            control_addr=f"tcp://127.0.0.1:{port}",
            kv_addr=f"fake-kv://{node_id}" if role == "decode" else None,
            **fields,
        )
        self.tokens = list(tokens)
        self.token_delay_s = token_delay_s  # between decode chunks
        self.num_cached_tokens = num_cached_tokens
        self.received: list[pm.GenerateRequest] = []
        self.aborted: list[str] = []
        self.fail_with: pm.RequestFailed | None = None  # answer every request with this
        self.fail_after: int | None = None  # decode: fail (non-retryable) after this many tokens
        self.fail_once = False  # ... only the first time
        self.late_first_token = False  # prefill: hand over to decode before reporting the first token
        self.silent = False  # take requests and never answer (a hung node)
        self._context = zmq.asyncio.Context.instance()
        self._tasks: set[asyncio.Task] = set()
        self._push: dict[str, zmq.asyncio.Socket] = {}
        if role == "decode":
            FakeNode.peers[self.info.kv_addr] = self

    async def serve(self) -> None:
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.info.control_addr)
        try:
            while True:
                identity, header = await router.recv_multipart()
                msg = pm.decode(header)
                if isinstance(msg, pm.StatusQuery):
                    reply = pm.NodeStatus(nonce=msg.nonce, info=self.info)
                    if msg.reply_addr is None:
                        await router.send_multipart([identity, pm.encode(reply)])
                    else:
                        await self._send(msg.reply_addr, reply)
                elif isinstance(msg, pm.AbortRequest):
                    self.aborted.append(msg.request_id)
                    for task in [t for t in self._tasks if t.get_name() == msg.request_id]:
                        task.cancel()
                elif isinstance(msg, pm.GenerateRequest):
                    self.received.append(msg)
                    self._spawn(self._generate(msg), msg.request_id)
        finally:
            router.close(linger=0)
            for sock in self._push.values():
                sock.close(linger=0)
            for task in self._tasks:
                task.cancel()

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, addr: str, msg: pm.Message) -> None:
        if addr not in self._push:
            self._push[addr] = self._context.socket(zmq.PUSH)
            self._push[addr].setsockopt(zmq.LINGER, 0)
            self._push[addr].connect(addr)
        await self._push[addr].send(pm.encode(msg))

    def _chunk(self, req: pm.GenerateRequest, index: int, is_first: bool) -> pm.TokenChunk:
        token = self.tokens[index % len(self.tokens)]
        finish = "length" if index + 1 >= req.sampling_params.max_tokens else None
        logprobs = ()
        if req.sampling_params.logprobs is not None:
            top = tuple(self.tokens[(index + k) % len(self.tokens)] for k in range(1, 3))
            logprobs = (
                pm.TokenLogprobs(
                    token_id=token, logprob=-0.5, top_token_ids=(token, *top), top_logprobs=(-0.5, -1.5, -2.5)
                ),
            )
        return pm.TokenChunk(
            request_id=req.request_id,
            node_id=self.info.node_id,
            token_ids=(token,),
            logprobs=logprobs,
            finish_reason=finish,
            num_prompt_tokens=len(req.token_ids),
            num_cached_tokens=self.num_cached_tokens,
            is_first=is_first,
            position=index,
        )

    async def _generate(self, req: pm.GenerateRequest) -> None:
        if self.silent:
            return
        if self.fail_with is not None:
            await self._send(req.reply_addr, dataclasses.replace(self.fail_with, request_id=req.request_id))
            return
        start = len(req.output_token_ids)  # a migrated request resumes after what was streamed
        first = self._chunk(req, start, is_first=start == 0)
        if not self.late_first_token:
            await self._send(req.reply_addr, first)
        if first.finish_reason is None:
            if req.decode_addr is None:
                await self.decode_rest(req)
            else:
                decode = FakeNode.peers[req.decode_addr]
                decode._spawn(decode.decode_rest(req), req.request_id)
        if self.late_first_token:
            await asyncio.sleep(0.2)
            await self._send(req.reply_addr, first)

    async def decode_rest(self, req: pm.GenerateRequest) -> None:
        for index in range(len(req.output_token_ids) + 1, req.sampling_params.max_tokens):
            await asyncio.sleep(self.token_delay_s)
            if self.fail_after is not None and index >= self.fail_after:
                if self.fail_once:
                    self.fail_after = None
                failed = pm.RequestFailed(
                    request_id=req.request_id,
                    node_id=self.info.node_id,
                    code="internal",
                    message="boom",
                    retryable=False,
                )
                await self._send(req.reply_addr, failed)
                return
            chunk = self._chunk(req, index, is_first=False)
            await self._send(req.reply_addr, chunk)
            if chunk.finish_reason is not None:
                return


@dataclasses.dataclass
class Cluster:
    base_url: str
    nodes: dict[str, FakeNode]
    app: object
    closers: list = dataclasses.field(default_factory=list)  # clients to close before the router stops


@contextlib.asynccontextmanager
async def fake_cluster(model_dir, nodes: Sequence[FakeNode], **config) -> AsyncIterator[Cluster]:
    """Fake nodes plus the real router (static registry, uvicorn on a free port), in this loop."""
    digest = model_digest(model_dir)  # the router refuses nodes of another model
    for n in nodes:
        n.info = dataclasses.replace(
            n.info, fingerprint=dataclasses.replace(n.info.fingerprint, model_id=digest)
        )
    node_tasks = [asyncio.create_task(n.serve()) for n in nodes]
    port = free_port()
    by_role = {
        role: tuple(n.info.control_addr for n in nodes if n.info.role == role)
        for role in ("prefill", "decode")
    }
    settings = dict(poll_interval_s=0.1, node_expiry_s=1.0, disagg_threshold=4, chunk_timeout_s=5.0)
    router_config = RouterConfig(
        model=str(model_dir),
        port=port,
        prefill_addrs=by_role["prefill"],
        decode_addrs=by_role["decode"],
        **{**settings, **config},
    )
    app = create_app(router_config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server_task = asyncio.create_task(server.serve())
    cluster = None
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        cluster = Cluster(f"http://127.0.0.1:{port}", {n.info.node_id: n for n in nodes}, app)
        yield cluster
    finally:
        for closer in cluster.closers if cluster else ():
            await closer.close()
        server.should_exit = True
        await server_task
        for task in node_tasks:
            task.cancel()
        await asyncio.gather(*node_tasks, return_exceptions=True)
        FakeNode.peers.clear()


TEXT = " The quick brown fox jumps over the lazy dog."
LONG_PROMPT = "Tell me a story about a fox and a dog, please."  # over the test threshold of 4 tokens


def fake_pair(tokens, **decode_fields) -> list[FakeNode]:
    """A prefill node (4 cached prompt tokens) and a decode node, both answering ``tokens``."""
    return [
        FakeNode("p0", "prefill", tokens, num_cached_tokens=4),
        FakeNode("d0", "decode", tokens, **decode_fields),
    ]


def run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))
