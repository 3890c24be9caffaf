"""The wire is versioned: every message's and registry record's fields are pinned per protocol
version, and processes of two versions refuse each other, naming the node."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import types
import typing

import msgpack
import pytest

from pdserve.kv_transfer import messages as km
from pdserve.protocol import codec
from pdserve.protocol import messages as pm
from pdserve.protocol.fingerprint import KVFingerprint
from pdserve.protocol.registry import VERSION_FIELD, NodeInfo, Role

# One digest per protocol version, of every wire type's fields (name, type, default or not, in
# order) and every enum's values. Never edit an entry: a wire change moves PROTOCOL_VERSION
# (protocol/codec.py) and adds the new version's digest here.
WIRE_DIGESTS = {
    5: "807ded81dd7e2f12",
    6: "423393a3a5508fd0",
    7: "552a6bdcc1409b69",
    8: "c873b71b786ecfa9",
    9: "befd26030e427d77",
    10: "68fc9c24bee4a8a0",
    11: "6e58b03fcfd0ae1b",
}


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return f"Annotated[{_type_name(args[0])}, {', '.join(map(str, hint.__metadata__))}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(sorted(_type_name(a) for a in args))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "..." if hint is Ellipsis else getattr(hint, "__name__", str(hint))


def _reachable(hint, seen: dict) -> None:
    """Every dataclass and enum a field's type names, recursively, into ``seen``."""
    for arg in typing.get_args(hint):
        _reachable(arg, seen)
    if isinstance(hint, type) and issubclass(hint, enum.Enum) and hint.__name__ not in seen:
        seen[hint.__name__] = sorted(str(m.value) for m in hint)
    elif dataclasses.is_dataclass(hint) and hint.__name__ not in seen:
        hints = typing.get_type_hints(hint, include_extras=True)
        seen[hint.__name__] = [
            [
                f.name,
                _type_name(hints[f.name]),
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING,
            ]  # noqa: E501
            for f in dataclasses.fields(hint)
        ]
        for f in dataclasses.fields(hint):
            _reachable(hints[f.name], seen)


def wire_description() -> dict:
    seen: dict = {}
    for cls in (*pm.MESSAGE_TYPES, *km.MESSAGE_TYPES, NodeInfo):
        _reachable(cls, seen)
    tags = {cls.__name__: cls.TAG for cls in (*pm.MESSAGE_TYPES, *km.MESSAGE_TYPES)}
    return {"types": seen, "tags": tags, "record_version_field": VERSION_FIELD}


def wire_digest() -> str:
    text = json.dumps(wire_description(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_the_wire_is_the_one_its_protocol_version_names():
    digest = wire_digest()
    assert WIRE_DIGESTS.get(codec.PROTOCOL_VERSION) == digest, (
        f"the wire's fields changed (digest {digest}) but PROTOCOL_VERSION is still "
        f"{codec.PROTOCOL_VERSION}: bump it in protocol/codec.py and add its digest to WIRE_DIGESTS"
        if codec.PROTOCOL_VERSION in WIRE_DIGESTS
        else f"protocol {codec.PROTOCOL_VERSION} has no pinned digest: add {digest} to WIRE_DIGESTS"
    )


def test_the_digest_sees_a_field_added_with_a_default(monkeypatch):
    # how TokenChunk.position once went out unversioned: a field with a default, decoded as that
    # default from a peer that never sent it
    before = wire_digest()

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Wider(pm.TokenChunk):
        late: int = 0

    monkeypatch.setattr(pm, "MESSAGE_TYPES", (*pm.MESSAGE_TYPES[:-1], Wider))
    assert wire_digest() != before


def test_wire_messages_are_built_by_keyword_only():
    for cls in (*pm.MESSAGE_TYPES, *km.MESSAGE_TYPES, NodeInfo, KVFingerprint):
        fields = dataclasses.fields(cls)
        assert all(f.kw_only for f in fields), cls.__name__
    with pytest.raises(TypeError):
        pm.AbortRequest("r1", "gone")  # type: ignore[misc]


def _header(version, tag: str, fields: dict) -> bytes:
    return msgpack.packb([version, tag, fields], use_bin_type=True)


@pytest.mark.parametrize("version", [codec.PROTOCOL_VERSION - 1, codec.PROTOCOL_VERSION + 1])
def test_a_message_of_another_version_is_refused_naming_the_node_that_sent_it(version):
    chunk = {"request_id": "r1", "node_id": "decode-a", "token_ids": [1], "logprobs": []}
    with pytest.raises(codec.VersionMismatch) as refused:
        pm.decode(_header(version, "tokens", chunk))
    assert refused.value.sender == "decode-a" and refused.value.version == version
    assert f"node decode-a speaks pdserve protocol {version}" in str(refused.value)
    assert f"this process speaks protocol {codec.PROTOCOL_VERSION}" in str(refused.value)
    status = {"nonce": 1, "info": {"node_id": "prefill-b", "role": "prefill"}}
    with pytest.raises(codec.VersionMismatch, match="node prefill-b speaks"):
        pm.decode(_header(version, "status", status))
    with pytest.raises(codec.VersionMismatch, match="from a peer speaks"):
        km.decode(_header(version, "ack", {"request_id": "r1"}))


def _record(**fields) -> dict[str, str]:
    fp = KVFingerprint(
        model_id="m",
        dtype="float32",
        block_size=16,
        layout="nbhd-v1",
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
    )
    info = NodeInfo(
        node_id="decode-old",
        role=Role.DECODE,
        control_addr="tcp://127.0.0.1:1",
        kv_addr="tcp://127.0.0.1:2",
        fingerprint=fp,
        max_model_len=64,
        num_blocks_total=8,
        num_blocks_free=8,
        num_blocks_cached=0,
        num_running=0,
        num_queued=0,
        num_queued_prefill_tokens=0,
    )
    record = info.to_redis() | {k: json.dumps(v) for k, v in fields.items()}
    return {k: v for k, v in record.items() if v != "null" or k != VERSION_FIELD}


def test_a_record_names_its_version_and_one_of_another_is_refused_by_node():
    assert NodeInfo.from_redis(_record()).node_id == "decode-old"
    with pytest.raises(
        codec.VersionMismatch, match="registry record from node decode-old speaks pdserve protocol 4"
    ):
        NodeInfo.from_redis(_record(protocol_version=4))
    with pytest.raises(
        codec.VersionMismatch, match="from node decode-old names no protocol version \\(4 or older\\)"
    ):
        NodeInfo.from_redis(_record(protocol_version=None))  # records of protocol 4 had no version
