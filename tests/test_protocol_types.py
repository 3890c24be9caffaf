"""The typed values that cross process boundaries: each survives the wire exactly, and a bad one
is refused by the decoder naming its field (never a crash, never a half-built request)."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import pytest

from pdserve.kv_transfer import messages as km
from pdserve.kv_transfer.messages import KVFingerprint, KVReserve
from pdserve.protocol import messages as pm
from pdserve.protocol.codec import PROTOCOL_VERSION, ProtocolError
from pdserve.protocol.messages import GenerateRequest, NodeStatus, RequestMeta, StageTimings, TraceContext
from pdserve.protocol.registry import NodeInfo, Role
from pdserve.protocol.sampling_params import BeamSearch, GuidedDecoding, LogitBias, SamplingParams

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
    prompt_logprobs=3,
    logprob_token_ids=(4, 2),
    logit_bias=(LogitBias(token_id=5, bias=-100.0), LogitBias(token_id=9, bias=2.5)),
    allowed_token_ids=(1, 5, 9),
    bad_words=("foo", "bar baz"),
    adapter="tenant-lora",
    adapter_path="/adapters/tenant-lora",
    cache_salt="tenant-a",
)
# guided decoding excludes ignore_eos and min_tokens, so it rides in a set of its own
GUIDED = SamplingParams(temperature=0, guided_decoding=GuidedDecoding.json_schema({"type": "object"}))
# beam search excludes sampling and the logits rules: a set of its own too
BEAMS = SamplingParams(n=3, temperature=0, beam_search=BeamSearch(length_penalty=-0.5, early_stopping=True))
FP = KVFingerprint(
    model_id="sha256:abc",
    dtype="float32",
    block_size=16,
    layout="nbhd-v1",
    num_layers=4,
    num_kv_heads=2,
    head_dim=16,
)


def _generate(params: SamplingParams) -> GenerateRequest:
    return GenerateRequest(
        request_id="r1",
        token_ids=(1, 2, 3),
        sampling_params=params,
        reply_addr="tcp://127.0.0.1:5",
        decode_addr=None,
        deadline=1e9,
        arrival_time=5.0,
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        EVERY_FIELD_SET,
        SamplingParams(temperature=0, seed=7),
        GUIDED,
        BEAMS,
        SamplingParams(guided_decoding=GuidedDecoding.choice(["yes", "no"])),
    ],
)
def test_sampling_params_round_trip_as_a_typed_value(params):
    decoded = pm.decode(pm.encode(_generate(params)))
    assert decoded.sampling_params == params
    assert type(decoded.sampling_params) is SamplingParams


def test_every_sampling_field_is_exercised():
    defaults = SamplingParams()
    unchanged = [
        f.name
        for f in dataclasses.fields(SamplingParams)
        if all(getattr(p, f.name) == getattr(defaults, f.name) for p in (EVERY_FIELD_SET, GUIDED, BEAMS))
        and f.name != "n"
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
        {"logit_bias": [{"token_id": 1, "bias": 500.0}]},  # outside [-100, 100]
        {"guided_decoding": {"kind": "xml", "text": "<a/>"}},  # an unknown constraint kind
        {"guided_decoding": {"kind": "choice", "text": "", "choices": []}},  # a choice of nothing
    ],
)
def test_bad_sampling_params_on_the_wire_are_protocol_errors(sampling):
    with pytest.raises(ProtocolError):
        pm.decode(_raw_generate(sampling))


def test_request_meta_rides_in_kv_reserve_and_round_trips():
    meta = RequestMeta(
        reply_addr="tcp://10.0.0.2:7000",
        deadline=1.7e9,
        shipped_at=1.7e9 - 0.5,
        timings=StageTimings(prefill_queue=0.01, prefill_compute=0.2),
    )
    msg = KVReserve(
        request_id="r1",
        token_ids=(1, 2, 3),
        block_hashes=(),
        fingerprint=FP,
        ttl_s=5.0,
        sampling_params=EVERY_FIELD_SET,
        request_meta=meta,
    )
    decoded = km.decode(km.encode(msg))
    assert decoded == msg
    assert type(decoded.request_meta) is RequestMeta and type(decoded.sampling_params) is SamplingParams


def test_request_meta_needs_its_reply_address():
    header = km.encode(
        KVReserve(
            request_id="r1",
            token_ids=(1,),
            block_hashes=(),
            fingerprint=FP,
            ttl_s=5.0,
            request_meta=RequestMeta(reply_addr="tcp://x:1", deadline=1.0, shipped_at=1.0),
        )
    )
    version, tag, fields = msgpack.unpackb(header)
    del fields["request_meta"]["reply_addr"]
    with pytest.raises(ProtocolError) as info:
        km.decode(msgpack.packb([version, tag, fields]))
    assert info.value.field == "reply_addr"


TRACE = TraceContext(traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", tracestate="a=1")


def test_the_trace_context_rides_to_both_nodes_and_round_trips():
    request = dataclasses.replace(_generate(SamplingParams()), trace=TRACE)
    assert pm.decode(pm.encode(request)) == request
    meta = RequestMeta(reply_addr="tcp://x:1", deadline=1.0, shipped_at=1.0, trace=TRACE)
    reserve = KVReserve(
        request_id="r1", token_ids=(1,), block_hashes=(), fingerprint=FP, ttl_s=5.0, request_meta=meta
    )
    decoded = km.decode(km.encode(reserve))
    assert decoded == reserve and type(decoded.request_meta.trace) is TraceContext
    assert pm.decode(pm.encode(_generate(SamplingParams()))).trace is None  # untraced: nothing rides


@pytest.mark.parametrize(
    "traceparent",
    [
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # no trace
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # peers speak version 00
        "not a traceparent",
    ],
)
def test_a_malformed_trace_context_on_the_wire_is_a_protocol_error(traceparent):
    header = pm.encode(dataclasses.replace(_generate(SamplingParams()), trace=TRACE))
    version, tag, fields = msgpack.unpackb(header)
    fields["trace"]["traceparent"] = traceparent
    with pytest.raises(ProtocolError, match="traceparent"):
        pm.decode(msgpack.packb([version, tag, fields]))


def _node(role: Role) -> NodeInfo:
    return NodeInfo(
        node_id=f"{role}-1",
        role=role,
        control_addr="tcp://10.0.0.2:5001",
        kv_addr="tcp://10.0.0.2:5002" if role is Role.DECODE else None,
        fingerprint=FP,
        max_model_len=512,
        num_blocks_total=64,
        num_blocks_free=60,
        num_blocks_cached=12,
        num_running=1,
        num_queued=3,
        num_queued_prefill_tokens=90,
        prefill_tokens_per_s=1234.5,
        integrity_error="free list has a duplicate" if role is Role.PREFILL else None,
        heartbeat_time=100.25,
    )


@pytest.mark.parametrize("role", list(Role))
def test_node_records_round_trip_through_redis_and_the_wire_typed(role):
    info = _node(role)
    from_redis = NodeInfo.from_redis({k.encode(): v.encode() for k, v in info.to_redis().items()})
    from_wire = pm.decode(pm.encode(NodeStatus(nonce=7, info=info))).info
    for decoded in (from_redis, from_wire):
        assert decoded == info
        assert type(decoded.role) is Role and type(decoded.fingerprint) is KVFingerprint


def test_node_status_before_a_record_exists_is_none():
    assert pm.decode(pm.encode(NodeStatus(nonce=1, info=None))).info is None


@pytest.mark.parametrize(
    "change",
    [{"role": json.dumps("router")}, {"fingerprint": json.dumps({"model_id": "x"})}, {"fingerprint": "null"}],
)
def test_unreadable_redis_records_raise_and_are_skipped(change):
    record = {**_node(Role.DECODE).to_redis(), **change}
    with pytest.raises((TypeError, ValueError)):
        NodeInfo.from_redis(record)


def test_roles_name_what_they_decode():
    assert [r for r in Role if r.decodes] == [Role.DECODE, Role.COLOCATED]
    assert Role("prefill") is Role.PREFILL and json.dumps(Role.PREFILL) == '"prefill"'


def test_prompt_logprobs_ride_the_first_chunk_with_their_ranks():
    entries = (
        pm.TokenLogprobs(token_id=7, logprob=-1.5, top_token_ids=(3, 7), top_logprobs=(-0.2, -1.5), rank=2),
        pm.TokenLogprobs(token_id=9, logprob=-0.1, top_token_ids=(), top_logprobs=(), rank=1),
    )
    chunk = pm.TokenChunk(
        request_id="r1",
        node_id="p0",
        token_ids=(4,),
        logprobs=(),
        finish_reason=None,
        num_prompt_tokens=3,
        num_cached_tokens=0,
        is_first=True,
        timings=None,
        prompt_logprobs=entries,
    )
    decoded = pm.decode(pm.encode(chunk))
    assert decoded == chunk and decoded.prompt_logprobs[0].rank == 2
    assert (
        pm.decode(
            pm.encode(
                pm.TokenChunk(
                    request_id="r1",
                    node_id="d0",
                    token_ids=(5,),
                    logprobs=(),
                    finish_reason=None,
                    num_prompt_tokens=3,
                    num_cached_tokens=0,
                )
            )
        ).prompt_logprobs
        == ()
    )


def test_finish_reasons_and_failure_codes_are_typed_on_the_wire():
    from pdserve.protocol.reasons import FailureCode, FinishReason

    chunk = pm.decode(
        pm.encode(
            pm.TokenChunk(
                request_id="r1",
                node_id="d0",
                token_ids=(5,),
                logprobs=(),
                finish_reason=FinishReason.LENGTH,
                num_prompt_tokens=3,
                num_cached_tokens=0,
            )
        )
    )
    assert chunk.finish_reason is FinishReason.LENGTH and chunk.finish_reason == "length"
    failed = pm.decode(
        pm.encode(
            pm.RequestFailed(
                request_id="r1", node_id="d0", code=FailureCode.TIMEOUT, message="late", retryable=False
            )
        )
    )
    assert failed.code is FailureCode.TIMEOUT
    # a value outside the enum does not decode: a typo'd or foreign code is a protocol error
    for msg in (
        pm.TokenChunk(
            request_id="r1",
            node_id="d0",
            token_ids=(5,),
            logprobs=(),
            finish_reason="done",
            num_prompt_tokens=3,
            num_cached_tokens=0,
        ),
        pm.RequestFailed(request_id="r1", node_id="d0", code="kaboom", message="?", retryable=False),
    ):
        with pytest.raises(ProtocolError, match="unknown value"):
            pm.decode(pm.encode(msg))
