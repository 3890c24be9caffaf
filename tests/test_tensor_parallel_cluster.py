"""Prefill and decode nodes of different tensor-parallel layouts, as real processes with their
worker ranks: P tp ∈ {1, 2} × D tp ∈ {1, 2} on a model with one KV head (replicated on two ranks:
SGLang's decode-ranks-all-on-head-0 case), and in `make chaos` on one with two. Concurrent
mixed-length requests, greedy output and sampled logprobs equal to HF's, a decode-side prefix hit
across layouts with the wire's bytes those of a single-rank pair, every block back afterwards. A
rank killed with SIGKILL takes its node out at once (its record says why, the process exits
non-zero); SIGTERM drains a two-rank node, then stops both ranks. (The colocated node at tp=2 and
the role switch: tests/test_tensor_parallel_up.py.)"""

from __future__ import annotations

import itertools
import os
import signal
import time

import pytest
import torch

from pdserve.engine.config import ModelConfig
from tests.cluster import Client, NodeProcess
from tests.engine_helpers import hf_greedy, hf_logits
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("processes")
KINDS = ["llama3", pytest.param("qwen2", marks=pytest.mark.chaos)]  # one KV head; two (`make chaos`)
EXTRA = ["--block-size", "8", "--num-kv-blocks", "48", "--max-num-batched-tokens", "32"]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "logprobs": 1}


class Nodes:
    """Per model kind, a prefill and a decode node at tp 1 and 2, started together the first time
    a test asks for the kind (the `make chaos` kinds only where they run)."""

    LAYOUTS = [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)]

    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.procs: dict[tuple[str, str, int], NodeProcess] = {}
        self.addrs: dict[tuple[str, str, int], dict] = {}

    def __call__(self, kind: str, role: str, tp: int) -> dict:
        if (kind, role, tp) not in self.addrs:
            started = {
                (kind, r, t): NodeProcess(
                    r, str(make_tiny_model(kind)), self.tmp, None, [*EXTRA, "--tensor-parallel-size", str(t)]
                )
                for r, t in self.LAYOUTS
            }
            self.procs.update(started)
            self.addrs.update({key: p.wait_ready(timeout_s=180) for key, p in started.items()})
        return self.addrs[(kind, role, tp)]

    def close(self) -> None:
        for p in self.procs.values():
            p.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    started = Nodes(tmp_path_factory.mktemp("tp"))
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def client():
    c = Client()
    yield c
    c.close()


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (24,), generator=g).tolist()
    return [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (13, 1, 30)] + [[5, 9, 11]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("p", "d"), list(itertools.product((1, 2), (1, 2))))
def test_prefill_and_decode_layouts_pair_exactly(kind, p, d, nodes, client):
    model = str(make_tiny_model(kind))
    prefill, decode = nodes(kind, "prefill", p), nodes(kind, "decode", d)
    assert client.status(prefill)["tp_size"] == p and client.status(decode)["tp_size"] == d
    prompts = _prompts(p * 10 + d)
    ids = [f"{kind}-{p}{d}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):  # all at once: the nodes batch them
        client.generate(prefill, rid, prompt, {**GREEDY, "max_tokens": 8}, decode=decode)
    results = client.collect(ids)
    for rid, prompt in zip(ids, prompts, strict=True):
        r = results[rid]
        assert r["failed"] is None and r["finish"] == "length", r["failed"]
        assert r["tokens"] == hf_greedy(model, prompt, 8), rid
    # the decode node's logprobs of the tokens it sampled, from KV another layout computed
    prompt, r = prompts[2], results[ids[2]]
    expected = torch.log_softmax(hf_logits(model, prompt + r["tokens"]), dim=-1)
    chunks = [msg for _, msg in r["chunks"] if not msg.is_first]
    got = [lp.logprob for msg in chunks for lp in msg.logprobs]
    want = [float(expected[len(prompt) + i, t]) for i, t in enumerate(r["tokens"][1:])]
    assert got == pytest.approx(want, abs=1e-4)
    for node in (prefill, decode):
        info = client.wait_idle(node)
        assert info["num_blocks_free"] == info["num_blocks_total"], info


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_a_repeated_prompt_hits_the_decode_nodes_prefix_cache_across_layouts(p, d, nodes, client):
    model = str(make_tiny_model("llama3"))
    prefill, decode = nodes("llama3", "prefill", p), nodes("llama3", "decode", d)
    prompt = [(11 * i) % 240 + 3 for i in range(40)]  # five full blocks of 8
    for n in range(2):
        rid = f"hit-{p}{d}-{n}"
        client.generate(prefill, rid, prompt, {**GREEDY, "max_tokens": 6}, decode=decode)
        r = client.collect([rid])[rid]
        assert r["failed"] is None and r["tokens"] == hf_greedy(model, prompt, 6)
    shipped = {e["request_id"]: e for e in nodes.procs[("llama3", "prefill", p)].events("kv_shipped")}
    first, second = shipped[f"hit-{p}{d}-0"], shipped[f"hit-{p}{d}-1"]
    assert first["blocks_reused"] == 0 and second["blocks_reused"] >= 4  # D held the prefix: P skipped it
    # the wire carries the model's heads once, whatever the layouts: a single-rank pair's bytes
    cfg = ModelConfig.from_path(model)
    per_block = 2 * cfg.num_layers * 8 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
    assert first["bytes"] == first["blocks_sent"] * per_block and first["blocks_sent"] >= 5


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_aborts_during_transfer_and_decode_across_layouts_free_every_block(p, d, nodes, client):
    model = str(make_tiny_model("llama3"))
    prefill, decode = nodes("llama3", "prefill", p), nodes("llama3", "decode", d)
    prompts = [[(13 * i + k) % 240 + 3 for i in range(40)] for k in range(3)]
    ids = [f"abort-{p}{d}-{k}" for k in range(3)]
    for rid, prompt in zip(ids, prompts, strict=True):
        client.generate(prefill, rid, prompt, {**GREEDY, "max_tokens": 200}, decode=decode)
    time.sleep(0.05)  # some in their transfer, some decoding
    for rid in ids:
        client.abort(prefill, rid)
        client.abort(decode, rid)
    for node in (prefill, decode):
        info = client.wait_idle(node, timeout_s=30)
        assert info["num_blocks_free"] == info["num_blocks_total"], info
    client.generate(prefill, f"after-{p}{d}", prompts[0], {**GREEDY, "max_tokens": 6}, decode=decode)
    r = client.collect([f"after-{p}{d}"])[f"after-{p}{d}"]  # both nodes serve on
    assert r["failed"] is None and r["tokens"] == hf_greedy(model, prompts[0], 6)


def test_a_decode_rank_killed_mid_decode_ends_its_node_at_once(nodes, client, tmp_path):
    """The node, not the request, is what this checks: the router's retry and migration of a
    dead node's requests are the whole-node kill's (tests/chaos)."""
    model = str(make_tiny_model("llama3"))
    victim = NodeProcess("decode", model, tmp_path, None, [*EXTRA, "--tensor-parallel-size", "2"])
    try:
        decode = victim.wait_ready(timeout_s=120)
        prefill = nodes("llama3", "prefill", 2)
        for i in range(2):
            prompt = _prompts(40 + i)[0][:12]  # 12 + 160 tokens: 22 of the 48 blocks each
            client.generate(prefill, f"kill-{i}", prompt, {**GREEDY, "max_tokens": 160}, decode=decode)
        deadline = time.monotonic() + 30
        while client.status(decode)["num_running"] < 2:  # both decoding there: their KV has landed
            assert time.monotonic() < deadline, client.status(decode)
            time.sleep(0.05)
        os.kill(_worker_pid(victim.proc.pid), signal.SIGKILL)
        assert victim.proc.wait(timeout=30) != 0  # the node went, not serving on one rank
        (fatal,) = victim.events("integrity_failed")
        assert "rank 1 exited (-9)" in fatal["error"]
        assert not any(
            b"pdserve.engine.executor.worker" in _cmdline(pid) for pid in _children(victim.proc.pid)
        )
        info = client.wait_idle(prefill)  # the prefill node holds nothing for the dead node
        assert info["num_blocks_free"] == info["num_blocks_total"], info
    finally:
        victim.close()


def test_sigterm_drains_a_tp_node_then_stops_every_rank(nodes, client, tmp_path):
    model = str(make_tiny_model("llama3"))
    node = NodeProcess("decode", model, tmp_path, None, [*EXTRA, "--tensor-parallel-size", "2"])
    try:
        decode = node.wait_ready(timeout_s=120)
        worker = _worker_pid(node.proc.pid)
        prefill = nodes("llama3", "prefill", 1)
        prompts = [p[:12] for p in _prompts(60)[:2]]
        ids = [f"term-{i}" for i in range(2)]
        for rid, prompt in zip(ids, prompts, strict=True):
            client.generate(prefill, rid, prompt, {**GREEDY, "max_tokens": 60}, decode=decode)
        deadline = time.monotonic() + 30
        while client.status(decode)["num_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        node.proc.send_signal(signal.SIGTERM)
        results = client.collect(ids)  # drained: each runs to its end
        for rid, prompt in zip(ids, prompts, strict=True):
            assert results[rid]["failed"] is None and results[rid]["tokens"] == hf_greedy(model, prompt, 60)
        assert node.proc.wait(timeout=60) == 0
        assert not _cmdline(worker)  # the worker rank stopped with its node (gone, or reaped)
    finally:
        node.close()


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def _children(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(entry))
    return out


def _worker_pid(node_pid: int) -> int:
    """The node's one worker rank: its child running pdserve.engine.executor.worker."""
    (pid,) = [pid for pid in _children(node_pid) if b"pdserve.engine.executor.worker" in _cmdline(pid)]
    return pid
