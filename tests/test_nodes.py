"""Prefill and decode nodes as real processes with a real redis-server and a bare ZeroMQ client."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.protocol.registry import KEY_PREFIX, list_nodes
from tests.cluster import Client, NodeProcess, RedisServer
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("processes")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> str:
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pair(model, redis_server, tmp_path_factory):
    """One prefill and one decode node (block size 8, small pools), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("pair")
    extra = ["--block-size", "8", "--num-kv-blocks", "128"]
    nodes = [NodeProcess(role, model, tmp, redis_server.url, extra) for role in ("prefill", "decode")]
    try:
        prefill, decode = (n.wait_ready() for n in nodes)
        yield nodes[0], nodes[1], prefill, decode
    finally:
        for n in nodes:
            n.close()


@pytest.fixture()
def client():
    c = Client()
    yield c
    c.close()


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 256, (int(k),), generator=g).tolist()
        for k in torch.randint(lo, hi, (n,), generator=g)
    ]


def _assert_all_blocks_back(client: Client, *nodes: dict) -> None:
    for node in nodes:
        info = client.wait_idle(node)
        assert info["num_blocks_free"] == info["num_blocks_total"], info
        assert info["num_running"] == 0 and info["num_queued"] == 0


def test_disaggregated_greedy_outputs_equal_hf_for_concurrent_mixed_prompts(pair, client, model):
    _, decode_proc, prefill, decode = pair
    prompts = _prompts(8, 2, 120, seed=0)
    lengths = [1 + (5 * i) % 17 for i in range(len(prompts))]
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        client.generate(prefill, f"mix-{i}", p, {**GREEDY, "max_tokens": n}, decode=decode)
    results = client.collect([f"mix-{i}" for i in range(len(prompts))])
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        r = results[f"mix-{i}"]
        assert r["failed"] is None
        assert r["tokens"] == hf_greedy(model, p, n), f"request {i}"
        assert r["finish"] == "length"
        assert r["chunks"][0][1].is_first and r["chunks"][0][1].num_prompt_tokens == len(p)
    _assert_all_blocks_back(client, prefill, decode)


def test_first_token_is_sent_before_the_decode_node_has_the_kv(pair, client):
    prefill_proc, decode_proc, prefill, decode = pair
    client.generate(prefill, "ttft", list(range(3, 250)), {**GREEDY, "max_tokens": 4}, decode=decode)
    r = client.collect(["ttft"])["ttft"]
    sent = [e for e in prefill_proc.events("first_token_sent") if e["request_id"] == "ttft"][0]["ts"]
    adopted = [e for e in decode_proc.events("kv_adopted") if e["request_id"] == "ttft"][0]["ts"]
    assert sent < adopted
    first_arrival = r["chunks"][0][0]
    assert first_arrival < r["chunks"][-1][0]


def test_local_prefill_on_the_decode_node_matches_hf(pair, client, model):
    _, _, prefill, decode = pair
    prompt = list(range(10, 30))
    client.generate(decode, "local", prompt, {**GREEDY, "max_tokens": 9})
    r = client.collect(["local"])["local"]
    assert r["tokens"] == hf_greedy(model, prompt, 9)
    assert r["chunks"][0][1].is_first
    _assert_all_blocks_back(client, decode)


def test_abort_stops_decoding_and_frees_blocks_within_a_second(pair, client):
    _, _, prefill, decode = pair
    client.generate(prefill, "long", list(range(3, 60)), {**GREEDY, "max_tokens": 400}, decode=decode)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and client.status(decode)["num_running"] == 0:
        time.sleep(0.02)
    client.abort(decode, "long")
    start = time.monotonic()
    info = client.wait_idle(decode, timeout_s=1.0)
    assert time.monotonic() - start <= 1.0
    assert info["num_blocks_free"] == info["num_blocks_total"]


def test_bad_messages_get_an_error_and_the_node_keeps_serving(pair, client, model):
    _, _, prefill, decode = pair
    sock = client._dealer(decode["control_addr"])
    sock.send(b"\x93\x01\xa3not a real message")
    assert sock.poll(5000), "no answer to a malformed message"
    from pdserve.protocol.messages import RequestFailed
    from pdserve.protocol.messages import decode as decode_msg

    answer = decode_msg(sock.recv())
    assert isinstance(answer, RequestFailed) and answer.code == "bad_message"
    client.generate(decode, "bad-params", [5, 6], {"max_tokens": -1})
    failed = client.collect(["bad-params"])["bad-params"]["failed"]
    assert failed.code == "bad_request" and "max_tokens" in failed.message
    client.generate(decode, "after", [5, 6, 7], {**GREEDY, "max_tokens": 3})
    assert client.collect(["after"])["after"]["tokens"] == hf_greedy(model, [5, 6, 7], 3)


def test_nodes_register_in_redis_with_their_stats(pair, redis_server):
    _, _, prefill, decode = pair
    nodes = {n.node_id: n for n in list_nodes(redis_server.client)}
    assert nodes[prefill["node_id"]].role == "prefill"
    d = nodes[decode["node_id"]]
    assert d.role == "decode" and d.kv_addr == decode["kv_addr"] and d.num_blocks_total == 128
    assert d.fingerprint.block_size == 8 and d.fingerprint == nodes[prefill["node_id"]].fingerprint
    assert time.time() - d.heartbeat_time < 2.0


def test_heartbeat_appears_within_a_second_and_expires_after_kill(model, redis_server, tmp_path):
    node = NodeProcess(
        "decode",
        model,
        tmp_path,
        redis_server.url,
        ["--heartbeat-interval", "0.2", "--heartbeat-ttl", "1.0", "--num-kv-blocks", "16"],
    )
    try:
        info = node.wait_ready()
        key = KEY_PREFIX + info["node_id"]
        assert redis_server.client.exists(key)  # registered before it reported ready
        node.kill()  # kill -9: no chance to deregister
        start = time.monotonic()
        while redis_server.client.exists(key):
            assert time.monotonic() - start < 2.0, "record outlived its TTL"
            time.sleep(0.05)
    finally:
        node.close()


def test_sigterm_drains_and_deregisters(model, redis_server, tmp_path):
    node = NodeProcess("prefill", model, tmp_path, redis_server.url, ["--num-kv-blocks", "16"])
    try:
        info = node.wait_ready()
        assert redis_server.client.exists(KEY_PREFIX + info["node_id"])
        assert node.terminate() == 0
        assert not redis_server.client.exists(KEY_PREFIX + info["node_id"])
        assert node.events("node_stopped")
    finally:
        node.close()


def test_kv_that_never_arrives_is_reported_to_the_router_and_its_blocks_freed(pair, client):
    """A prefill node that reserves and then goes silent (as if killed): the decode node frees
    the grant at its chunk deadline and tells the waiting router instead of leaving it hanging."""
    from pdserve.kv_transfer.messages import KVFingerprint
    from pdserve.kv_transfer.sender import KVSender, SenderConfig
    from pdserve.protocol.kv_layout import KV_LAYOUT_NAME
    from pdserve.protocol.messages import RequestFailed, RequestMeta
    from pdserve.protocol.sampling_params import SamplingParams

    _, _, prefill, decode = pair
    fp = KVFingerprint(**client.status(decode)["fingerprint"])
    assert fp.layout == KV_LAYOUT_NAME
    sender = KVSender(decode["kv_addr"], fp, SenderConfig(shared_memory=False))
    try:
        tx = sender.reserve(
            "silent",
            list(range(200, 227)),
            SamplingParams(max_tokens=4),
            RequestMeta(reply_addr=client.reply_addr, deadline=time.time() + 30, shipped_at=time.time()),
        )
        assert tx.num_send_blocks == 4
        failed = client.collect(["silent"], timeout_s=15)["silent"]["failed"]
        assert isinstance(failed, RequestFailed) and failed.code == "kv_transfer"
        info = client.wait_idle(decode)
        assert info["num_blocks_free"] == info["num_blocks_total"]
    finally:
        sender.close()


def test_an_abort_reaches_reservations_queued_in_the_decode_engine_and_granted_ones(pair, client):
    """Reservations wait for blocks in the decode engine's own queue; the router's abort goes to
    the engine, which has the receiver stop the transfer: the waiting sender is told at once, and
    every block comes back (no tombstones left behind)."""
    import concurrent.futures

    from pdserve.kv_transfer.errors import KVAborted
    from pdserve.kv_transfer.messages import KVFingerprint
    from pdserve.kv_transfer.sender import KVSender, SenderConfig
    from pdserve.protocol.messages import RequestMeta
    from pdserve.protocol.sampling_params import SamplingParams

    _, _, _, decode = pair
    fp = KVFingerprint(**client.status(decode)["fingerprint"])
    meta = RequestMeta(reply_addr=client.reply_addr, deadline=time.time() + 30, shipped_at=time.time())
    senders = [KVSender(decode["kv_addr"], fp, SenderConfig(shared_memory=False)) for _ in range(2)]
    prompts = {
        rid: [(7 * i + k) % 250 + 3 for i in range(n)]
        for k, (rid, n) in enumerate([("a", 450), ("b", 450), ("c", 150)])
    }
    try:
        for rid in ("a", "b"):  # 57 blocks each of the 128
            senders[0].reserve(rid, prompts[rid], SamplingParams(max_tokens=4), meta)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(senders[1].reserve, "c", prompts["c"], SamplingParams(max_tokens=4), meta)
            deadline = time.monotonic() + 10
            while client.status(decode)["num_queued"] < 3:  # "c" queued, "a" and "b" receiving
                assert time.monotonic() < deadline and not waiting.done()
                time.sleep(0.05)
            started = time.monotonic()
            client.abort(decode, "c")
            with pytest.raises(KVAborted):
                waiting.result(timeout=5)
            assert time.monotonic() - started < 2.0  # told, not left to its grant deadline
        client.abort(decode, "a")
        client.abort(decode, "b")
        info = client.wait_idle(decode)
        assert info["num_blocks_free"] == info["num_blocks_total"] and info["num_queued"] == 0
    finally:
        for sender in senders:
            sender.close()
