"""Bad HTTP input against a real router over real nodes: hand-written abuse (huge prompts and
numbers, NaN, wrong types, invalid UTF-8, deep nesting, 10 MB bodies with and without a length,
slow-loris clients). Required: no 5xx, no process down, and normal requests served throughout."""

from __future__ import annotations

import json
import pathlib
import random
import re
import socket
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from pdserve.kv_transfer import messages as kvm
from pdserve.protocol import messages as pm
from pdserve.protocol.codec import PROTOCOL_VERSION
from pdserve.protocol.sampling_params import SamplingParams
from tests import web
from tests.chaos.load import Spec, request_once, write_report_row
from tests.cluster import free_port

pytestmark = pytest.mark.usefixtures("processes")


def _body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4, **fields}).encode()


CASES: dict[str, tuple[str, bytes]] = {
    "huge prompt text": ("/v1/completions", _body(prompt="word " * 300_000)),
    "huge prompt ids": ("/v1/completions", _body(prompt=list(range(200_000)))),
    "huge max_tokens": ("/v1/completions", _body(max_tokens=10**12)),
    "max_tokens 2**64": ("/v1/completions", _body(max_tokens=2**64)),
    "negative max_tokens": ("/v1/completions", _body(max_tokens=-1)),
    "negative temperature": ("/v1/completions", _body(temperature=-1)),
    "NaN top_p": ("/v1/completions", b'{"prompt": "hi", "top_p": NaN}'),
    "Infinity temperature": ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}'),
    "-Infinity penalty": ("/v1/completions", b'{"prompt": "hi", "presence_penalty": -Infinity}'),
    "n zero": ("/v1/completions", _body(n=0)),
    "n huge": ("/v1/completions", _body(n=10**6)),
    "negative logprobs": ("/v1/completions", _body(logprobs=-5)),
    "token id past vocab": ("/v1/completions", _body(prompt=[10**9])),
    "negative token id": ("/v1/completions", _body(prompt=[-3, 5])),
    "prompt number": ("/v1/completions", _body(prompt=123)),
    "prompt nested lists": ("/v1/completions", _body(prompt=[[[1]]])),
    "stop number": ("/v1/completions", _body(stop=5)),
    "stream string": ("/v1/completions", _body(stream="yes")),
    "seed float": ("/v1/completions", _body(seed=1.5)),
    "logit_bias junk": ("/v1/completions", _body(logit_bias={"x": "y"})),
    "invalid utf-8": ("/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}'),
    "lone surrogate": ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    "NUL in prompt": ("/v1/completions", b'{"prompt": "a\\u0000b", "max_tokens": 2}'),
    "deeply nested array": ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    "deeply nested object": ("/v1/completions", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    "json null": ("/v1/completions", b"null"),
    "json array": ("/v1/completions", b"[]"),
    "empty body": ("/v1/completions", b""),
    "truncated json": ("/v1/completions", b'{"prompt": "hi", "max_'),
    "messages string": ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode()),
    "messages empty": ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    "message role unknown": (
        "/v1/chat/completions",
        # vLLM serves a role its chat template renders; a short answer keeps the case short
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}).encode(),
    ),
    "message content parts junk": (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "x": 1}]}]}).encode(),
    ),
    "many messages": (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "hi"}] * 20_000, "max_tokens": 2}).encode(),
    ),
    "10 MB body": ("/v1/completions", b'{"prompt": "' + b"a" * (10 << 20) + b'"}'),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_body_gets_a_client_error(small, name):
    cluster, _, _ = small
    path, raw = CASES[name]
    reply = web.post(
        cluster.router.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    assert 400 <= reply.status_code < 500 or reply.status_code == 200, (reply.status_code, reply.text[:300])
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["message"] and error["type"], error


def test_a_10_mb_body_without_a_length_header_is_refused_too(small):
    cluster, _, _ = small

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'

    reply = web.post(cluster.router.url + "/v1/completions", content=chunks(), timeout=60)
    assert reply.status_code == 413, reply.text[:300]
    assert reply.json()["error"]["code"] == "body_too_large"


def test_slow_loris_clients_do_not_stop_the_router_serving(small, expected):
    cluster, _, _ = small
    host, port = "127.0.0.1", cluster.router.port
    loris = []
    for _ in range(100):
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n")
        loris.append(s)
    spec = Spec(tuple(range(300, 360)), 8, stream=True, logprobs=True)
    try:
        for _ in range(5):
            for s in loris:  # a byte of header now and then, never the end of it
                try:
                    s.sendall(b"X")
                except OSError:
                    pass
            started = time.monotonic()
            outcome = request_once(cluster.router.url, cluster.model.name, spec, timeout_s=30)
            assert outcome.kind == "complete" and time.monotonic() - started < 10, outcome
            expected.check(outcome)
            time.sleep(0.5)
    finally:
        for s in loris:
            s.close()
    write_report_row(
        {
            "fault": "100 slow-loris connections",
            "where": "router HTTP intake",
            "requests": 5,
            "in_flight": 100,
            "outcomes": {"complete": 5},
            "blocks_leaked": 0,
        }
    )


def test_after_all_the_abuse_every_process_is_up_and_idle(small, expected):
    cluster, tight, _ = small
    assert all(p.poll() is None for p in [cluster.router.proc, tight.proc, *(n.proc for n in cluster.nodes)])
    spec = Spec(tuple(range(500, 600)), 8, stream=False, logprobs=True)
    outcome = request_once(cluster.router.url, cluster.model.name, spec)
    assert outcome.kind == "complete", outcome
    expected.check(outcome)
    assert not any(cluster.wait_idle().values())
    write_report_row(
        {
            "fault": f"{len(CASES) + 1} hand-written bad bodies",
            "where": "router HTTP intake",
            "requests": len(CASES) + 1,
            "in_flight": 1,
            "outcomes": {"4xx or 200": len(CASES) + 1, "5xx": 0},
            "blocks_leaked": 0,
        }
    )


# --------------------------------------------------------------------------- bad ZeroMQ frames
def _bad_frames(seed: int) -> list[list[bytes]]:
    """Random bytes, truncated multipart, wrong tags, oversized headers, stale versions, wrong types."""
    rng = random.Random(seed)
    frames: list[list[bytes]] = [
        [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 4))] for _ in range(40)
    ]
    chunk = kvm.KVChunk(request_id="nobody", layer=0, block_start=0, num_blocks=1, checksums=(1, 2))
    frames += [
        [b""],
        [kvm.encode(chunk)],  # two checksums, no data frame
        [kvm.encode(chunk), b"x" * 64],  # one of two
        [kvm.encode(chunk)[: len(kvm.encode(chunk)) // 2]],  # a header cut in half
        [msgpack.packb([PROTOCOL_VERSION, "no_such_tag", {}])],
        [msgpack.packb([PROTOCOL_VERSION, 17, {}])],
        [msgpack.packb([PROTOCOL_VERSION - 1, "abort_request", {"request_id": "x", "reason": "y"}])],
        [msgpack.packb([PROTOCOL_VERSION + 1, "abort", {"request_id": "x", "reason": "y"}])],
        [msgpack.packb([PROTOCOL_VERSION, "generate", {"request_id": 5}])],
        [msgpack.packb([PROTOCOL_VERSION, "generate", {"request_id": "g", "token_ids": ["a"]}])],
        [msgpack.packb([PROTOCOL_VERSION, "status_query", {"nonce": -1}])],
        [msgpack.packb([PROTOCOL_VERSION, "tokens", {"request_id": "t", "x": 1}])],
        [msgpack.packb({"a": [1] * 10}), b"extra"],
        [b"\xc1" * 32],  # a msgpack byte that is never valid
        [msgpack.packb([PROTOCOL_VERSION, "abort", {"request_id": "x" * (9 << 20), "reason": ""}])],  # > 8 MB
    ]
    return frames


def _valid_for_unknown_requests(dead_reply: str) -> list[list[bytes]]:
    orphan_params = SamplingParams(temperature=0.0, max_tokens=4)
    return [
        [pm.encode(pm.AbortRequest(request_id="never-seen", reason="test"))],
        [
            kvm.encode(
                kvm.KVChunk(request_id="never-seen", layer=0, block_start=0, num_blocks=1, checksums=(1, 2))
            ),
            b"k" * 64,
            b"v" * 64,
        ],
        [
            kvm.encode(
                kvm.KVDone(request_id="never-seen", first_token=5, num_prompt_tokens=8, num_cached_tokens=0)
            )
        ],
        [kvm.encode(kvm.KVAck(request_id="never-seen"))],
        [kvm.encode(kvm.Abort(request_id="never-seen", reason="test"))],
        [
            pm.encode(
                pm.TokenChunk(
                    request_id="never-seen",
                    node_id="n",
                    token_ids=(1, 2),
                    logprobs=(),
                    finish_reason=None,
                    num_prompt_tokens=3,
                    num_cached_tokens=0,
                )
            )
        ],
        [
            pm.encode(
                pm.RequestFailed(request_id="never-seen", node_id="n", code="x", message="y", retryable=True)
            )
        ],
        # A real request whose router is gone: computed, its replies dropped, its blocks freed.
        [
            pm.encode(
                pm.GenerateRequest(
                    request_id="orphan",
                    token_ids=(5,) * 40,
                    sampling_params=orphan_params,
                    reply_addr=dead_reply,
                    decode_addr=None,
                    deadline=time.time() + 30,
                )
            )
        ],
    ]


def _zmq_ports(small) -> list[tuple[str, str, int]]:
    """(what, address, socket type to talk to it with) for every ZeroMQ port of every process."""
    cluster, _, _ = small
    reply = re.search(r"nodes push replies to (tcp://\S+)", cluster.router.log()).group(1)
    ports = [("router reply port", reply, zmq.PUSH)]
    for node in cluster.nodes:
        ports.append((f"{node.role} control port", node.addrs["control_addr"], zmq.DEALER))
        if node.addrs.get("kv_addr"):
            ports.append((f"{node.role} KV port", node.addrs["kv_addr"], zmq.DEALER))
    return ports


def test_bad_frames_on_every_zeromq_port_are_rejected_and_logged_and_nothing_leaks(small, expected):
    cluster, _, _ = small
    context = zmq.Context()
    dead_reply = f"tcp://127.0.0.1:{free_port()}"
    sent = 0
    try:
        for what, address, kind in _zmq_ports(small):
            socket_ = context.socket(kind)
            socket_.setsockopt(zmq.LINGER, 0)
            socket_.setsockopt(zmq.SNDTIMEO, 5000)
            socket_.connect(address)
            for parts in _bad_frames(hash(what) & 0xFFFF) + _valid_for_unknown_requests(dead_reply):
                socket_.send_multipart(parts)
                sent += 1
            time.sleep(0.5)
            socket_.close()
    finally:
        context.destroy(linger=0)
    time.sleep(1.0)
    for node in cluster.nodes:
        assert node.proc.poll() is None, node.log()[-3000:]
        assert node.events("bad_message"), node.role
    decode = next(n for n in cluster.nodes if n.role == "decode")
    assert any(e.get("port") == "kv" for e in decode.events("bad_message"))
    assert cluster.router.proc.poll() is None
    assert "dropped a malformed node message" in cluster.router.log()
    spec = Spec(tuple(range(700, 800)), 8, stream=True, logprobs=True)  # both node kinds serve on
    outcome = request_once(cluster.router.url, cluster.model.name, spec)
    assert outcome.kind == "complete", outcome
    expected.check(outcome)
    used = cluster.wait_idle()
    assert used and not any(used.values()), used
    write_report_row(
        {
            "fault": f"{sent} bad or unknown-request ZeroMQ messages",
            "where": "every ZeroMQ port: node control, decode KV, router reply",
            "requests": sent,
            "in_flight": 0,
            "outcomes": {"rejected and logged": sent, "crashed processes": 0},
            "blocks_leaked": 0,
        }
    )


@pytest.mark.chaos
def test_schemathesis_over_the_openapi_schema_finds_no_server_error(small, tmp_path):
    """Schema-driven bodies (valid and not) for every operation of the real router's schema."""
    cluster, _, _ = small
    cmd = [
        str(pathlib.Path(sys.executable).with_name("schemathesis")),
        "run",
        cluster.router.url + "/openapi.json",
        "--checks",
        "not_a_server_error",
        "--phases",
        "fuzzing",
        "--max-examples",
        "12",
        "--seed",
        "15",
        "--request-timeout",
        "60",
        "--no-color",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert all(p.poll() is None for p in [cluster.router.proc, *(n.proc for n in cluster.nodes)])
