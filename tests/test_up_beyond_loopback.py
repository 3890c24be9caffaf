"""The rogue-peer suite on `pdserve up` bound beyond loopback: the router and both nodes listen on
this machine's network address, guarded by the cluster key `pdserve up` made, and processes
without it try every way in while a concurrent load runs through the router:
- register a node in Redis (unsigned, or signed with another key);
- send a GenerateRequest to a node, offer it KV, push token chunks to the router's reply port;
- write a captured, validly signed registry record back.

Each is refused and logged, nothing of it is taken, and every request of the load is exact
(mixed lengths, streaming on and off, logprobs on and off; both the prefill->decode and the
decode-only path). Replayed frames on the sockets: tests/test_channel_auth.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import socket
import threading
import time

import pytest
import redis

from pdserve.protocol.addresses import is_loopback
from pdserve.protocol.cluster_key import write_new_key
from pdserve.protocol.registry import KEY_PREFIX
from tests import web
from tests.cluster import NodeProcess
from tests.engine_helpers import hf_greedy
from tests.up_launcher import FILLER, NODE_ARGS, Launcher, completion_text, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")


def network_host() -> str:
    """This machine's address on its network (where a route out leaves from); the wildcard where
    it has none beyond loopback. Either way the cluster binds beyond loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
            host = probe.getsockname()[0]
        except OSError:
            return "0.0.0.0"
    return "0.0.0.0" if is_loopback(host) else host


@pytest.fixture(scope="module")
def exposed(default_model_dir, tmp_path_factory):
    host = network_host()
    model = tiny_model_with_tokenizer(default_model_dir, tmp_path_factory.mktemp("model"))
    launcher = Launcher(
        tmp_path_factory.mktemp("up"),
        model,
        "--prefill",
        "1",
        "--decode",
        "1",
        node_args=f"{NODE_ARGS} --host {host}",
        host=host,
    )
    try:
        launcher.wait_up()
        yield model, launcher
    finally:
        launcher.close()


def ready(launcher: Launcher, child: str) -> dict:
    return json.loads((launcher.log_dir / f"{child}.ready.json").read_text())


def router_log(launcher: Launcher) -> str:
    return (launcher.log_dir / "router.log").read_text()


@contextlib.contextmanager
def load_stays_exact(model, launcher: Launcher, num_requests: int = 12):
    """Runs ``num_requests`` concurrent requests through the router while the block runs, and
    checks each against HF's greedy output after it."""
    from pdserve.router.tokenizer import Tokenizer

    tokenizer = Tokenizer(model)
    # short prompts prefill on the decode node, long ones go prefill node -> decode node
    prompts = [f"Request {i}: {FILLER if i % 2 else 'short'}" for i in range(num_requests)]

    def run(i: int) -> str:
        body = {"prompt": prompts[i], "max_tokens": 3 + i % 4, "temperature": 0.0, "ignore_eos": True}
        if i % 3 == 1:
            body["logprobs"] = 1
        return completion_text(launcher.url, body, stream=i % 4 >= 2)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        texts = [pool.submit(run, i) for i in range(num_requests)]
        yield
        for i, text in enumerate(texts):
            ids = tokenizer.encode(prompts[i])
            assert text.result() == tokenizer.decode(hf_greedy(str(model), ids, 3 + i % 4)), i


def test_the_cluster_listens_beyond_loopback_under_the_key_it_made(exposed):
    _, launcher = exposed
    addrs = [ready(launcher, "decode-0")["control_addr"], ready(launcher, "decode-0")["kv_addr"]]
    addrs.append(ready(launcher, "prefill-0")["control_addr"])
    if network_host() != "0.0.0.0":
        assert all(f"//{network_host()}:" in a for a in addrs), addrs
    assert "key:" in launcher.output() and (launcher.log_dir / "cluster.key").stat().st_mode & 0o777 == 0o600
    assert launcher.events("decode-0", "node_started")[0]["signed"] is True


def test_nodes_registered_without_the_key_are_refused_and_get_no_request(exposed, tmp_path):
    """A process that can write to Redis but holds no cluster key registers a working decode node
    (unsigned, then signed with another key): the router never routes to it and says so."""
    model, launcher = exposed
    write_new_key(tmp_path / "other.key")
    rogues = [
        NodeProcess(
            "decode", str(model), tmp_path, launcher.redis_url(), ["--heartbeat-interval", "0.2", *extra]
        )
        for extra in ([], ["--cluster-key-file", str(tmp_path / "other.key")])
    ]
    try:
        for rogue in rogues:
            rogue.wait_ready()
        time.sleep(1.5)  # several router polls find the records
        with load_stays_exact(model, launcher):
            pass
        for rogue in rogues:
            assert not rogue.events("request_added"), "a request went to a node without the key"
        log = router_log(launcher)
        node_ids = [json.loads(r.ready_file.read_text())["node_id"] for r in rogues]
        assert f"refused node record {KEY_PREFIX}{node_ids[0]}: unsigned" in log
        assert f"refused node record {KEY_PREFIX}{node_ids[1]}: bad MAC" in log
        assert log.count(": unsigned") <= 5 and log.count(": bad MAC") <= 5  # 5 a window and kind
    finally:
        for rogue in rogues:
            rogue.close()


def test_peers_without_the_key_are_refused_on_every_socket_while_the_cluster_serves(exposed):
    """CURVE under the cluster key: a process without it sends a GenerateRequest to the decode node
    and to the prefill node, offers KV, and pushes token chunks to the router's reply port, all at
    their network addresses. Each is refused at the handshake and logged; none of it is taken."""
    from pdserve.kv_transfer.errors import KVTimeout
    from pdserve.kv_transfer.messages import KVFingerprint
    from pdserve.kv_transfer.sender import KVSender, SenderConfig
    from pdserve.protocol import messages as pm
    from pdserve.protocol.channel import PeerChannel, PushChannel
    from pdserve.protocol.kv_layout import KV_LAYOUT_NAME
    from pdserve.protocol.reasons import FinishReason
    from pdserve.protocol.sampling_params import SamplingParams

    model, launcher = exposed
    decode, prefill = ready(launcher, "decode-0"), ready(launcher, "prefill-0")
    reply_addr = re.search(r"nodes push replies to (\S+)", router_log(launcher)).group(1)
    if network_host() != "0.0.0.0":  # the router's reply port is on the network address too
        assert f"//{network_host()}:" in reply_addr, reply_addr
    opened = []
    with load_stays_exact(model, launcher):
        for addr, request_id in ((decode["control_addr"], "rogue-d"), (prefill["control_addr"], "rogue-p")):
            control = PeerChannel(addr, decoder=pm.decode_frames)
            opened.append(control)
            request = pm.GenerateRequest(
                request_id=request_id,
                token_ids=(5, 6, 7),
                sampling_params=SamplingParams(max_tokens=4),
                reply_addr="tcp://127.0.0.1:1",
                decode_addr=None,
                deadline=time.time() + 30,
            )
            control.send(request)
        push = PushChannel(reply_addr)
        opened.append(push)
        push.send(
            pm.TokenChunk(
                request_id="anything",
                node_id="rogue",
                token_ids=(1,),
                logprobs=(),
                finish_reason=FinishReason.STOP,
                num_prompt_tokens=3,
                num_cached_tokens=0,
            )
        )
        fingerprint = KVFingerprint(
            model_id="rogue",
            dtype="float32",
            block_size=8,
            layout=KV_LAYOUT_NAME,
            num_layers=2,
            num_kv_heads=2,
            head_dim=16,
        )
        sender = KVSender(
            decode["kv_addr"], fingerprint, SenderConfig(grant_timeout_s=1.0, shared_memory=False)
        )
        opened.append(sender)
        with pytest.raises(KVTimeout):
            sender.reserve("rogue-kv", [1, 2, 3], SamplingParams(max_tokens=2))

    # A keyless peer's refusal reads either way, by which side read the mismatch first.
    keyless = ("it does not speak CURVE", "it hung up before the handshake finished")

    def refused(child: str, socket_name: str) -> bool:
        wanted = [f"{socket_name} socket: {reason}" for reason in keyless]
        return any(w in e.get("error", "") for e in launcher.events(child, "peer_refused") for w in wanted)

    # A refused peer may not retry its handshake: knock again with fresh connections until each
    # socket has said it (or 15 s passed).
    deadline = time.monotonic() + 15
    for child, name, addr in (
        ("decode-0", "control", decode["control_addr"]),
        ("decode-0", "kv", decode["kv_addr"]),
        ("prefill-0", "control", prefill["control_addr"]),
    ):
        while not refused(child, name) and time.monotonic() < deadline:
            knock = PeerChannel(addr, decoder=pm.decode_frames)  # connecting starts the handshake
            time.sleep(0.3)
            knock.close()
        assert refused(child, name), (child, name, launcher.events(child, "peer_refused"))

    def reply_refused() -> bool:
        return any(f"refused a peer on the reply socket: {r}" in router_log(launcher) for r in keyless)

    while not reply_refused() and time.monotonic() < deadline:
        knock = PushChannel(reply_addr)
        time.sleep(0.3)
        knock.close()
    assert reply_refused()
    for child in ("decode-0", "prefill-0"):
        taken = {e.get("request_id") for e in launcher.events(child, "request_added")}
        assert not taken & {"rogue-d", "rogue-p"}, taken
    for channel in opened:
        channel.close()


def test_a_captured_signed_record_written_back_is_refused_and_the_node_keeps_serving(exposed):
    """A writer with Redis access but no key keeps writing the decode node's captured record back
    over its newer heartbeats: the router refuses the replays, logs them, and the node keeps its
    place in the pool, taking requests throughout."""
    model, launcher = exposed
    node_id = ready(launcher, "decode-0")["node_id"]
    client = redis.Redis.from_url(launcher.redis_url())
    captured = client.hgetall(KEY_PREFIX + node_id)
    assert b"mac" in captured
    finished_before = len(launcher.events("decode-0", "request_finished"))
    stop = threading.Event()

    def replay() -> None:
        # In step with the node's own beats: a replay is told only against a newer record the
        # router has seen, and a writer blind to the beats can hide them all (the node then looks
        # silent and expires rather than replayed; timed bursts did that under CI's load). So the
        # writer lets three of the node's beats stand (a second or more, two polls at least) and
        # writes the capture back right after the third, where it stays until the next beat.
        fresh_beats, last_stamp = 0, captured[b"heartbeat_time"]
        while not stop.is_set():
            stamp = client.hget(KEY_PREFIX + node_id, "heartbeat_time")
            if stamp is not None and stamp != last_stamp:
                last_stamp = stamp
                fresh_beats += stamp != captured[b"heartbeat_time"]
                if fresh_beats >= 3:
                    client.hset(KEY_PREFIX + node_id, mapping=captured)
                    fresh_beats, last_stamp = 0, captured[b"heartbeat_time"]
            stop.wait(0.01)

    writer = threading.Thread(target=replay, daemon=True)
    writer.start()
    refusal = f"refused node record {KEY_PREFIX}{node_id}: replayed: its heartbeat is"
    try:
        with load_stays_exact(model, launcher):
            deadline = time.monotonic() + 15
            while refusal not in router_log(launcher) and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)  # replays go on a while after the first refusal
    finally:
        stop.set()
        writer.join(5)
        client.close()
    assert refusal in router_log(launcher)
    assert len(launcher.events("decode-0", "request_finished")) >= finished_before + 12
    health = web.get(launcher.url + "/health", timeout=5).json()
    assert health["status"] == "ok", health
