"""``POST /admin/nodes/{node_id}/role``: tell a live node to serve another role (node.host);
``GET /admin/nodes``: the nodes this router routes to, as it sees them.

The router sends the node a SetRole and waits for it to drain its old role's work and
re-register, then until this router's own view lists it in the new role, so that the answer
means requests are routed by it. Authenticated as the rest of the API (``--api-key``).
"""

from __future__ import annotations

import asyncio
import time

import pydantic

from pdserve.protocol import messages as pm
from pdserve.protocol.registry import Role
from pdserve.router.errors import APIError
from pdserve.router.generation import Backend


class RoleBody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid")

    role: Role = pydantic.Field(strict=False)  # a name, e.g. "decode"
    # the longest wait for the node's drain (its own --drain-timeout bounds it too)
    timeout_s: float = pydantic.Field(default=60.0, gt=0, le=600)


async def switch_role(backend: Backend, node_id: str, body: RoleBody) -> dict:
    """The node's new role once this router routes by it; else an APIError that says why."""
    registry = backend.registry
    if registry.ROLES_FIXED:
        raise APIError(
            409,
            "role switches need the Redis registry: this router lists each node's role itself",
            None,
            "static_registry",
        )
    node = registry.node(node_id)
    if node is None:
        raise APIError(404, f"no live node {node_id!r}", "node_id", "node_not_found")
    started = time.monotonic()
    answer = await backend.nodes.set_role(node.control_addr, body.role, body.timeout_s)
    if answer is None:
        raise APIError(
            504, f"node {node_id} did not answer within {body.timeout_s:g} s", None, "node_timeout"
        )
    if answer.phase is pm.RolePhase.REFUSED:
        raise APIError(409, f"node {node_id} refused: {answer.error}", "role", "role_switch_refused")
    if answer.phase is not pm.RolePhase.DONE:
        raise APIError(
            504, f"node {node_id} is still draining after {body.timeout_s:g} s", None, "node_timeout"
        )
    await _until_listed(backend, node_id, body.role, started + body.timeout_s)
    return {
        "node_id": node_id,
        "role": str(body.role),
        "previous_role": str(node.role),
        "seconds": round(time.monotonic() - started, 3),
    }


async def _until_listed(backend: Backend, node_id: str, role: Role, deadline: float) -> None:
    """Wait until the registry view has ``node_id`` serving as ``role`` (the node published the
    record when it switched: the next poll reads it)."""
    deadline = max(deadline, time.monotonic() + 2 * backend.config.poll_interval_s + 1)
    while time.monotonic() < deadline:
        node = backend.registry.node(node_id)
        if node is not None and node.role is role and not node.draining:
            return
        await asyncio.sleep(0.05)
    raise APIError(
        504,
        f"node {node_id} switched, but this router's registry view does not show it yet",
        None,
        "node_timeout",
    )


def nodes_body(backend: Backend) -> dict:
    """``GET /admin/nodes``: each usable node's id, role, addresses, load, tensor-parallel size
    KV cache format and weights' quantization (None: the compute dtype)."""
    fields: tuple[str, ...] = ("node_id", "role", "draining", "control_addr", "kv_addr", "num_running")
    fields += ("num_queued", "num_blocks_free", "num_blocks_total", "tp_size")
    return {
        "nodes": [
            {
                **{name: getattr(n, name) for name in fields},
                "kv_dtype": n.fingerprint.dtype,
                "kv_layout": n.fingerprint.layout,
                "quantization": n.fingerprint.quantization or None,
            }
            for n in backend.registry.snapshot()
        ]
    }
