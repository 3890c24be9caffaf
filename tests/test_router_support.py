"""Helpers for the router tests (no tests here): node records, a fixed registry, an in-process app."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

import httpx

from protocol.registry import NodeInfo
from router.app import create_app
from router.config import RouterConfig
from router.node_client import NodeClient
from router.registry_client import NodeRegistry
from router.tokenizer import Tokenizer

FINGERPRINT = {"model_id": "tiny", "dtype": "float32", "block_size": 4, "layout": "test",
               "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}


def node_info(node_id: str, role: str, **fields) -> NodeInfo:
    defaults = dict(
        control_addr=f"inproc://{node_id}", kv_addr=f"inproc://{node_id}-kv" if role == "decode" else None,
        fingerprint=FINGERPRINT, max_model_len=512, num_blocks_total=100, num_blocks_free=100,
        num_blocks_cached=0, num_running=0, num_queued=0, num_queued_prefill_tokens=0, heartbeat_time=0.0,
    )
    return NodeInfo(node_id=node_id, role=role, **{**defaults, **fields})


class FixedRegistry(NodeRegistry):
    """Serves ``records`` (change them at will); nodes expire like real ones when removed."""

    def __init__(self, nodes: NodeClient, records: Sequence[NodeInfo] = (), poll_interval_s: float = 0.05,
                 node_expiry_s: float = 0.3) -> None:
        super().__init__(nodes, poll_interval_s, node_expiry_s)
        self.records = list(records)

    async def poll_once(self) -> list[NodeInfo]:
        return list(self.records)


def config_for(model_dir, **fields) -> RouterConfig:
    return RouterConfig(model=str(model_dir), decode_addrs=("inproc://unused",), **fields)


@dataclasses.dataclass
class AppHandle:
    client: httpx.AsyncClient
    registry: FixedRegistry
    app: object


@contextlib.asynccontextmanager
async def running_app(config: RouterConfig, tokenizer: Tokenizer,
                      records: Sequence[NodeInfo] = ()) -> AsyncIterator[AppHandle]:
    """The app with its lifespan running, a fixed registry, and an httpx client on it (no sockets)."""
    nodes = NodeClient()
    registry = FixedRegistry(nodes, records)
    app = create_app(config, tokenizer=tokenizer, registry=registry, nodes=nodes)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield AppHandle(client, registry, app)
