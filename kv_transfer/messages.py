"""Wire messages of the KV transfer protocol. Torch-free: the router may import it.

A message on the wire is one ZeroMQ multipart message:

    frame 0      msgpack header  [PROTOCOL_VERSION, tag, {field: value, ...}]
    frame 1..n   raw tensor bytes (KVChunk only), one checksum per frame in the header

Decoding is strict: an unknown tag, another protocol version, a missing, extra or wrongly
typed field, a frame count that does not match the header, or an oversized frame raises
``ProtocolError`` (naming the field where there is one). Nothing is ever pickled.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Sequence
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 2  # 2: staging rings are memfds named by RingRef, KVDone carries first_logprobs
MAX_HEADER_BYTES = 8 << 20  # a 1M-token prompt's token ids and hashes fit
DEFAULT_MAX_FRAME_BYTES = 1 << 30


class ProtocolError(ValueError):
    """A message that cannot be decoded or violates the protocol."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field  # the offending header field, when there is one


class WireFormat(enum.StrEnum):
    NATIVE = "native"  # the cache dtype, bit for bit
    INT8 = "int8"  # symmetric int8 per (token, head) row with float32 scales; lossy


@dataclasses.dataclass(frozen=True, slots=True)
class CacheRef:
    """Where a peer on the same host finds a node's shared KV cache (kv_transfer.shared_cache)."""

    pid: int  # the owning process
    fd: int  # its memfd descriptor
    num_blocks: int  # blocks per layer in that cache


@dataclasses.dataclass(frozen=True, slots=True)
class RingRef:
    """Where a peer on the same host finds a sender's staging ring (kv_transfer.staging)."""

    pid: int  # the owning process
    fd: int  # its memfd descriptor
    num_bytes: int  # the ring's size


@dataclasses.dataclass(frozen=True, slots=True)
class KVFingerprint:
    """What must match for one node's KV blocks to be meaningful in another's cache."""

    model_id: str  # the weights' content digest (protocol.model_digest)
    dtype: str  # cache dtype, e.g. "float32"
    block_size: int  # tokens per block
    layout: str  # engine.kv_layout.KV_LAYOUT_NAME
    num_layers: int  # transformer layers
    num_kv_heads: int  # key/value heads
    head_dim: int  # channels per head
    block_hash: str = "xxh3_64-chained-u32le-v1"  # engine.block_hash.BLOCK_HASH_NAME: how prefixes are named

    @classmethod
    def from_spec(cls, model_id: str, spec: Any, layout: str) -> KVFingerprint:
        """From an ``engine.kv_layout.KVCacheSpec`` (num_blocks is local and not part of it)."""
        return cls(
            model_id, spec.dtype, spec.block_size, layout, spec.num_layers, spec.num_kv_heads, spec.head_dim
        )

    def first_difference(self, other: KVFingerprint) -> str | None:
        """Name of the first field that differs, or None when compatible."""
        for field in dataclasses.fields(self):
            if getattr(self, field.name) != getattr(other, field.name):
                return field.name
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's log-probability and its top alternatives."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]  # most likely first
    top_logprobs: tuple[float, ...]  # same order as top_token_ids


class Message:
    """Base of all wire messages; ``TAG`` names the type on the wire."""

    __slots__ = ()
    TAG: ClassVar[str]
    NUM_FRAMES_FIELD: ClassVar[str | None] = None  # header field whose length is the data frame count


@dataclasses.dataclass(frozen=True, slots=True)
class KVReserve(Message):
    """Prefill → decode: please hold blocks for this prompt's KV."""

    TAG: ClassVar[str] = "reserve"
    request_id: str  # unique per request across the cluster
    token_ids: tuple[int, ...]  # the prompt; the decode side needs it for its sequence and prefix cache
    block_hashes: tuple[int, ...]  # engine.block_hash.hash_full_blocks of the prompt
    fingerprint: KVFingerprint  # the sender's cache, checked against the receiver's
    ttl_s: float  # how long the reservation may wait for a grant
    wire_format: WireFormat = WireFormat.NATIVE  # how chunks will be encoded
    sampling_params: dict[str, Any] | None = None  # engine SamplingParams.to_dict(), for the decode side
    ring_ref: RingRef | None = None  # the sender's staging ring in shared memory, offered to same-host peers
    host_id: str | None = None  # kv_transfer.staging.host_id() of the sender, to tell same-host peers
    request_meta: dict[str, Any] | None = None  # opaque to kv_transfer: the decode node's per-request data
    cache_ref: CacheRef | None = None  # the sender's shared KV cache, for a one-copy same-host transfer


@dataclasses.dataclass(frozen=True, slots=True)
class KVGrant(Message):
    """Decode → prefill: blocks are held; send the KV of the blocks from num_held_blocks on."""

    TAG: ClassVar[str] = "grant"
    request_id: str
    num_held_blocks: int  # leading prompt blocks the receiver already had (prefix cache): not sent
    block_ids: tuple[int, ...]  # receiver block ids of the blocks to send, in prompt order
    window_bytes: int  # bound on this peer's unacknowledged chunk bytes (see KVCredit)
    shm: bool = False  # the receiver mapped the offered ring: chunks name slots instead of carrying frames
    direct: bool = False  # the receiver mapped the sender's cache: no chunks, KVDone names the blocks


@dataclasses.dataclass(frozen=True, slots=True)
class KVWait(Message):
    """Decode → prefill: no room yet; the reservation is queued until its ttl."""

    TAG: ClassVar[str] = "wait"
    request_id: str
    queue_position: int  # 0 = next to be granted


@dataclasses.dataclass(frozen=True, slots=True)
class KVReject(Message):
    """Decode → prefill: the reservation will never be granted."""

    TAG: ClassVar[str] = "reject"
    request_id: str
    reason: str  # human-readable
    field: str | None = None  # the fingerprint / reserve field at fault, if any


@dataclasses.dataclass(frozen=True, slots=True)
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


@dataclasses.dataclass(frozen=True, slots=True)
class KVCredit(Message):
    """Decode → prefill: chunk bytes consumed; the sender may have that many more in flight."""

    TAG: ClassVar[str] = "credit"
    request_id: str
    num_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
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


@dataclasses.dataclass(frozen=True, slots=True)
class KVAck(Message):
    """Decode → prefill: the KV landed and the request is the decode node's now."""

    TAG: ClassVar[str] = "ack"
    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class Abort(Message):
    """Either way: drop this request and free what it holds."""

    TAG: ClassVar[str] = "abort"
    request_id: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
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


# --------------------------------------------------------------------------- encoding
def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
        return [_to_wire(item) for item in value]  # plain ints and floats pass as they are
    return value


def encode(msg: Message) -> bytes:
    """The header frame of ``msg``."""
    return msgpack.packb([PROTOCOL_VERSION, msg.TAG, _to_wire(msg)], use_bin_type=True)


# --------------------------------------------------------------------------- decoding
def decode(
    header: bytes | memoryview,
    frames: Sequence[memoryview] = (),
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Message:
    """Parse a header frame and check the data frames that came with it."""
    return decode_with(header, _TAG_TO_TYPE, frames, max_frame_bytes)


def decode_with(
    header: bytes | memoryview,
    tag_to_type: dict[str, type[Message]],
    frames: Sequence[memoryview] = (),
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Message:
    """``decode`` for another family of messages (e.g. protocol.messages) in the same wire shape."""
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(header, use_list=False, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not msgpack: {exc}") from None
    if not (isinstance(obj, tuple) and len(obj) == 3):
        raise ProtocolError("header must be [version, tag, fields]")
    version, tag, fields = obj
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}", "version")
    cls = tag_to_type.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message tag {tag!r}", "tag")
    msg = _build(cls, fields)
    _check_frames(msg, frames, max_frame_bytes)
    return msg


def _check_frames(msg: Message, frames: Sequence[memoryview], max_frame_bytes: int) -> None:
    in_shm = getattr(msg, "shm_offset", None) is not None
    expected = 0 if msg.NUM_FRAMES_FIELD is None or in_shm else len(getattr(msg, msg.NUM_FRAMES_FIELD))
    if len(frames) != expected:
        raise ProtocolError(f"{msg.TAG} carries {len(frames)} data frames, expected {expected}", "frames")
    for frame in frames:
        if len(frame) > max_frame_bytes:
            raise ProtocolError(f"data frame of {len(frame)} bytes exceeds {max_frame_bytes}", "frames")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, fields: Any) -> Any:
    if not isinstance(fields, dict):
        raise ProtocolError(f"{cls.__name__} fields must be a map")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(fields) - set(known)
    if unknown:
        raise ProtocolError(f"{cls.__name__} has no field {sorted(map(str, unknown))[0]!r}", "fields")
    hints = _hints(cls)
    values = {}
    for name, field in known.items():
        if name not in fields:
            if field.default is dataclasses.MISSING:
                raise ProtocolError(f"{cls.__name__}.{name} is missing", name)
            continue
        values[name] = _coerce(hints[name], fields[name], f"{cls.__name__}.{name}", name)
    return cls(**values)


def _coerce(hint: Any, value: Any, where: str, name: str) -> Any:
    """``value`` as type ``hint``, or ProtocolError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, where, name)
    if origin is tuple:
        if not isinstance(value, tuple):
            raise ProtocolError(f"{where} must be an array", name)
        return tuple(_coerce(args[0], item, where, name) for item in value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ProtocolError(f"{where} must be a map with string keys", name)
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ProtocolError(f"{where} has unknown value {value!r}", name) from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 1 << 64:  # every integer in the protocol is a count, id, index or hash
            raise ProtocolError(f"{where} must be a non-negative 64-bit integer", name)
        return value
    if hint in (str, float, bool) and type(value) is hint:
        return value
    raise ProtocolError(
        f"{where} must be {getattr(hint, '__name__', hint)}, got {type(value).__name__}", name
    )
