"""int8 weights through real processes: `pdserve up --quantization int8` (1 prefill + 1 decode
node, a private redis-server, the router), as a user starts it. Prompts of 64 tokens or more are
prefilled on the prefill node and their KV, computed by the int8 model, decodes on the decode
node; shorter ones run decode-only. Concurrent, mixed lengths, greedy and seeded, streamed and
not, with logprobs. The oracle for each request is the offline engine with the same quantization
(one deterministic computation whatever the path: each token's activations are quantized alone,
so its neighbours in a step change nothing), and for greedy requests also Hugging Face's model
with the int8 arithmetic simulated in float32 (tests/test_int8_weights.py)."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests import web
from tests.cluster import pdserve_up
from tests.test_int8_weights import ATOL, _oracle
from tests.test_router_cluster import tiny_model_with_tokenizer
from tests.test_speculative_cluster import _complete, _repetitive

pytestmark = pytest.mark.usefixtures("processes")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("int8-weights")
    model = tiny_model_with_tokenizer(default_model_dir)
    with pdserve_up(model, tmp, "--prefill", "1", "--decode", "1", "--quantization", "int8") as url:
        name = web.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield model, name, url, tmp


def test_both_paths_at_once_give_the_offline_int8_engine_s_tokens(cluster):
    model, name, url, log_dir = cluster
    assert "quantization: int8" in (log_dir / "up.out").read_text()
    nodes = web.get(url + "/admin/nodes", timeout=10).json()["nodes"]
    assert sorted((n["role"], n["quantization"]) for n in nodes) == [("decode", "int8"), ("prefill", "int8")]
    lengths = [20, 300, 40, 150, 33, 200]  # under 64: decode-only; the rest through prefill
    prompts = [_repetitive(300 + i, n) for i, n in enumerate(lengths)]
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    seeded = {"temperature": 0.8, "top_p": 0.95, "seed": 7, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    jobs = [(p, greedy if i % 3 else seeded, i % 2 == 1) for i, p in enumerate(prompts)]

    def run(job):
        prompt, params, stream = job
        return _complete(url, {"model": name, "prompt": prompt, **params}, stream)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    from pdserve.engine import LLM, SamplingParams

    with LLM(str(model), num_kv_blocks=256, quantization="int8") as llm:
        for (prompt, params, _), (ids, values) in zip(jobs, got, strict=True):
            want = llm.generate([prompt], SamplingParams(**params, logprobs=0))[0].outputs[0]
            assert ids == want.token_ids, len(prompt)
            assert values == pytest.approx([lp.logprob for lp in want.logprobs], abs=ATOL), len(prompt)
            if params is greedy:
                assert ids == _oracle(str(model), tuple(prompt), MAX_TOKENS)[0], len(prompt)
