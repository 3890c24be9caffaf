"""The typed values that cross process boundaries: each survives the wire exactly, and a bad one
is refused by the decoder naming its field (never a crash, never a half-built request)."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from kv_transfer import messages as km
from kv_transfer.messages import KVFingerprint, KVReserve
from protocol import messages as pm
from protocol.codec import PROTOCOL_VERSION, ProtocolError
from protocol.messages import GenerateRequest, RequestMeta
from protocol.sampling_params import SamplingParams

EVERY_FIELD_SET = SamplingParams(
    n=1,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=-(1 << 63),  # seeds are the protocol's one signed integer
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.1,
    max_tokens=77,
    min_tokens=3,
    stop=("\n\n", "END"),
    stop_token_ids=(2, 7),
    ignore_eos=True,
    logprobs=5,
)
FP = KVFingerprint("sha256:abc", "float32", 16, "nbhd-v1", 4, 2, 16)


def _generate(params: SamplingParams) -> GenerateRequest:
    return GenerateRequest("r1", (1, 2, 3), params, "tcp://127.0.0.1:5", None, 1e9, 5.0)


@pytest.mark.parametrize("params", [SamplingParams(), EVERY_FIELD_SET, SamplingParams(temperature=0, seed=7)])
def test_sampling_params_round_trip_as_a_typed_value(params):
    decoded = pm.decode(pm.encode(_generate(params)))
    assert decoded.sampling_params == params
    assert type(decoded.sampling_params) is SamplingParams


def test_every_sampling_field_is_exercised():
    defaults = SamplingParams()
    unchanged = [
        f.name
        for f in dataclasses.fields(SamplingParams)
        if getattr(EVERY_FIELD_SET, f.name) == getattr(defaults, f.name) and f.name != "n"
    ]
    assert unchanged == []


def _raw_generate(sampling: dict) -> bytes:
    fields = {
        "request_id": "r1",
        "token_ids": [1, 2],
        "sampling_params": sampling,
        "reply_addr": "tcp://127.0.0.1:5",
        "decode_addr": None,
        "deadline": 1e9,
    }
    return msgpack.packb([PROTOCOL_VERSION, GenerateRequest.TAG, fields])


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": -1.0},  # the class's own range check runs on decode
        {"top_p": "high"},  # a wrong type
        {"seed": 1 << 63},  # past a signed 64-bit integer
        {"max_tokens": -5},  # negative counts are refused as everywhere in the protocol
        {"beam_width": 4},  # a field the class does not have
    ],
)
def test_bad_sampling_params_on_the_wire_are_protocol_errors(sampling):
    with pytest.raises(ProtocolError):
        pm.decode(_raw_generate(sampling))


def test_request_meta_rides_in_kv_reserve_and_round_trips():
    meta = RequestMeta(
        "tcp://10.0.0.2:7000", 1.7e9, 1.7e9 - 0.5, {"prefill_queue": 0.01, "prefill_compute": 0.2}
    )
    msg = KVReserve("r1", (1, 2, 3), (), FP, 5.0, sampling_params=EVERY_FIELD_SET, request_meta=meta)
    decoded = km.decode(km.encode(msg))
    assert decoded == msg
    assert type(decoded.request_meta) is RequestMeta and type(decoded.sampling_params) is SamplingParams


def test_request_meta_needs_its_reply_address():
    header = km.encode(KVReserve("r1", (1,), (), FP, 5.0, request_meta=RequestMeta("tcp://x:1", 1.0, 1.0)))
    version, tag, fields = msgpack.unpackb(header)
    del fields["request_meta"]["reply_addr"]
    with pytest.raises(ProtocolError) as info:
        km.decode(msgpack.packb([version, tag, fields]))
    assert info.value.field == "reply_addr"
