"""`make compose-test`'s rogue-peer phase: a container on the compose network with the project's
image but without the secrets volume writes to Redis, sends a GenerateRequest to a decode node,
offers it KV and pushes token chunks to the router while a round of requests runs. Each attempt
must be refused and logged, and the round unharmed."""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import TYPE_CHECKING

from scripts import compose_engine as ce
from scripts.compose_traffic import all_clean_ok

if TYPE_CHECKING:
    from scripts.compose_test import Harness

# Run in the rogue container (the project's image, no secrets): each attempt, and how it ended.
ROGUE = r"""
import json, sys, time
import redis
from pdserve.kv_transfer.errors import KVTimeout
from pdserve.kv_transfer.messages import KVFingerprint
from pdserve.kv_transfer.sender import KVSender, SenderConfig
from pdserve.protocol import messages as pm
from pdserve.protocol.channel import PeerChannel, PushChannel
from pdserve.protocol.kv_layout import KV_LAYOUT_NAME
from pdserve.protocol.reasons import FinishReason
from pdserve.protocol.sampling_params import SamplingParams
decode, reply = sys.argv[1], sys.argv[2]
out = {}
try:
    redis.Redis(host="redis", socket_timeout=3).hset("pdserve:node:rogue", "role", '"decode"')
    out["redis"] = "written"
except redis.exceptions.RedisError as exc:
    out["redis"] = f"refused: {exc}"
control = PeerChannel(f"tcp://{decode}:7000", decoder=pm.decode_frames)
control.send(pm.GenerateRequest(request_id="rogue-1", token_ids=(5, 6, 7), sampling_params=SamplingParams(max_tokens=4),
                                 reply_addr=reply, decode_addr=None, deadline=time.time() + 30))
push = PushChannel(reply)
push.send(pm.TokenChunk(request_id="rogue-chunk", node_id="rogue", token_ids=(1,), logprobs=(), finish_reason=FinishReason.STOP,
                        num_prompt_tokens=3, num_cached_tokens=0))
time.sleep(2.0)  # each socket keeps trying its handshake meanwhile
sender = KVSender(f"tcp://{decode}:7001", KVFingerprint(model_id="rogue", dtype="float32", block_size=16, layout=KV_LAYOUT_NAME,
                                                                  num_layers=30, num_kv_heads=3, head_dim=64),
                  SenderConfig(grant_timeout_s=3.0, shared_memory=False))
try:
    sender.reserve("rogue-kv", [1, 2, 3], SamplingParams(max_tokens=2))
    out["kv"] = "granted"
except KVTimeout:
    out["kv"] = "no answer"
time.sleep(1.0)
print(json.dumps(out))
"""


def phase_rogue(h: Harness) -> None:
    start, wall = time.monotonic(), time.time()
    (decode, *_) = h.project.containers("decode")
    (router,) = h.project.containers("router")
    reply = re.search(r"nodes push replies to (tcp://\S+)", h.project.logs_since(router, 0)).group(1)
    load = h.load(h.args.num_requests)
    hostname = ce.docker("inspect", "-f", "{{.Config.Hostname}}", decode).strip()
    rogue = ce.docker(
        "run",
        "--rm",
        "--network",
        f"{h.project.name}_default",
        "--entrypoint",
        "python",
        "pdserve:local",
        "-c",
        ROGUE,
        hostname,
        reply,
        timeout_s=120,
    )
    results = load.results()
    said = json.loads(rogue.strip().splitlines()[-1])

    def refused(container: str, socket_name: str) -> bool:
        return f"refused a peer on the {socket_name} socket" in h.project.logs_since(container, wall)

    with contextlib.suppress(RuntimeError):  # the checks below say which one is missing
        ce.wait_for(
            "the refusals in the logs",
            lambda: refused(router, "reply") and refused(decode, "kv") and refused(decode, "control"),
            15,
        )
    phase = h.record(
        "rogue peer (no secrets)",
        results,
        start,
        all_ok=all_clean_ok(results),
        redis_refused=said["redis"].startswith("refused"),
        kv_offer_unanswered=said["kv"] == "no answer",
        control_refused_and_logged=refused(decode, "control"),
        kv_refused_and_logged=refused(decode, "kv"),
        reply_refused_and_logged=refused(router, "reply"),
        no_rogue_request_taken='"request_id": "rogue-1"' not in h.project.logs_since(decode, wall),
    )
    phase.notes.append(f"redis: {said['redis'][:40]}; kv: {said['kv']}")
