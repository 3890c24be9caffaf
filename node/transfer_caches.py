"""What a node's KV transfer reads and writes: its engine's rank pools (Executor.rank_pools) seen
as the model's KV heads in order. The engine knows nothing of the transfer; the node wraps.

One rank's pool holds every head and is used as it is. Several ranks' pools are seen as one
(kv_transfer.tensors.HeadSplitCache), so the wire carries the model's heads in order whatever
either node's tensor-parallel layout: each node re-slices within itself.

Only pools in host memory can be seen so: rank 0 maps its workers' memfds. Pools in device
memory (CUDA; the split platform in tests) are each rank's own, which rank 0 cannot read, so a
node of several ranks on a device is refused before it starts (``check_pools_shared``): its
transfer would otherwise read and land host copies the ranks never compute with. That holds for
a colocated node too: its decode role opens a KV receiver over the same pools, and a SetRole
makes it a decode node in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.executor.platform import platform_class
from pdserve.engine.executor.rank_pools import RankPool
from pdserve.kv_transfer.tensors import HeadSplitCache


def transfer_caches(pools: Sequence[RankPool]) -> list[tuple[Any, Any]]:
    """Per layer (K, V) with every KV head of the model: a torch.Tensor each at one rank, a
    HeadSplitCache over the ranks' pools at several."""
    if len(pools) == 1:
        return list(pools[0].layer_caches)
    heads = [pool.kv_heads for pool in pools]

    def split(layer: int, kind: int) -> HeadSplitCache:  # kind 0: K, 1: V
        return HeadSplitCache([pool.layer_caches[layer][kind] for pool in pools], heads)

    return [(split(layer, 0), split(layer, 1)) for layer in range(len(pools[0].layer_caches))]


def check_pools_shared(config: EngineConfig) -> None:
    """ValueError, before a node loads anything, when its KV transfer could not read and write
    its engine's pools: several tensor-parallel ranks whose pools are in device memory."""
    platform = platform_class(config.device)
    if config.tensor_parallel_size > 1 and platform.separate_host:
        raise ValueError(
            f"--device {config.device} ({platform.kind}) with --tensor-parallel-size "
            f"{config.tensor_parallel_size}: each rank's KV pool is in its own device's memory, which "
            "this node's KV transfer cannot read or write (it would move host copies, not the pools "
            "the ranks compute with); run prefill, decode and colocated nodes on a device at "
            "--tensor-parallel-size 1 (the offline LLM API runs several ranks on a device)"
        )
