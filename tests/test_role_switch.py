"""Nodes switch roles without a reload (node.host), through the router's
``POST /admin/nodes/{id}/role`` and `pdserve role`, on a `pdserve up` cluster (1 prefill + 2
decode nodes, the tiny model) while a concurrent load runs: mixed lengths, streaming on and off,
logprobs on and off, through prefill->decode and decode-only routes as the roles move.

Ten switches (twenty under `make chaos`): a decode node goes round prefill, colocated and decode; the prefill node goes
to decode and back (the cluster then has no prefill node: every prompt prefills on a decode
node). Every request completes equal to HF greedy, every switch ends drained (none forced), the
router lists each new role by the time it answers, and every block is free at the end.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time

import pytest
import redis

from pdserve.protocol.registry import list_nodes
from tests import web
from tests.cluster import ROOT
from tests.engine_helpers import hf_greedy
from tests.up_launcher import FILLER, Launcher, completion_text, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")

# short prompts prefill on a decode node, long ones go prefill node -> decode node
PROMPTS = [f"Request {i}: {' '.join([FILLER] * (1 + i % 4 // 2)) if i % 2 else 'short'}" for i in range(8)]


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    model = tiny_model_with_tokenizer(default_model_dir, tmp_path_factory.mktemp("model"))
    launcher = Launcher(tmp_path_factory.mktemp("up"), model, "--prefill", "1", "--decode", "2")
    try:
        launcher.wait_up()
        yield model, launcher
    finally:
        launcher.close()


def node_id(launcher: Launcher, child: str) -> str:
    return json.loads((launcher.log_dir / f"{child}.ready.json").read_text())["node_id"]


class Load:
    """Three clients sending requests back to back until stopped, each checked against HF."""

    def __init__(self, model, launcher: Launcher) -> None:
        from pdserve.router.tokenizer import Tokenizer

        tokenizer = Tokenizer(model)
        self.url = launcher.url
        self.expected = {}
        for i, prompt in enumerate(PROMPTS):
            ids = tokenizer.encode(prompt)
            self.expected[i] = tokenizer.decode(hf_greedy(str(model), ids, 3 + i % 4))
        self.stop = threading.Event()
        self.done: list[int] = []
        self.wrong: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(3)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(90)

    def _run(self, k: int) -> None:
        for n in itertools.count(k):
            if self.stop.is_set():
                return
            i = n % len(PROMPTS)
            try:
                text = self._one(i, stream=n % 3 == 0, logprobs=n % 4 == 1)
            except Exception as exc:  # noqa: BLE001  (every failure is a finding)
                self.wrong.append(f"request {n} (prompt {i}): {exc!r}")
                continue
            if text != self.expected[i]:
                self.wrong.append(f"request {n} (prompt {i}): {text!r} != {self.expected[i]!r}")
            self.done.append(n)

    def _one(self, i: int, stream: bool, logprobs: bool) -> str:
        body = {"prompt": PROMPTS[i], "max_tokens": 3 + i % 4, "temperature": 0.0, "ignore_eos": True}
        if logprobs:
            body["logprobs"] = 2
        return completion_text(self.url, body, stream)


def switch(launcher: Launcher, node: str, role: str) -> dict:
    reply = web.post(f"{launcher.url}/admin/nodes/{node}/role", json={"role": role}, timeout=90)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _switches(launcher) -> list[dict]:
    """The cluster's role_switched events so far, in the order they happened."""
    events = [e for child in ("decode-1", "prefill-0") for e in launcher.events(child, "role_switched")]
    return sorted(events, key=lambda e: e["ts"])


def _switch_plan(mover: str, prefill: str, rounds: int) -> list[tuple[str, str]]:
    """Every transition between the three roles for the moving decode node, ``rounds`` times, a
    while with no prefill node, and the mover colocated at the end."""
    plan = [(mover, r) for r in ("prefill", "colocated", "decode", "prefill", "decode", "colocated")] * rounds
    plan += [(prefill, "decode"), (mover, "decode"), (prefill, "prefill")]  # no prefill node a while
    if rounds > 1:
        plan += [(mover, r) for r in ("colocated", "prefill", "decode", "prefill")]
    return plan + [(mover, "colocated")]


# the default suite: each transition once (10 switches); `make chaos`: twenty
@pytest.mark.parametrize("rounds", [1, pytest.param(2, marks=pytest.mark.chaos)])
def test_switches_under_load_lose_nothing_and_leak_no_block(cluster, rounds):
    model, launcher = cluster
    mover, prefill = node_id(launcher, "decode-1"), node_id(launcher, "prefill-0")
    plan = _switch_plan(mover, prefill, rounds)
    assert len(plan) == (10 if rounds == 1 else 20)
    before = len(_switches(launcher))  # the module's cluster may have switched already
    with Load(model, launcher) as load:
        for k, (node, role) in enumerate(plan):
            answer = switch(launcher, node, role)
            assert answer["node_id"] == node and answer["role"] == role, answer
            # the router answers once its own view has the new role
            listed = {
                n["node_id"]: n for n in web.get(launcher.url + "/admin/nodes", timeout=5).json()["nodes"]
            }
            assert listed[node]["role"] == role and not listed[node]["draining"], listed[node]
            time.sleep(0.3 if k % 2 else 0.0)  # some switches right after another, some after traffic
        time.sleep(1.0)
    assert not load.wrong, load.wrong[:5]
    assert len(load.done) >= 2 * len(plan), len(load.done)

    switched = _switches(launcher)[before:]
    assert len(switched) == len(plan) and not any(e["forced"] for e in switched), switched
    client = redis.Redis.from_url(launcher.redis_url())
    deadline = time.monotonic() + 10
    while True:  # idle: every block back in the pool (free or cached) on every node
        nodes = list_nodes(client)
        held = {n.node_id: n.num_blocks_total - n.num_blocks_free for n in nodes}
        if len(nodes) == 3 and not any(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    client.close()
    assert len(nodes) == 3 and not any(held.values()), held
    assert {n.node_id: str(n.role) for n in nodes}[mover] == "colocated"


def test_pdserve_role_switches_a_node_and_refuses_what_it_cannot_do(cluster):
    _, launcher = cluster
    mover = node_id(launcher, "decode-1")

    def pdserve_role(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "pdserve", "role", *args, "--router", launcher.url]
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)

    done = pdserve_role(mover, "prefill")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["role"] == "prefill"
    back = pdserve_role(mover, "decode")
    assert back.returncode == 0 and json.loads(back.stdout)["previous_role"] == "prefill", back.stderr

    missing = pdserve_role("no-such-node", "decode")
    assert missing.returncode == 1 and "404" in missing.stderr and "no-such-node" in missing.stderr
    bad = web.post(f"{launcher.url}/admin/nodes/{mover}/role", json={"role": "router"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "role", bad.text
    extra = web.post(f"{launcher.url}/admin/nodes/{mover}/role", json={"role": "decode", "x": 1}, timeout=10)
    assert extra.status_code == 400 and "x" in extra.json()["error"]["message"], extra.text
