"""The int8 KV cache through real processes: `pdserve up --node-args "--kv-cache-dtype int8
--speculative ngram"` (1 prefill + 1 decode node, a private redis-server, the router). The prefill
node's int8 blocks travel to the decode node as they are (scales inside the blocks), the decode
node speculates over them and rolls rejected drafts back; short prompts prefill on the decode
node. The oracle is the offline engine with the same int8 cache and no speculation: an int8
cache is not fp32 HF, but it is one deterministic computation whatever the path."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from tests import web
from tests.cluster import pdserve_up
from tests.engine_helpers import hf_greedy
from tests.test_router_cluster import tiny_model_with_tokenizer
from tests.test_speculative_cluster import _complete, _metric, _repetitive

pytestmark = pytest.mark.usefixtures("processes")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("kv-int8")
    model = tiny_model_with_tokenizer(default_model_dir)
    with pdserve_up(
        model,
        tmp,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--node-args",
        "--kv-cache-dtype int8 --speculative ngram",
    ) as url:
        name = web.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield model, name, url


def test_both_paths_at_once_give_the_offline_int8_engine_greedy_and_seeded(cluster):
    model, name, url = cluster
    nodes = web.get(url + "/admin/nodes", timeout=10).json()["nodes"]
    assert sorted(n["role"] for n in nodes) == ["decode", "prefill"]
    assert {(n["kv_dtype"], n["kv_layout"]) for n in nodes} == {("int8", "nbhd-q8-v1")}
    lengths = [20, 300, 40, 150, 33, 200]  # under 64: decode-only; the rest through prefill
    prompts = [_repetitive(100 + i, n) for i, n in enumerate(lengths)]
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    seeded = {"temperature": 0.8, "top_p": 0.95, "seed": 5, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    jobs = [
        (p, greedy if i % 3 else seeded, i % 2 == 1) for i, p in enumerate(prompts)
    ]  # streamed every other

    def run(job):
        prompt, params, stream = job
        return _complete(url, {"model": name, "prompt": prompt, **params}, stream)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(model), num_kv_blocks=256, kv_cache_dtype="int8")
    for (prompt, params, _), (ids, values) in zip(jobs, got, strict=True):
        want = llm.generate([prompt], SamplingParams(**params, logprobs=0))[0].outputs[0]
        assert ids == want.token_ids, len(prompt)
        assert values == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4), len(prompt)
        if params is greedy:  # and on this tiny model the int8 cache still gives HF's fp32 answers
            assert ids == hf_greedy(str(model), prompt, MAX_TOKENS), len(prompt)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the counts come with the decode node's heartbeat
        if _metric(url, "pdserve_node_spec_accepted_tokens").get("decode", 0) > 0:
            break
        time.sleep(0.3)
    assert _metric(url, "pdserve_node_spec_accepted_tokens").get("decode", 0) > 0  # drafts over int8 rows
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # every block back once the requests are done
        used = _metric(url, "pdserve_node_kv_blocks_used")
        if used and not any(used.values()):
            break
        time.sleep(0.3)
    assert used and not any(used.values()), used
