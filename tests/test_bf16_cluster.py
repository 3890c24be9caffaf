"""bfloat16 nodes end to end: a prefill node's bf16 KV blocks over ZeroMQ to a bf16 decode node,
beside requests the decode node prefills itself, all at once, through routers (streamed and
whole, with logprobs). bf16 cannot equal fp32 HF token for token, so each token must be
near-greedy under fp32 HF on the sequence the nodes produced."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import pytest
import torch

from tests import web
from tests.cluster import Client, NodeProcess, RedisServer
from tests.engine_helpers import hf_logits
from tests.test_router_cluster import RouterProcess, serving, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def routed(tmp_path_factory, default_model_dir):
    """bf16 nodes behind two routers on the same pair: one that disaggregates, one that never does."""
    tmp = tmp_path_factory.mktemp("bf16-routed")
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)
    redis = RedisServer(tmp)
    extra = ["--dtype", "bfloat16", "--num-kv-blocks", "256", "--heartbeat-interval", "0.2"]
    nodes = [NodeProcess(role, str(model), tmp, redis.url, extra) for role in ("prefill", "decode")]
    routers = {
        "pd": RouterProcess(model, redis.url, tmp),
        "decode_only": RouterProcess(model, redis.url, tmp, "--disagg-threshold", "100000"),
    }
    with serving(redis, nodes, routers.values()):
        yield model, routers, nodes


def _served(router, model, prompt: list[int], stream: bool) -> tuple[list[int], list[float]]:
    body = {
        "model": model.name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    if stream:
        parts = []
        with web.stream(
            "POST", router.url + "/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"]
                    if choice and choice[0]["logprobs"]:
                        parts.append(choice[0]["logprobs"])
        tokens = [t for p in parts for t in p["tokens"]]
        values = [v for p in parts for v in p["token_logprobs"]]
    else:
        reply = web.post(router.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        logprobs = reply.json()["choices"][0]["logprobs"]
        tokens, values = logprobs["tokens"], logprobs["token_logprobs"]
    return [int(t.removeprefix("token_id:")) for t in tokens], values


def test_bf16_through_the_router_streamed_and_whole_on_both_paths_track_fp32_hf(routed):
    """bf16 prefill -> decode and decode-only, through routers, streamed and whole: near-greedy
    under fp32 HF, the logprobs the client sees are HF's, and every block is free after."""
    model, routers, nodes = routed
    g = torch.Generator().manual_seed(12)
    lengths = [200, 30, 150, 90, 12, 260, 75, 120]  # the default threshold sends >= 64 tokens to prefill
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    jobs = [(path, stream, p) for path in routers for stream in (False, True) for p in prompts[:4]]
    jobs += [
        (path, stream, p) for path, stream in (("pd", True), ("decode_only", False)) for p in prompts[4:]
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _served(routers[job[0]], model, job[2], job[1]), jobs))
    for (path, stream, prompt), (tokens, values) in zip(jobs, got, strict=True):
        where = f"{path} stream={stream} prompt of {len(prompt)}"
        assert len(tokens) == len(values) == MAX_TOKENS, where
        logprobs = torch.log_softmax(hf_logits(str(model), prompt + tokens)[len(prompt) - 1 : -1], dim=-1)
        chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (logprobs.max(dim=-1).values - chosen).max().item() < 0.1, where  # near-greedy under fp32
        assert values == pytest.approx(chosen.tolist(), abs=0.1), where  # the logprobs the client sees
    routes = web.get(routers["pd"].url + "/metrics", timeout=10).text
    assert 'pdserve_routes_total{prefill="prefill_node"}' in routes  # bf16 KV blocks did cross over
    client = Client()
    try:
        for node in nodes:
            info = client.wait_idle(node.addrs)
            assert info["num_blocks_free"] == info["num_blocks_total"], (node.role, info)
    finally:
        client.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, default_model_dir):
    """A bfloat16 prefill node and a float32 decode node, both with int8 KV caches: the caches'
    format is the same, what the models wrote in them is not (KVFingerprint.compute_dtype)."""
    tmp = tmp_path_factory.mktemp("bf16-mixed")
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)
    redis = RedisServer(tmp)
    extra = ["--kv-cache-dtype", "int8", "--num-kv-blocks", "256", "--heartbeat-interval", "0.2"]
    nodes = [
        NodeProcess("prefill", str(model), tmp, redis.url, [*extra, "--dtype", "bfloat16"]),
        NodeProcess("decode", str(model), tmp, redis.url, [*extra, "--dtype", "float32"]),
    ]
    router = RouterProcess(model, redis.url, tmp)
    try:
        addrs = [n.wait_ready() for n in nodes]
        deadline = time.monotonic() + 60
        while _health(router).get("status") != "decode_only":  # never "ok": no pair
            assert time.monotonic() < deadline, router.log_path.read_text()
            time.sleep(0.2)
        yield model, router, addrs
    finally:
        for process in [router, *nodes]:
            process.close()
        redis.stop()


def _health(router) -> dict:
    try:
        return web.get(router.url + "/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}


def test_nodes_of_different_dtypes_are_never_paired_and_say_why(mixed):
    from pdserve.kv_transfer.errors import KVRejected
    from pdserve.kv_transfer.messages import KVFingerprint
    from pdserve.kv_transfer.sender import KVSender, SenderConfig
    from pdserve.protocol.messages import RequestMeta
    from pdserve.protocol.sampling_params import SamplingParams

    model, router, (prefill, decode) = mixed
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (120, 300, 90, 200, 150, 260)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # long prompts: PD if a pair existed
        served = list(pool.map(lambda i: _served(router, model, prompts[i], stream=i % 2 == 0), range(6)))
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in served)
    metrics = web.get(router.url + "/metrics", timeout=10).text
    assert 'pdserve_routes_total{prefill="prefill_node"}' not in metrics
    assert 'pdserve_routes_total{prefill="no_prefill_node"} 6.0' in metrics
    assert re.search(r"differs in compute_dtype \('(bfloat16|float32)'", router.log_path.read_text())
    client = Client()
    try:  # a prefill node's reservation is refused by name, should anything send one
        mine = KVFingerprint(**client.status(prefill)["fingerprint"])
        assert (mine.dtype, mine.compute_dtype) == ("int8", "bfloat16")
        sender = KVSender(decode["kv_addr"], mine, SenderConfig(shared_memory=False))
        meta = RequestMeta(reply_addr=client.reply_addr, deadline=time.time() + 30, shipped_at=time.time())
        with pytest.raises(KVRejected) as refused:
            sender.reserve("x", prompts[0], SamplingParams(max_tokens=2), meta)
        assert refused.value.field == "compute_dtype"
        sender.close()
    finally:
        client.close()
