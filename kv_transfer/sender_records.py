"""A KV sender's settings and its records of a transfer (kv_transfer.sender uses them)."""

from __future__ import annotations

import dataclasses

from pdserve.kv_transfer.messages import WireFormat


@dataclasses.dataclass(frozen=True, slots=True)
class SenderConfig:
    grant_timeout_s: float = 10.0  # reserve → grant, KVWait included
    reply_timeout_s: float = 5.0  # longest wait for one credit or the final ack
    max_chunk_bytes: int = 16 << 20  # a layer's blocks are split into chunks of at most this
    wire_format: WireFormat = WireFormat.NATIVE  # INT8 quarters fp32 bytes, lossy
    staging_bytes: int = 64 << 20  # the staging ring: bounds this sender's in-flight chunk bytes
    shared_memory: bool = True  # offer the ring as shared memory to a receiver on the same host

    def __post_init__(self) -> None:
        if min(self.grant_timeout_s, self.reply_timeout_s, self.max_chunk_bytes, self.staging_bytes) <= 0:
            raise ValueError("SenderConfig timeouts and sizes must be positive")


@dataclasses.dataclass(slots=True)
class OutgoingTransfer:
    """One granted request on the prefill side."""

    request_id: str
    num_prompt_tokens: int
    num_held_blocks: int  # leading blocks the decode node already had: skipped
    num_send_blocks: int  # blocks to send, from num_held_blocks on
    started_at: float  # time.monotonic() at reserve
    shm: bool  # chunks name slots of the shared staging ring instead of carrying frames
    direct: bool = False  # the receiver copies straight from our shared cache: no chunks at all
    bytes_sent: int = 0  # payload bytes of all chunks (or, direct, of the blocks it copied)


@dataclasses.dataclass(frozen=True, slots=True)
class TransferStats:
    request_id: str
    num_held_blocks: int  # not sent thanks to the decode node's prefix cache
    num_sent_blocks: int
    bytes_sent: int  # payload bytes
    seconds: float  # reserve to ack
    shm: bool  # the chunks went through the shared staging ring, not the socket
    direct: bool = False  # the receiver copied from our shared cache (one copy, no chunks)
