"""What a node's KV transfer reads and writes: its engine's rank pools (Executor.rank_pools) seen
as the model's KV heads in order. The engine knows nothing of the transfer; the node wraps.

One rank's pool holds every head and is used as it is. Several ranks' pools are seen as one
(kv_transfer.tensors.HeadSplitCache), so the wire carries the model's heads in order whatever
either node's tensor-parallel layout: each node re-slices within itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
