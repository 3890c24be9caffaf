"""The wire codec every pdserve message family shares: router <-> node (protocol.messages) and
prefill <-> decode KV transfer (kv_transfer.messages). Torch-free.

A message on the wire is one ZeroMQ multipart message:

    frame 0      msgpack header  [PROTOCOL_VERSION, tag, {field: value, ...}]
    frame 1..n   raw data frames (KV chunks only), whose count the header says

Decoding is strict: an unknown tag, another protocol version, a missing, extra or wrongly typed
field, a frame count that does not match the header, or an oversized frame raises
``ProtocolError`` (naming the field where there is one). Nothing is ever pickled. The version is
checked first, before any field: processes of two pdserve versions refuse each other's messages
as ``VersionMismatch``, naming the node that sent one where its fields say, and never
half-understand them (a field added with a default would otherwise read as that default).
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

# Every change to a message's fields (or to a registry record's) moves this, and
# tests/test_wire_version.py pins a digest of each version's fields.
# 11: KVFingerprint.quantization (int8 weights); 10: trace context (GenerateRequest.trace, RequestMeta.trace); 9: KVFingerprint.compute_dtype; 8: beam search (TokenChunk.beams); 7: SamplingParams.logprob_token_ids (vLLM: the logprobs of chosen tokens); 6: registry records carry the node's tensor-parallel size (tp_size); 5: TokenChunk.position,
# typed stage timings and role phases, registry records name their
# version; 4: prompt logprobs (SamplingParams, TokenChunk); 3: typed SamplingParams (guided
# decoding), resumed outputs; 2: memfd rings
PROTOCOL_VERSION = 11
MAX_HEADER_BYTES = 8 << 20  # a 1M-token prompt's token ids and hashes fit
DEFAULT_MAX_FRAME_BYTES = 1 << 30
SIGNED = "signed"  # ``Annotated[int, SIGNED]``: a field that may be negative (plain ints may not)


class ProtocolError(ValueError):
    """A message that cannot be decoded or violates the protocol."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field  # the offending header field, when there is one


class VersionMismatch(ProtocolError):
    """A message or registry record of another protocol version than this process speaks."""

    def __init__(self, what: str, version: Any, sender: str | None) -> None:
        who = f"node {sender}" if sender else "a peer"
        said = (
            "names no protocol version (4 or older)"
            if version is None
            else f"speaks pdserve protocol {version!r}"
        )
        super().__init__(
            f"{what} from {who} {said}; this process speaks protocol {PROTOCOL_VERSION}: run one "
            "pdserve version across the cluster",
            "version",
        )
        self.version = version  # what the peer's message or record said
        self.sender = sender  # the peer's node id, where the message names one


def sender_of(fields: Any) -> str | None:
    """The node id a message's or record's fields name (TokenChunk, RequestFailed, NodeStatus, a
    registry record), best effort over fields that may be of another version."""
    if not isinstance(fields, dict):
        return None
    info = fields.get("info")
    node_id = fields.get("node_id", info.get("node_id") if isinstance(info, dict) else None)
    return node_id if isinstance(node_id, str) else None


class Message:
    """Base of all wire messages; ``TAG`` names the type on the wire."""

    __slots__ = ()
    TAG: ClassVar[str]
    NUM_FRAMES_FIELD: ClassVar[str | None] = None  # header field whose length is the data frame count


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
        raise VersionMismatch(f"message {tag!r}", version, sender_of(fields))
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
    return typing.get_type_hints(cls, include_extras=True)


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
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # a typed field's own validation (e.g. SamplingParams)
        raise ProtocolError(f"{cls.__name__}: {exc}", "fields") from None


def _coerce(hint: Any, value: Any, where: str, name: str) -> Any:
    """``value`` as type ``hint``, or ProtocolError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        if args[0] is int and SIGNED in hint.__metadata__:
            if isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63:
                return value
            raise ProtocolError(f"{where} must be a signed 64-bit integer", name)
        return _coerce(args[0], value, where, name)
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
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ProtocolError(f"{where} has unknown value {value!r}", name) from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 1 << 64:  # every plain integer in the protocol is a count, id, index or hash
            raise ProtocolError(f"{where} must be a non-negative 64-bit integer", name)
        return value
    if hint in (str, float, bool) and type(value) is hint:
        return value
    raise ProtocolError(
        f"{where} must be {getattr(hint, '__name__', hint)}, got {type(value).__name__}", name
    )
