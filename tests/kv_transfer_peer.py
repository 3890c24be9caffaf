"""Helpers for the kv_transfer tests, and a peer process for the kill -9 tests.

python tests/kv_transfer_peer.py send-half ADDRESS   # reserve, send half the layers, print SENT_HALF, sleep
python tests/kv_transfer_peer.py receive ADDRESS     # serve a receiver, print its address, poll forever
"""

from __future__ import annotations

import sys
import time

import torch

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.pool_reservations import PoolReservations  # noqa: F401  (re-exported for the tests)
from pdserve.engine.core.sequence import Sequence
from pdserve.kv_transfer.messages import KVFingerprint
from pdserve.protocol.kv_layout import KV_LAYOUT_NAME
from pdserve.protocol.sampling_params import SamplingParams

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 4, 2, 8


def make_fingerprint(**overrides: object) -> KVFingerprint:
    fields = dict(
        model_id="tiny",
        dtype="float32",
        block_size=BLOCK_SIZE,
        layout=KV_LAYOUT_NAME,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
    )
    fields.update(overrides)
    return KVFingerprint(**fields)  # type: ignore[arg-type]


def make_caches(
    num_blocks: int, seed: int | None, dtype: torch.dtype = torch.float32, num_layers: int = NUM_LAYERS
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer K and V: [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]; random or zeros (seed None)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

    def one() -> torch.Tensor:
        return (
            torch.randn(shape, generator=gen).to(dtype)
            if gen is not None
            else torch.zeros(shape, dtype=dtype)
        )

    return [one() for _ in range(num_layers)], [one() for _ in range(num_layers)]


def prefill_side(token_ids: list[int], num_blocks: int, skip: int = 0) -> tuple[BlockManager, Sequence]:
    """A sender-side block manager holding the prompt, after ``skip`` blocks used by someone else."""
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    if skip:
        bm.append(
            Sequence("other", [0] * skip * BLOCK_SIZE, skip * BLOCK_SIZE, SamplingParams()), skip * BLOCK_SIZE
        )
    seq = Sequence("req", list(token_ids), len(token_ids), SamplingParams())
    bm.append(seq, len(token_ids))
    return bm, seq


def _send_half(address: str) -> None:
    from pdserve.kv_transfer.sender import KVSender, SenderConfig

    tokens = list(range(1, 4 * BLOCK_SIZE + 2))
    _, seq = prefill_side(tokens, 16)
    keys, values = make_caches(16, seed=0)
    sender = KVSender(address, make_fingerprint(), SenderConfig(grant_timeout_s=10))
    tx = sender.reserve("victim", tokens)
    for layer in range(NUM_LAYERS // 2 + 1):
        sender.send_layer(tx, layer, keys[layer], values[layer], seq.block_table)
    print("SENT_HALF", flush=True)
    time.sleep(120)


def _receive(address: str) -> None:
    from pdserve.kv_transfer.receiver import KVReceiver

    keys, values = make_caches(16, seed=None)
    pool = PoolReservations(BlockManager(16, BLOCK_SIZE))
    receiver = KVReceiver(address, make_fingerprint(), pool, keys, values)
    pool.deliver = receiver.grant
    print(receiver.address, flush=True)
    while True:
        receiver.poll(1.0)


if __name__ == "__main__":
    mode, addr = sys.argv[1], sys.argv[2]
    {"send-half": _send_half, "receive": _receive}[mode](addr)
