"""Wire messages of the KV transfer protocol (prefill <-> decode), in the shared wire shape of
``protocol.codec``: a msgpack header, then raw tensor bytes (KVChunk only, one checksum per frame
in the header). Torch-free: the router may import it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import ClassVar

from pdserve.protocol import codec
from pdserve.protocol.codec import (  # noqa: F401  (re-exported: the KV protocol's users name them here)
    DEFAULT_MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    encode,
)
from pdserve.protocol.fingerprint import KVFingerprint
from pdserve.protocol.messages import RequestMeta, TokenLogprobs
from pdserve.protocol.sampling_params import SamplingParams


class WireFormat(enum.StrEnum):
    NATIVE = "native"  # the cache dtype, bit for bit
    INT8 = "int8"  # symmetric int8 per (token, head) row with float32 scales; lossy


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CacheRef:
    """Where a peer on the same host finds a node's shared KV cache (kv_transfer.shared_cache)."""

    pid: int  # the owning process
    fd: int  # its memfd descriptor
    num_blocks: int  # blocks per layer in that cache


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RingRef:
    """Where a peer on the same host finds a sender's staging ring (kv_transfer.staging)."""

    pid: int  # the owning process
    fd: int  # its memfd descriptor
    num_bytes: int  # the ring's size


@dataclasses.dataclass(frozen=True, slots=True)
class KVShipment:
    """One request's prompt KV to send, and what the decode side needs to go on from it: the one
    object that crosses the prefill node's shipper and the sender, which makes KVReserve and
    KVDone of it. Not a wire message itself."""

    request_id: str
    token_ids: tuple[int, ...]  # the prompt
    block_table: tuple[int, ...]  # the sender's blocks holding the prompt's KV, in prompt order
    first_token: int  # sampled by the prefill node from the prompt's last logits
    num_cached_tokens: int = 0  # usage: prompt tokens the prefill node took from its prefix cache
    sampling_params: SamplingParams | None = None  # how the decode side samples the rest
    request_meta: RequestMeta | None = None  # opaque to kv_transfer: where the decode node's tokens go
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked for logprobs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVReserve(Message):
    """Prefill → decode: please hold blocks for this prompt's KV."""

    TAG: ClassVar[str] = "reserve"
    request_id: str  # unique per request across the cluster
    token_ids: tuple[int, ...]  # the prompt; the decode side needs it for its sequence and prefix cache
    block_hashes: tuple[int, ...]  # protocol.block_hash.hash_full_blocks of the prompt
    fingerprint: KVFingerprint  # the sender's cache, checked against the receiver's
    ttl_s: float  # how long the reservation may wait for a grant
    wire_format: WireFormat = WireFormat.NATIVE  # how chunks will be encoded
    sampling_params: SamplingParams | None = None  # how the decode side samples the rest
    ring_ref: RingRef | None = None  # the sender's staging ring in shared memory, offered to same-host peers
    host_id: str | None = None  # kv_transfer.staging.host_id() of the sender, to tell same-host peers
    request_meta: RequestMeta | None = None  # opaque to kv_transfer: where the decode node's tokens go
    cache_ref: CacheRef | None = None  # the sender's shared KV cache, for a one-copy same-host transfer
    # With cache_ref: the sender's cache block of every prompt block, in prompt order, so that a
    # receiver that maps the cache copies at the grant while the sender computes the checksums.
    cache_block_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVGrant(Message):
    """Decode → prefill: blocks are held; send the KV of the blocks from num_held_blocks on."""

    TAG: ClassVar[str] = "grant"
    request_id: str
    num_held_blocks: int  # leading prompt blocks the receiver already had (prefix cache): not sent
    block_ids: tuple[int, ...]  # receiver block ids of the blocks to send, in prompt order
    window_bytes: int  # bound on this peer's unacknowledged chunk bytes (see KVCredit)
    shm: bool = False  # the receiver mapped the offered ring: chunks name slots instead of carrying frames
    direct: bool = False  # the receiver mapped the sender's cache: no chunks, KVDone names the blocks


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVWait(Message):
    """Decode → prefill: no room yet; the reservation is queued until its ttl."""

    TAG: ClassVar[str] = "wait"
    request_id: str
    queue_position: int  # 0 = next to be granted


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVReject(Message):
    """Decode → prefill: the reservation will never be granted."""

    TAG: ClassVar[str] = "reject"
    request_id: str
    reason: str  # human-readable
    field: str | None = None  # the fingerprint / reserve field at fault, if any


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVChunk(Message):
    """Prefill → decode: one layer's K and V for a run of the granted blocks."""

    TAG: ClassVar[str] = "chunk"
    NUM_FRAMES_FIELD: ClassVar[str | None] = "checksums"
    request_id: str
    layer: int  # transformer layer
    block_start: int  # index into KVGrant.block_ids of the first block in this chunk
    num_blocks: int  # blocks in this chunk
    checksums: tuple[int, ...]  # xxh3_64 of each data frame: native (K, V); int8 (Kq, Ks, Vq, Vs)
    shm_offset: int | None = (
        None  # with a shared ring: the frames lie back to back from here, not on the wire
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVCredit(Message):
    """Decode → prefill: chunk bytes consumed; the sender may have that many more in flight."""

    TAG: ClassVar[str] = "credit"
    request_id: str
    num_bytes: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVDone(Message):
    """Prefill → decode: all chunks sent; here is the first sampled token."""

    TAG: ClassVar[str] = "done"
    request_id: str
    first_token: int  # sampled by the prefill node from the prompt's last logits
    num_prompt_tokens: int  # usage
    num_cached_tokens: int  # usage: prompt tokens the prefill node took from its prefix cache
    src_block_ids: tuple[int, ...] = ()  # direct grants: the sender's blocks to copy, in prompt order
    layer_checksums: tuple[int, ...] = ()  # direct grants: xxh3 of K then V blocks, per layer
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked for logprobs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVAck(Message):
    """Decode → prefill: the KV landed and the request is the decode node's now."""

    TAG: ClassVar[str] = "ack"
    request_id: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Abort(Message):
    """Either way: drop this request and free what it holds."""

    TAG: ClassVar[str] = "abort"
    request_id: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Error(Message):
    """Either way: a message could not be handled (request_id None when it could not be read)."""

    TAG: ClassVar[str] = "error"
    request_id: str | None
    code: str  # machine-readable, e.g. "malformed", "checksum", "unknown_request"
    message: str


MESSAGE_TYPES: tuple[type[Message], ...] = (
    KVReserve,
    KVGrant,
    KVWait,
    KVReject,
    KVChunk,
    KVCredit,
    KVDone,
    KVAck,
    Abort,
    Error,
)
_TAG_TO_TYPE: dict[str, type[Message]] = {cls.TAG: cls for cls in MESSAGE_TYPES}


# --------------------------------------------------------------------------- decoding
def decode(
    header: bytes | memoryview,
    frames: Sequence[memoryview] = (),
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Message:
    """Parse a header frame and check the data frames that came with it."""
    return codec.decode_with(header, _TAG_TO_TYPE, frames, max_frame_bytes)
