"""Time a same-host KV transfer the way a prefill node ships one: the sender's cache in shared memory
(``direct``: the receiver copies the granted blocks out of it), the receiver in a child process.

Best reserve -> ack of a few transfers at two prompt sizes; the line through them is the profile's
transfer model (see bench/kv_transfer.py for every transport side by side).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp

import torch

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.pool_reservations import PoolReservations
from pdserve.kv_transfer.messages import KVFingerprint
from pdserve.protocol.kv_layout import KV_LAYOUT_NAME, KVCacheSpec


def _fingerprint(spec: KVCacheSpec) -> KVFingerprint:
    return KVFingerprint.from_spec("transfer-probe", spec, KV_LAYOUT_NAME)


def _receive(spec: KVCacheSpec, ready: mp.Queue, stop) -> None:
    from pdserve.kv_transfer.receiver import KVReceiver

    torch.set_num_threads(1)
    keys = [
        torch.zeros((spec.num_blocks, *spec.block_shape), dtype=torch.float32) for _ in range(spec.num_layers)
    ]
    values = [torch.zeros_like(k) for k in keys]
    pool = PoolReservations(BlockManager(spec.num_blocks, spec.block_size, enable_prefix_caching=False))
    receiver = KVReceiver("tcp://127.0.0.1:0", _fingerprint(spec), pool, keys, values)
    pool.deliver = receiver.grant
    ready.put(receiver.address)
    while not stop.is_set():
        for got in receiver.poll(0.05).completed:
            pool.finish(got.request_id)  # done at once: room for the next transfer
    receiver.close()


def measure_transfer(
    spec: KVCacheSpec, sizes: tuple[int, int] = (64, 512), repeats: int = 3
) -> list[tuple[int, float]]:
    """(KV bytes, best seconds) of a transfer of each prompt size; fp32 caches only."""
    from pdserve.kv_transfer.sender import KVSender, SenderConfig
    from pdserve.kv_transfer.shared_cache import SharedKVCache

    num_blocks = -(-max(sizes) // spec.block_size)
    probe = KVCacheSpec(
        spec.num_layers, 2 * num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, "float32"
    )
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_receive, args=(probe, ready, stop), daemon=True)
    child.start()
    try:
        address = ready.get(timeout=120)
        cache = SharedKVCache(dataclasses.replace(probe, num_blocks=num_blocks))
        cache.tensor.normal_()
        keys, values = zip(*cache.layer_caches(), strict=True)
        sender = KVSender(address, _fingerprint(probe), SenderConfig(grant_timeout_s=30), cache_ref=cache.ref)
        results = []
        for size in sizes:
            blocks = list(range(-(-size // spec.block_size)))
            best, num_bytes = float("inf"), 0
            for k in range(repeats + 1):  # the first warms pages and the connection
                stats = sender.transfer(f"probe-{size}-{k}", list(range(size)), keys, values, blocks, 0)
                if k:
                    best, num_bytes = min(best, stats.seconds), stats.bytes_sent
            results.append((num_bytes, best))
        sender.close()
        return results
    finally:
        stop.set()
        child.join(10)
