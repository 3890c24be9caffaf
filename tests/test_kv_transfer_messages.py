"""Wire messages: every type round-trips; anything else is a ProtocolError, never a crash."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer import messages
from pdserve.kv_transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    KVAck,
    KVChunk,
    KVCredit,
    KVDone,
    KVFingerprint,
    KVGrant,
    KVReject,
    KVReserve,
    KVWait,
    ProtocolError,
    RingRef,
    WireFormat,
)
from pdserve.protocol.sampling_params import SamplingParams

FP = KVFingerprint(
    model_id="smollm2-135m",
    dtype="float32",
    block_size=16,
    layout="nbhd-v1",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)
EXAMPLES = [
    KVReserve(
        request_id="r1",
        token_ids=(1, 2, 3),
        block_hashes=(2**64 - 1,),
        fingerprint=FP,
        ttl_s=2.5,
        wire_format=WireFormat.INT8,
        sampling_params=SamplingParams(temperature=0.0, stop=("x",)),
    ),
    KVReserve(request_id="r2", token_ids=(5,), block_hashes=(), fingerprint=FP, ttl_s=1.0),
    KVGrant(request_id="r1", num_held_blocks=2, block_ids=(7, 3, 9), window_bytes=1 << 26),
    KVGrant(request_id="r1", num_held_blocks=0, block_ids=(1,), window_bytes=4096, shm=True),
    KVReserve(
        request_id="r3",
        token_ids=(5, 6),
        block_hashes=(),
        fingerprint=FP,
        ttl_s=3.0,
        ring_ref=RingRef(pid=41, fd=7, num_bytes=1 << 20),
        host_id="h/boot",
    ),
    KVWait(request_id="r1", queue_position=4),
    KVReject(request_id="r1", reason="fingerprint mismatch", field="head_dim"),
    KVReject(request_id="r1", reason="busy"),
    KVChunk(request_id="r1", layer=29, block_start=3, num_blocks=2, checksums=(11, 2**64 - 1)),
    KVChunk(request_id="r1", layer=0, block_start=0, num_blocks=1, checksums=(1, 2), shm_offset=4096),
    KVCredit(request_id="r1", num_bytes=123456),
    KVDone(request_id="r1", first_token=42, num_prompt_tokens=1000, num_cached_tokens=256),
    KVAck(request_id="r1"),
    Abort(request_id="r1", reason="client left"),
    Error(request_id=None, code="malformed", message="not msgpack"),
]


def test_every_message_type_has_a_round_trip_example():
    assert {type(m) for m in EXAMPLES} == set(messages.MESSAGE_TYPES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.TAG)
def test_message_round_trips(msg):
    carries_frames = isinstance(msg, KVChunk) and msg.shm_offset is None  # shm chunks name a ring slot
    frames = [memoryview(b"k" * 8), memoryview(b"v" * 8)] if carries_frames else []
    assert messages.decode(messages.encode(msg), frames) == msg


def _header(tag: str, fields: object, version: object = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb([version, tag, fields])


def test_wrong_version_is_rejected():
    with pytest.raises(ProtocolError) as info:
        messages.decode(_header("ack", {"request_id": "r"}, version=PROTOCOL_VERSION + 1))
    assert info.value.field == "version"


def test_unknown_tag_is_rejected():
    with pytest.raises(ProtocolError) as info:
        messages.decode(_header("teleport", {}))
    assert info.value.field == "tag"


def test_missing_field_is_named():
    with pytest.raises(ProtocolError) as info:
        messages.decode(_header("credit", {"request_id": "r"}))
    assert info.value.field == "num_bytes"


def test_wrongly_typed_field_is_named():
    with pytest.raises(ProtocolError) as info:
        messages.decode(_header("credit", {"request_id": "r", "num_bytes": "lots"}))
    assert info.value.field == "num_bytes"


def test_bool_is_not_an_int_and_negative_counts_are_refused():
    for bad in (True, -1):
        with pytest.raises(ProtocolError):
            messages.decode(_header("credit", {"request_id": "r", "num_bytes": bad}))


def test_chunk_frame_count_must_match_its_checksums():
    header = messages.encode(KVChunk(request_id="r", layer=0, block_start=0, num_blocks=1, checksums=(1, 2)))
    with pytest.raises(ProtocolError) as info:
        messages.decode(header, [memoryview(b"only one")])
    assert info.value.field == "frames"


def test_oversized_frame_is_rejected():
    header = messages.encode(KVChunk(request_id="r", layer=0, block_start=0, num_blocks=1, checksums=(1, 2)))
    with pytest.raises(ProtocolError):
        messages.decode(header, [memoryview(b"x" * 65), memoryview(b"x")], max_frame_bytes=64)


def test_oversized_header_is_rejected():
    with pytest.raises(ProtocolError):
        messages.decode(b"\x00" * (messages.MAX_HEADER_BYTES + 1))


def test_fingerprint_names_its_first_difference():
    other = dataclasses.replace(FP, head_dim=128)
    assert FP.first_difference(other) == "head_dim" and FP.first_difference(FP) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_crash_the_decoder(data):
    try:
        messages.decode(data)
    except ProtocolError:
        pass


_leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
_values = st.recursive(
    _leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4)
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([cls.TAG for cls in messages.MESSAGE_TYPES]),
    st.dictionaries(
        st.sampled_from(["request_id", "layer", "token_ids", "fingerprint", "reason", "x"]), _values
    ),
)
def test_random_fields_decode_or_raise_protocol_error(tag, fields):
    try:
        msg = messages.decode(_header(tag, fields))
    except ProtocolError:
        return
    assert messages.decode(messages.encode(msg)) == msg
