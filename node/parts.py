"""What a node process holds whatever role it serves, and what a role must do on it.

The engine (weights, KV pool, prefix cache) and the control runtime (socket, heartbeats) outlive
a role: ``node.host.NodeHost`` builds them once and hands them to each role it serves in turn
(``prefill_node.server.PrefillNode``, ``decode_node.server.DecodeNode``).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.messages import KVFingerprint
from pdserve.kv_transfer.shared_cache import SharedKVCache
from pdserve.node.log import EventLog
from pdserve.node.options import NodeOptions
from pdserve.node.runtime import NodeRuntime
from pdserve.node.transfer_caches import transfer_caches
from pdserve.protocol.messages import Message
from pdserve.protocol.registry import NodeInfo
from pdserve.protocol.tracing import Tracer


@dataclasses.dataclass(slots=True)
class NodeParts:
    opts: NodeOptions  # its role: the one being served now
    log: EventLog
    engine: LLMEngine
    runtime: NodeRuntime
    # the KV pool in shared memory, which same-host decode nodes copy from (a node started as
    # prefill has one where the machine allows); None: a private pool, KV goes on the socket
    cache: SharedKVCache | None = None
    tracer: Tracer | None = None  # the process's span exporter (protocol/tracing.py); None: no traces

    @property
    def transfer_caches(self) -> list:
        """Per layer (K, V) with every KV head of the model, what the node's KV transfer reads and
        writes: the engine's pool, or a tensor-parallel node's rank pools seen as one."""
        return transfer_caches(self.engine.executor.rank_pools)

    @property
    def fingerprint(self) -> KVFingerprint:
        # the model's KV heads, not a rank's: nodes of any tensor-parallel layouts pair (the
        # transfer carries every head in order; engine/executor/executor.py re-slices within a node)
        spec = dataclasses.replace(self.engine.kv_spec, num_kv_heads=self.engine.model_config.num_kv_heads)
        config = self.engine.config
        return KVFingerprint.from_spec(
            self.opts.model_id, spec, spec.layout, config.dtype, config.quantization
        )


class ServedRole(Protocol):
    """One role's work on a node's parts, driven by the host's loop: each round the host calls
    ``wait_if_idle``, hands it the control messages that are its (``on_control``), then ``work``."""

    opts: NodeOptions  # the host swaps in new options when only the role's name changes

    def status(self) -> NodeInfo: ...

    def wait_if_idle(self) -> None: ...

    def on_control(self, msg: Message) -> None: ...

    def work(self) -> None: ...

    def busy(self) -> bool:
        """Holds work a drain must wait for."""
        ...

    def start_draining(self) -> None:
        """Take no new work (the runtime refuses new requests already)."""
        ...

    def close(self, message: str) -> None:
        """Fail what it still holds with ``message`` and close what is this role's own."""
        ...
