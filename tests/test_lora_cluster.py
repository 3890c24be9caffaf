"""Multi-LoRA end to end: real node processes with ``--enable-lora``, real Redis, real routers.

One Redis database holds a prefill and a decode node, served by a router that disaggregates every
prompt of 8 tokens or more ("pd") and one that never does ("decode_only"); a second database holds
a colocated node and its own router ("colocated"). Every router knows three PEFT adapters of
different ranks and targets (tests/test_lora_model.py's) by ``--lora-modules``; the nodes hold two
at a time (``--max-loras 2``), so a mixed batch evicts and re-reads them. Answers are checked
against PEFT's PeftModel (greedy generate, logprobs) on the same weights."""

from __future__ import annotations

import concurrent.futures
import functools
import pathlib
import re
import time
import types

import pytest
import torch

from pdserve.cli.up_slo import SPLIT_MIN_CORES
from pdserve.launcher.plan import usable_cores
from tests import web
from tests.cluster import NodeProcess, RedisServer, pdserve_up
from tests.engine_helpers import hf_greedy
from tests.test_cluster_concurrent import _prompts, _stream
from tests.test_lora_model import ADAPTERS, _peft_model, _save_adapter
from tests.test_router_cluster import RouterProcess, serving, tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")
NAMES = tuple(ADAPTERS)  # "attn" (r 4), "mlp" (r 8, rsLoRA), "all" (r 16, all seven projections)
ATOL = 1e-4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("lora-cluster")
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)
    adapters = {
        name: _save_adapter(str(model), tmp / f"adapter-{name}", seed, fields)
        for name, (seed, fields) in ADAPTERS.items()
    }
    modules = ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    redis = RedisServer(tmp)
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    extra = ["--num-kv-blocks", "512", "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2", *lora]
    second = redis.url.removesuffix("/0") + "/1"  # the colocated node's own registry
    nodes = {
        "prefill": NodeProcess("prefill", str(model), tmp, redis.url, extra),
        "decode": NodeProcess("decode", str(model), tmp, redis.url, extra),
        "colocated": NodeProcess("decode", str(model), tmp, second, [*extra, "--colocated"]),
    }
    routers = {
        "pd": RouterProcess(
            model, redis.url, tmp, "--disagg-threshold", "8", "--local-prefill-margin-s", "-1", *modules
        ),
        "decode_only": RouterProcess(model, redis.url, tmp, "--disagg-threshold", "100000", *modules),
        "colocated": RouterProcess(model, second, tmp, *modules),
    }
    with serving(redis, nodes.values(), routers.values()):
        yield model, adapters, routers, nodes


@functools.cache
def _oracle(model: pathlib.Path, adapter: str | None, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    if adapter is None:
        return hf_greedy(str(model), list(prompt), max_tokens)
    peft_model = _peft_model(str(model), adapter)
    with torch.no_grad():
        out = peft_model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _completion(router, body: dict, stream: bool) -> tuple[list[int], dict]:
    """Token ids and usage, as the client sees them."""
    body = {**body, "return_token_ids": True, "ignore_eos": True, "temperature": 0}
    if not stream:
        reply = web.post(router.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["model"] == body["model"]
        return answer["choices"][0]["token_ids"], answer["usage"]
    events = _stream(router, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    return ids, events[-1]["usage"]


@pytest.mark.parametrize("router_name", ["pd", "decode_only", "colocated"])
def test_a_concurrent_mixed_adapter_batch_equals_peft_streamed_or_not(cluster, router_name):
    """Three adapters and the base model at once, prompts of 8 to 130 tokens, streamed and not:
    each answer equals PEFT's greedy generate with its own adapter, though the nodes hold two
    adapters at a time (requests wait for a slot, adapters are evicted and read again)."""
    model, adapters, routers, _ = cluster
    router = routers[router_name]
    base = model.name
    prompts = _prompts(
        {"pd": 81, "decode_only": 83, "colocated": 85}[router_name], [9, 40, 17, 130, 12, 64, 25, 8]
    )
    jobs = []
    for i, prompt in enumerate(prompts):
        name = (*NAMES, None)[i % 4]
        body = {"model": name or base, "prompt": prompt, "max_tokens": 6}
        jobs.append((name, prompt, body, i % 2 == 1))
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda j: _completion(router, j[2], j[3]), jobs))
    for (name, prompt, _, stream), (ids, _) in zip(jobs, answers, strict=True):
        expected = _oracle(model, None if name is None else adapters[name], tuple(prompt), 6)
        assert ids == expected, (router_name, name, len(prompt), stream)


def test_logprobs_with_an_adapter_equal_peft_log_softmax_on_every_path(cluster):
    model, adapters, routers, _ = cluster
    prompt = _prompts(91, [20])[0]
    body = {"model": "all", "prompt": prompt, "max_tokens": 4, "logprobs": 2, "temperature": 0}
    body |= {"ignore_eos": True, "return_tokens_as_token_ids": True}
    for router in routers.values():
        reply = web.post(router.url + "/v1/completions", json=body, timeout=120).json()
        entries = reply["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in entries["tokens"]]
        with torch.no_grad():
            logits = _peft_model(str(model), adapters["all"])(torch.tensor([prompt + tokens])).logits[0]
        rows = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
        for pos, token in enumerate(tokens):
            assert abs(entries["token_logprobs"][pos] - float(rows[pos, token])) < ATOL
            assert int(rows[pos].argmax()) == token


@pytest.mark.parametrize("router_name", ["pd", "decode_only"])
def test_blocks_cached_under_one_adapter_serve_only_that_adapter(cluster, router_name):
    """The same prompt under "attn", then "mlp", then the base model reuses no block (cached_tokens
    0, each answer its own oracle's); "attn" again reuses them (on the disaggregating router the
    longer prompt after it goes through the prefill node, and both nodes hold the blocks)."""
    model, adapters, routers, nodes = cluster
    router = routers[router_name]
    prompt = _prompts({"pd": 93, "decode_only": 95}[router_name], [48])[0]
    adopted = len(nodes["decode"].events("kv_adopted"))
    for name in ("attn", "mlp", None):
        ids, usage = _completion(
            router, {"model": name or model.name, "prompt": prompt, "max_tokens": 3}, False
        )
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0, name
        assert ids == _oracle(model, None if name is None else adapters[name], tuple(prompt), 3)
    assert all(e["blocks_reused"] == 0 for e in nodes["decode"].events("kv_adopted")[adopted:])
    ids, usage = _completion(router, {"model": "attn", "prompt": prompt, "max_tokens": 3}, True)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 32 and ids == _oracle(
        model, adapters["attn"], tuple(prompt), 3
    )
    if router_name == "pd":
        longer = prompt + _prompts(97, [20])[0]
        ids, usage = _completion(router, {"model": "attn", "prompt": longer, "max_tokens": 3}, False)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 32  # the prefill node's hit
        assert ids == _oracle(model, adapters["attn"], tuple(longer), 3)
        assert nodes["decode"].events("kv_adopted")[-1]["blocks_reused"] > 0  # and the decode node's


def test_a_seeded_sample_with_an_adapter_is_the_same_on_every_path(cluster):
    model, _, routers, _ = cluster
    body = {"model": "mlp", "prompt": _prompts(99, [30])[0], "max_tokens": 8, "n": 2, "seed": 1234}
    body |= {"temperature": 0.9, "return_token_ids": True, "ignore_eos": True}
    answers = []
    for router in routers.values():
        reply = web.post(router.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        answers.append([c["token_ids"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])])
    assert answers[0] == answers[1] == answers[2] and answers[0][0] != answers[0][1]


def test_models_runtime_load_metrics_and_errors(cluster, tmp_path):
    model, adapters, routers, _ = cluster
    router = routers["pd"]
    models = web.get(router.url + "/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(model.name, None), *((n, model.name) for n in NAMES)]
    seed, fields = ADAPTERS["mlp"]
    extra = _save_adapter(str(model), tmp_path / "late", seed + 10, fields)
    body = {"lora_name": "late", "lora_path": extra}
    assert web.post(router.url + "/v1/load_lora_adapter", json=body).status_code == 200
    prompt = _prompts(101, [15])[0]
    ids, _ = _completion(router, {"model": "late", "prompt": prompt, "max_tokens": 4}, False)
    assert ids == _oracle(model, extra, tuple(prompt), 4)
    assert web.post(router.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    gone = web.post(router.url + "/v1/completions", json={"model": "late", "prompt": "x"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    loads = re.compile(r'pdserve_node_lora_loads_total\{[^}]*adapter="late"[^}]*\} [1-9]')
    deadline = time.monotonic() + 5
    while not loads.search(scrape := web.get(router.url + "/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.2)  # node records lag by a heartbeat
    assert loads.search(scrape), scrape
    assert 'pdserve_lora_requests_total{adapter="late"} 1.0' in scrape


def test_pdserve_up_with_its_defaults_serves_adapters_exactly(tmp_path, default_model_dir):
    """`pdserve up --lora-modules ...` as a user starts it (its own Redis, the default shape for this
    machine: 1P+1D, or one colocated node on a CPU of fewer than 4 cores; the default thread split
    and pool sizes, one slot for two adapters): concurrent requests of both adapters and the base
    model, streamed and not, equal PEFT's greedy output."""
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)
    adapters = {
        name: _save_adapter(str(model), tmp_path / f"up-{name}", seed, fields)
        for name, (seed, fields) in ADAPTERS.items()
        if name != "attn"
    }
    modules = [f"{name}={path}" for name, path in adapters.items()]
    with pdserve_up(model, tmp_path, "--lora-modules", *modules) as url:
        router = types.SimpleNamespace(url=url)
        roles = sorted(n["role"] for n in web.get(url + "/admin/nodes", timeout=10).json()["nodes"])
        small = usable_cores() < SPLIT_MIN_CORES  # pdserve.cli.up_slo.small_cpu_machine
        assert roles == (["colocated"] if small else ["decode", "prefill"]), roles
        prompts = _prompts(103, [10, 45, 20, 70, 12, 33])
        jobs = [((*adapters, None)[i % 3], prompt, i % 2 == 1) for i, prompt in enumerate(prompts)]

        def run(job):
            name, prompt, stream = job
            return _completion(
                router, {"model": name or model.name, "prompt": prompt, "max_tokens": 5}, stream
            )

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(run, jobs))
    for (name, prompt, stream), (ids, _) in zip(jobs, answers, strict=True):
        assert ids == _oracle(model, None if name is None else adapters[name], tuple(prompt), 5), (
            name,
            stream,
        )
