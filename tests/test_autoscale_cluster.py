"""`pdserve up --autoscale` on real processes: the tiny model, a Redis registry, a node budget of
two (this machine's cores at one thread each), and an open-loop load that shifts from
prefill-heavy to decode-heavy and back, then goes light, then heavy again.

The controller decides with a hand-made profile (a 5 ms/token prefill, 20-24 ms decode steps),
taken as it is (--autoscale-trust-profile: the prefill scales fitted to the measured TTFT are
reported, not used), so its choices
follow the load's shape and not this machine's speed, while the nodes serve the
load for real. The router sends every prompt over 16 tokens to a prefill node and never has a
decode node prefill for a backed-up one, so 1P+1D is pure disaggregation, and the model's
answers are clear-cut:
- prefill-heavy (~100-token prompts, 1 token out, 2 req/s): two colocated nodes prefill twice
  as fast as one prefill node;
- decode-heavy (1 req/s, 40 tokens out): 1P+1D keeps prefills off the decoding node (TPOT 25 ms);
- light (short prompts, 1 token out): one colocated node meets the targets.

So the pools go 1P+1D -> 2 colocated -> 1P+1D -> 2 colocated (role switches), -> 1 colocated
(a node stops by draining) -> 2 (a node starts). Every request is checked against HF greedy,
none may fail, each change is in autoscale.log and on /metrics with its reason, and no block is
held at the end.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import random
import re
import threading
import time

import pytest
import redis

from pdserve.planner.profile import DecodeStepGrid, PiecewiseLinear, Profile, TransferModel
from pdserve.protocol.registry import list_nodes
from pdserve.router.tokenizer import Tokenizer
from tests import web
from tests.engine_helpers import hf_greedy
from tests.up_launcher import FILLER, Launcher, completion_text, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")

PROFILE = Profile(
    model="tiny",
    threads=1,
    kv_bytes_per_token=1000,
    max_num_batched_tokens=2048,
    max_num_seqs=64,
    prefill=PiecewiseLinear((1.0, 1000.0), (0.005, 5.0)),
    decode=DecodeStepGrid((1.0, 16.0), (1.0, 1000.0), ((0.020, 0.022), (0.021, 0.024))),
    transfer=TransferModel(0.005, 0.0),
)
FLAGS = (
    "--autoscale",
    "--prefill", "1", "--decode", "1",  # its default start is 2 colocated (pdserve.cli.up_slo.start_shape)
    "--min-nodes", "1",  # by default it keeps the nodes it starts with
    "--ttft-slo-s", "3",
    "--tpot-slo-s", "0.025",
    "--autoscale-interval", "1.5",
    "--autoscale-cooldown", "3",
    "--autoscale-trust-profile",  # the hand-made profile decides, not this machine's speed
    "--router-args", "--disagg-threshold 16 --local-prefill-margin-s 100",
)  # fmt: skip
WORDS = FILLER.split()


def prompt(k: int, words: int) -> str:
    return f"Request {k}: " + " ".join(WORDS[(k + i) % len(WORDS)] for i in range(words))


# (rate req/s, prompts, max_tokens): 6 distinct prompts per phase, each checked against HF
PHASES = {
    "prefill-heavy": (2.0, [prompt(k, 36) for k in range(6)], 1),
    "decode-heavy": (1.0, [prompt(k, 30) for k in range(6, 12)], 40),
    "light": (1.5, [prompt(k, 2) for k in range(12, 18)], 1),
}


class OpenLoad:
    """Requests sent at the current phase's rate whatever the cluster's speed (Poisson, seeded),
    streaming and logprobs on and off; each answer is compared with HF greedy."""

    def __init__(self, model, url: str) -> None:
        tokenizer = Tokenizer(model)
        self.url = url
        self.expected = {
            (text, max_tokens): tokenizer.decode(hf_greedy(str(model), tokenizer.encode(text), max_tokens))
            for _, prompts, max_tokens in PHASES.values()
            for text in prompts
        }
        self.lengths = {text: len(tokenizer.encode(text)) for text, _ in self.expected}
        self.phase = "prefill-heavy"
        self.stop = threading.Event()
        self.done: list[tuple[float, str]] = []  # (finish time, phase)
        self.wrong: list[str] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(24)
        self._thread = threading.Thread(target=self._send, daemon=True)

    def __enter__(self) -> OpenLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join(10)
        self._pool.shutdown(wait=True)

    def _send(self) -> None:
        rng = random.Random(0)
        for n in itertools.count():
            rate, prompts, max_tokens = PHASES[self.phase]
            if self.stop.wait(rng.expovariate(rate)):
                return
            self._pool.submit(self._one, n, self.phase, prompts[n % len(prompts)], max_tokens)

    def _one(self, n: int, phase: str, text: str, max_tokens: int) -> None:
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        if n % 4 == 1:
            body["logprobs"] = 2
        try:
            got = completion_text(self.url, body, stream=n % 3 == 0)
        except Exception as exc:  # noqa: BLE001  (every failure is a finding)
            self.wrong.append(f"request {n} ({phase}): {exc!r}")
            return
        if got != self.expected[(text, max_tokens)]:
            self.wrong.append(f"request {n} ({phase}): {got!r} != {self.expected[(text, max_tokens)]!r}")
        self.done.append((time.time(), phase))


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    model = tiny_model_with_tokenizer(default_model_dir, tmp_path_factory.mktemp("model"))
    tmp = tmp_path_factory.mktemp("up")
    PROFILE.save(tmp / "profile.json")
    launcher = Launcher(tmp, model, *FLAGS, "--autoscale-profile", str(tmp / "profile.json"))
    try:
        launcher.wait_up()
        yield model, launcher
    finally:
        launcher.close()


def roles(launcher: Launcher) -> list[str]:
    nodes = web.get(launcher.url + "/admin/nodes", timeout=5).json()["nodes"]
    return sorted(n["role"] for n in nodes if not n["draining"])


def until_shape(launcher: Launcher, load: OpenLoad, want: list[str], timeout_s: float = 60.0) -> float:
    """Seconds until the router lists exactly ``want`` (roles, sorted) as the load runs."""
    start = time.monotonic()
    while roles(launcher) != want:
        assert not load.wrong, load.wrong[:5]
        assert time.monotonic() - start < timeout_s, (
            f"still {roles(launcher)} after {timeout_s:.0f} s of {load.phase}, wanted {want}; "
            f"decisions:\n{decisions_text(launcher)[-3000:]}"
        )
        time.sleep(0.25)
    return time.monotonic() - start


def decisions_text(launcher: Launcher) -> str:
    path = launcher.log_dir / "autoscale.log"
    return path.read_text() if path.exists() else "(no autoscale.log)"


@pytest.mark.chaos  # a shifting load over five phases: about 100 s, so `make chaos`, not every run
def test_the_pools_follow_a_load_that_shifts_and_no_request_is_lost(cluster):
    model, launcher = cluster
    assert roles(launcher) == ["decode", "prefill"]
    steps = [
        ("prefill-heavy", ["colocated", "colocated"]),
        ("decode-heavy", ["decode", "prefill"]),
        ("prefill-heavy", ["colocated", "colocated"]),
        ("light", ["colocated"]),
        ("prefill-heavy", ["colocated", "colocated"]),
    ]
    took = []
    with OpenLoad(model, launcher.url) as load:
        # the phases' prompts are as long as the test says they are, in the model's tokens
        assert 90 <= min(load.lengths[p] for p in PHASES["prefill-heavy"][1])
        assert max(load.lengths[p] for p in PHASES["light"][1]) < 16
        for phase, want in steps:
            load.phase = phase
            took.append(round(until_shape(launcher, load, want), 1))
        load.phase = "light"
        time.sleep(2.0)  # requests in flight at the last change finish under the new shape
    assert not load.wrong, load.wrong[:5]
    assert len(load.done) >= 60, len(load.done)

    log = [json.loads(line) for line in decisions_text(launcher).splitlines()]
    moved = [r for r in log if r["event"] == "moved"]
    assert not [r for r in log if r["event"] in ("move_failed", "scrape_failed", "report_failed")], log
    assert sum(m["action"] == "switch" for m in moved) == 6, (took, moved)
    assert [m["action"] for m in moved if m["action"] != "switch"] == ["stop", "start"], moved
    assert moved[-1]["node"] == "colocated-0" and moved[-1]["role"] == "colocated", moved  # a new child
    scaled = [r for r in log if r["event"] == "decision" and r["kind"] == "scale"]
    assert [r["target"] for r in scaled] == [
        "2 colocated", "1P+1D", "2 colocated", "1 colocated", "2 colocated"
    ], scaled  # fmt: skip
    assert all("predicted" in r["reason"] and "req/s" in r["reason"] for r in scaled), scaled
    assert any(r["kind"] in ("confirming", "cooldown") for r in log if r["event"] == "decision")

    reported = web.get(launcher.url + "/admin/autoscale", timeout=5).json()["decisions"]
    assert [d["target"] for d in reported if d["kind"] == "scale"] == [r["target"] for r in scaled]
    scrape = web.get(launcher.url + "/metrics", timeout=5).text
    assert 'pdserve_autoscale_decisions_total{kind="scale"} 5.0' in scrape
    assert 'pdserve_autoscale_target_nodes{role="colocated"} 2.0' in scrape
    # The windows measured TTFTs of milliseconds where the profile says 0.5 s for these prompts:
    # both families' prefill scales fell to its floor's side on the loads they ran (reported; the
    # profile decides)
    decisions = [r for r in log if r["event"] == "decision"]
    for family in ("colocated", "disaggregated"):
        assert min(r["prefill_scale"][family] for r in decisions) < 0.7, [
            r["prefill_scale"] for r in decisions
        ]
    assert any("fit(s) near this load" in r["reason"] for r in decisions)
    last = decisions[-1]["prefill_scale"]
    for family, scale in last.items():
        assert f'pdserve_autoscale_prefill_scale{{family="{family}"}} {scale}' in scrape

    client = redis.Redis.from_url(launcher.redis_url())
    deadline = time.monotonic() + 10
    while True:  # idle: every block back in the pool (free or cached) on both nodes
        nodes = list_nodes(client)
        held = {n.node_id: n.num_blocks_total - n.num_blocks_free for n in nodes}
        if len(nodes) == 2 and not any(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    client.close()
    assert len(nodes) == 2 and not any(held.values()), held
    # --tpot-slo-s 0.025 gave every node, the one started late too, a decode-step target of 0.8 of it
    assert [n.step_target_s for n in nodes] == [pytest.approx(0.02)] * 2, nodes
    assert "autoscale: 1P+1D -> 2 colocated" in launcher.output()


def test_bare_autoscale_calibrates_starts_two_colocated_and_keeps_them_under_load(
    default_model_dir, tmp_path
):
    """`pdserve up --autoscale` with nothing else, as a newcomer types it (the nodes' own pool
    sizes too): it calibrates the planner's profile at launch, starts two colocated nodes (its
    default SLOs: TTFT 4 s, TPOT 0.25 s), serves a concurrent mix of lengths, streaming and
    logprobs exactly, decides every 5 s, reported on /metrics, and keeps its two nodes (the floor
    defaults to them) with no block held after."""
    model = tiny_model_with_tokenizer(default_model_dir, tmp_path / "model")
    (tmp_path / "up").mkdir()
    launcher = Launcher(tmp_path / "up", model, "--autoscale", node_args="")
    tokenizer = Tokenizer(model)
    cases = [(prompt(k, words), max_tokens) for k, (words, max_tokens) in enumerate(
        [(2, 12), (60, 3), (30, 24), (8, 1), (45, 16), (14, 8), (70, 6), (20, 20)] * 2
    )]  # fmt: skip
    expected = {c: tokenizer.decode(hf_greedy(str(model), tokenizer.encode(c[0]), c[1])) for c in set(cases)}

    def one(n: int) -> str:
        text, max_tokens = cases[n]
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        if n % 4 == 1:
            body["logprobs"] = 2
        return completion_text(launcher.url, body, stream=n % 2 == 0)

    try:
        launcher.wait_up(timeout_s=240)  # calibration first: a few seconds on the tiny model
        assert "calibrating the engine for the planner" in launcher.output()
        assert roles(launcher) == ["colocated", "colocated"]
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(one, range(len(cases))))
        assert got == [expected[c] for c in cases]
        deadline = time.monotonic() + 30  # a decision every 5 s, its window the load's
        while not (decided := web.get(launcher.url + "/admin/autoscale", timeout=5).json()["decisions"]):
            assert time.monotonic() < deadline, f"no decision reported:\n{decisions_text(launcher)[-2000:]}"
            time.sleep(0.5)
        assert all(sum(d["target_nodes"].values()) == 2 for d in decided), decided  # never below the floor
        scrape = web.get(launcher.url + "/metrics", timeout=5).text
        counted = re.findall(r'^pdserve_autoscale_decisions_total\{kind="\w+"\} (\S+)$', scrape, re.M)
        assert sum(map(float, counted)) >= len(decided), scrape
        log = [json.loads(line) for line in decisions_text(launcher).splitlines()]
        assert not [r for r in log if r["event"] in ("move_failed", "scrape_failed", "report_failed")], log
        client = redis.Redis.from_url(launcher.redis_url())
        deadline = time.monotonic() + 10
        while any(n.num_blocks_total != n.num_blocks_free for n in list_nodes(client)):
            assert time.monotonic() < deadline, list_nodes(client)
            time.sleep(0.2)
        nodes = list_nodes(client)
        client.close()
        assert len(nodes) == 2, nodes
    finally:
        launcher.close()
