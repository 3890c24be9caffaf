"""Speculative decoding through real processes: `pdserve up --node-args "--speculative ngram"`,
and again with a draft model (`--speculative-model DIR`); 1 prefill + 1 decode node, a private
redis-server, the router. Clients at once on both paths: prompts under the router's 64-token
threshold prefill on the decode node, longer ones on the prefill node, and the decode node
speculates either way. Every answer is checked against Hugging Face (greedy ids and logprobs)
or the engine without speculation (seeded samples)."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests import web
from tests.cluster import pdserve_up
from tests.engine_helpers import hf_greedy, hf_logits
from tests.test_router_cluster import tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["ngram", "draft-model"])
def cluster(request, tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("speculative")
    model = tiny_model_with_tokenizer(default_model_dir)
    # the draft model: the model itself (same tokenizer; its greedy drafts are all kept)
    method = "--speculative ngram" if request.param == "ngram" else f"--speculative-model {model}"
    with pdserve_up(
        model, tmp, "--prefill", "1", "--decode", "1", "--node-args", f"{method} --num-speculative-tokens 4"
    ) as url:
        name = web.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield model, name, url


def _repetitive(seed: int, length: int) -> list[int]:
    """A prompt that quotes itself (a pattern and noise), where prompt lookup finds drafts."""
    rng = random.Random(seed)
    pattern = [rng.randrange(100, 40000) for _ in range(rng.randrange(6, 15))]
    out: list[int] = []
    while len(out) < length:
        out += pattern if rng.random() < 0.7 else [rng.randrange(100, 40000)]
    return out[:length]


def _complete(url: str, body: dict, stream: bool) -> tuple[list[int], list[float]]:
    body = {**body, "logprobs": 0, "return_tokens_as_token_ids": True}
    if not stream:
        reply = web.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        logprobs = reply.json()["choices"][0]["logprobs"]
        tokens, values = logprobs["tokens"], logprobs["token_logprobs"]
    else:
        tokens, values = [], []
        with web.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    part = event["choices"][0]["logprobs"] if event["choices"] else None
                    if part:
                        tokens += part["tokens"]
                        values += part["token_logprobs"]
    return [int(t.removeprefix("token_id:")) for t in tokens], values


def _metric(url: str, name: str) -> dict[str, float]:
    """role -> the family's value summed over that role's nodes."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(web.get(url + "/metrics", timeout=10).text):
        for s in family.samples if family.name == name else ():
            if s.name == name or s.name == name + "_total":
                totals[s.labels["role"]] = totals.get(s.labels["role"], 0.0) + s.value
    return totals


def test_greedy_answers_on_both_paths_at_once_equal_hf_with_drafts_accepted(cluster):
    model, name, url = cluster
    lengths = [20, 300, 40, 150, 33, 96, 200, 50]  # under 64: decode-only; the rest through prefill
    jobs = [(_repetitive(i, n), i % 2 == 1) for i, n in enumerate(lengths)]  # streamed every other

    def run(job):
        prompt, stream = job
        body = {
            "model": name,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        return _complete(url, body, stream)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    for (prompt, _), (ids, values) in zip(jobs, got, strict=True):
        want = hf_greedy(str(model), prompt, MAX_TOKENS)
        assert ids == want, len(prompt)
        logits = hf_logits(str(model), [*prompt, *want])[len(prompt) - 1 : -1]
        want_values = torch.log_softmax(logits, -1)[torch.arange(MAX_TOKENS), torch.tensor(want)]
        assert values == pytest.approx(want_values.tolist(), abs=2e-3), len(prompt)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the counts come with the decode node's heartbeat
        accepted = _metric(url, "pdserve_node_spec_accepted_tokens").get("decode", 0)
        if accepted > 0:
            break
        time.sleep(0.3)
    proposed = _metric(url, "pdserve_node_spec_draft_tokens")
    assert 0 < accepted <= proposed["decode"]
    assert proposed.get("prefill", 0) == 0  # a prefill node stops at the first token: nothing to draft


def test_seeded_samples_on_both_paths_are_the_engine_without_speculation(cluster):
    from pdserve.engine import LLM, SamplingParams

    model, name, url = cluster
    prompts = [_repetitive(50 + i, n) for i, n in enumerate((30, 180, 45, 260))]
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 77, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    offline = [
        o.outputs[0].token_ids
        for o in LLM(str(model), num_kv_blocks=256).generate(prompts, SamplingParams(**params))
    ]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(
            pool.map(lambda p: _complete(url, {"model": name, "prompt": p, **params}, False)[0], prompts)
        )
    assert got == offline
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # every block back once the requests are done
        used = _metric(url, "pdserve_node_kv_blocks_used")
        if used and not any(used.values()):
            break
        time.sleep(0.3)
    assert used and not any(used.values()), used
