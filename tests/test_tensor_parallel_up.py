"""`pdserve up` with each pool its own tensor-parallel layout, as a user starts it, under the
cluster key it makes (CURVE on every node socket):

- `--prefill-tp 2 --decode-tp 1` with a registry, on the default model (SmolLM2-135M: 9 query and
  3 KV heads, an uneven share over 2 ranks): the README's first request, greedy chats through
  the prefill→decode path and the decode-only path equal to the single-process offline engine,
  and a role switch of the two-rank node to colocated and back;
- `--prefill-tp 1 --decode-tp 2 --no-redis` with the int8 KV cache (its per-head scales cross
  layouts): concurrent completions of mixed lengths, streamed and not, equal to the offline
  engine's int8 cache (greedy, logprobs);
- layouts it cannot run are refused before anything starts."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests import web
from tests.cluster import pdserve_up
from tests.test_router_cluster import tiny_model_with_tokenizer
from tests.test_speculative_cluster import _complete, _repetitive

pytestmark = pytest.mark.usefixtures("processes")
README = {"max_tokens": 32, "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def _chat(url: str, body: dict) -> dict:
    reply = web.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_default_model_on_a_two_rank_prefill_node_with_a_registry(tmp_path, default_model_dir):
    # float32: equal to the one-process engine token for token (bf16, the default on CPUs with bf16
    # arithmetic, rounds differently when the heads are split)
    fp32 = ("--node-args", "--dtype float32")
    with pdserve_up(default_model_dir, tmp_path, "--prefill-tp", "2", "--decode-tp", "1", *fp32) as url:
        assert (tmp_path / "cluster.key").is_file()
        nodes = web.get(url + "/admin/nodes", timeout=10).json()["nodes"]
        assert sorted((n["role"], n["tp_size"]) for n in nodes) == [("decode", 1), ("prefill", 2)]
        name = web.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        assert _chat(url, {"model": name, **README})["choices"][0]["message"][
            "content"
        ]  # as the README sends it
        short = {"model": name, **README, "temperature": 0}  # decode-only: under 64 prompt tokens
        long = {**short, "messages": [{"role": "user", "content": "Tell me about Paris. " * 20}]}
        answers = [_chat(url, body) for body in (short, long)]
        tp_node = next(n["node_id"] for n in nodes if n["tp_size"] == 2)
        for role in ("colocated", "prefill"):  # the two-rank node decodes, then prefills again
            reply = web.post(f"{url}/admin/nodes/{tp_node}/role", json={"role": role}, timeout=90)
            assert reply.status_code == 200 and reply.json()["role"] == role, reply.text
            again = _chat(url, long)["choices"][0]["message"]["content"]
            assert again == answers[1]["choices"][0]["message"]["content"]
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(default_model_dir), num_kv_blocks=64, dtype="float32")
    tokenizer = llm.get_tokenizer()
    for body, answer in zip((short, long), answers, strict=True):
        prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert answer["choices"][0]["message"]["content"] == want.text


def test_a_two_rank_decode_pool_with_the_int8_cache_and_static_addresses(tmp_path, default_model_dir):
    model = tiny_model_with_tokenizer(default_model_dir)
    flags = ["--prefill-tp", "1", "--decode-tp", "2", "--no-redis", "--node-args", "--kv-cache-dtype int8"]
    with pdserve_up(model, tmp_path, *flags) as url:
        nodes = web.get(url + "/admin/nodes", timeout=10).json()["nodes"]
        assert sorted((n["role"], n["tp_size"], n["kv_dtype"]) for n in nodes) == [
            ("decode", 2, "int8"),
            ("prefill", 1, "int8"),
        ]
        name = web.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        lengths = [20, 300, 40, 150, 90, 7]  # under 64 tokens: decode-only; the rest through prefill
        prompts = [_repetitive(200 + i, n) for i, n in enumerate(lengths)]
        greedy = {"model": name, "temperature": 0, "max_tokens": 16, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            jobs = [
                ({**greedy, "prompt": p}, i % 2 == 1) for i, p in enumerate(prompts)
            ]  # every other streamed
            got = list(pool.map(lambda job: _complete(url, *job), jobs))
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(model), num_kv_blocks=256, kv_cache_dtype="int8")
    for prompt, (ids, values) in zip(prompts, got, strict=True):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
        want = llm.generate([prompt], params)[0].outputs[0]
        assert ids == want.token_ids, len(prompt)
        assert values == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4), len(prompt)


def test_up_refuses_layouts_it_cannot_run_before_starting_anything(tmp_path, default_model_dir):
    import subprocess
    import sys

    from pdserve.launcher.plan import usable_cores

    def up(*flags: str) -> str:
        argv = [sys.executable, "-m", "pdserve", "up", "--port", "1", "--log-dir", str(tmp_path), *flags]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        return done.stderr + done.stdout

    too_many = usable_cores() + 1
    tiny = str(tiny_model_with_tokenizer(default_model_dir))
    assert f"--decode-tp {too_many}: a node of {too_many} ranks" in up(
        "--model", tiny, "--decode-tp", str(too_many)
    )
    # two KV heads over three ranks: neither a share of whole heads nor of whole replicas
    assert "exceeds the model's 2 KV heads" in up("--model", tiny, "--oversubscribe", "--prefill-tp", "3")
    assert "runs with --prefill-tp 1 --decode-tp 1 only" in up(
        "--model", tiny, "--autoscale", "--decode-tp", "2"
    )
    assert not list(tmp_path.glob("*.log"))  # no child was started
