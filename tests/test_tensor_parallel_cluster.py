"""Prefill and decode nodes of different tensor-parallel layouts, as real processes with their
worker ranks: P tp ∈ {1, 2} × D tp ∈ {1, 2}, and a colocated node at tp=2, on a model with one KV
head (replicated on two ranks: SGLang's decode-ranks-all-on-head-0 case) and on one with two.
Concurrent mixed-length requests, greedy output and sampled logprobs equal to HF's, a decode-side
prefix hit across layouts, every block back afterwards. A rank killed with SIGKILL takes its
node out: its record says why, and the node process exits non-zero."""

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
KINDS = ["llama3", "qwen2"]  # one KV head; two
EXTRA = ["--block-size", "8", "--num-kv-blocks", "48", "--max-num-batched-tokens", "32"]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "logprobs": 1}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """(kind, role, tp) -> node addresses; every node starts at once so their start-ups overlap."""
    tmp = tmp_path_factory.mktemp("tp")
    layouts = [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)]
    procs = {
        (kind, role, tp): NodeProcess(
            role, str(make_tiny_model(kind)), tmp, None, [*EXTRA, "--tensor-parallel-size", str(tp)]
        )
        for kind in KINDS
        for role, tp in layouts
    }
    try:
        yield {key: p.wait_ready(timeout_s=180) for key, p in procs.items()}, procs
    finally:
        for p in procs.values():
            p.close()


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
    addrs, _ = nodes
    model = str(make_tiny_model(kind))
    prefill, decode = addrs[(kind, "prefill", p)], addrs[(kind, "decode", d)]
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
    addrs, _ = nodes
    model = str(make_tiny_model("llama3"))
    prefill, decode = addrs[("llama3", "prefill", p)], addrs[("llama3", "decode", d)]
    prompt = [(11 * i) % 240 + 3 for i in range(40)]  # five full blocks of 8
    for n in range(2):
        rid = f"hit-{p}{d}-{n}"
        client.generate(prefill, rid, prompt, {**GREEDY, "max_tokens": 6}, decode=decode)
        r = client.collect([rid])[rid]
        assert r["failed"] is None and r["tokens"] == hf_greedy(model, prompt, 6)
    shipped = {e["request_id"]: e for e in nodes[1][("llama3", "prefill", p)].events("kv_shipped")}
    first, second = shipped[f"hit-{p}{d}-0"], shipped[f"hit-{p}{d}-1"]
    assert first["blocks_reused"] == 0 and second["blocks_reused"] >= 4  # D held the prefix: P skipped it
    # the wire carries the model's heads once, whatever the layouts: a single-rank pair's bytes
    cfg = ModelConfig.from_path(model)
    per_block = 2 * cfg.num_layers * 8 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
    assert first["bytes"] == first["blocks_sent"] * per_block and first["blocks_sent"] >= 5


def test_a_decode_rank_killed_mid_decode_ends_its_node_at_once(nodes, client, tmp_path):
    """The node, not the request, is what this checks: the router's retry and migration of a
    dead node's requests are the whole-node kill's (tests/chaos)."""
    addrs, _ = nodes
    model = str(make_tiny_model("qwen2"))
    victim = NodeProcess("decode", model, tmp_path, None, [*EXTRA, "--tensor-parallel-size", "2"])
    try:
        decode = victim.wait_ready(timeout_s=120)
        prefill = addrs[("qwen2", "prefill", 2)]
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
        assert not any(b"pdserve.engine.worker" in _cmdline(pid) for pid in _children(victim.proc.pid))
        info = client.wait_idle(prefill)  # the prefill node holds nothing for the dead node
        assert info["num_blocks_free"] == info["num_blocks_total"], info
    finally:
        victim.close()


def test_sigterm_drains_a_tp_node_then_stops_every_rank(nodes, client, tmp_path):
    addrs, _ = nodes
    model = str(make_tiny_model("qwen2"))
    node = NodeProcess("decode", model, tmp_path, None, [*EXTRA, "--tensor-parallel-size", "2"])
    try:
        decode = node.wait_ready(timeout_s=120)
        worker = _worker_pid(node.proc.pid)
        prefill = addrs[("qwen2", "prefill", 1)]
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
    """The node's one worker rank: its child running pdserve.engine.worker."""
    (pid,) = [pid for pid in _children(node_pid) if b"pdserve.engine.worker" in _cmdline(pid)]
    return pid
