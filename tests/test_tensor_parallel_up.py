"""`pdserve up --prefill-tp 2 --decode-tp 1` (a registry) and `--prefill-tp 1 --decode-tp 2
--no-redis` (static addresses), as a user starts them: the README's first request, then
concurrent completions of mixed lengths, streamed and not, through the prefill→decode path and
the decode-only path, equal to the single-process offline engine (greedy, logprobs)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.cluster import pdserve_up
from tests.test_router_cluster import tiny_model_with_tokenizer
from tests.test_speculative_cluster import _complete, _repetitive

pytestmark = pytest.mark.usefixtures("processes")


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "registry"),
    [(2, 1, []), (1, 2, ["--no-redis"])],
    ids=["2-1-redis", "1-2-static"],
)
def test_a_mixed_layout_cluster_serves_like_one_process(
    prefill_tp, decode_tp, registry, tmp_path, default_model_dir
):
    model = tiny_model_with_tokenizer(default_model_dir)
    flags = ["--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), *registry]
    with pdserve_up(model, tmp_path, *flags) as url:
        nodes = httpx.get(url + "/admin/nodes", timeout=10).json()["nodes"]
        assert sorted((n["role"], n["tp_size"]) for n in nodes) == [
            ("decode", decode_tp),
            ("prefill", prefill_tp),
        ]
        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        readme = {
            "model": name,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
        reply = httpx.post(url + "/v1/chat/completions", json=readme, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        lengths = [20, 300, 40, 150, 90, 7]  # under 64 tokens: decode-only; the rest through prefill
        prompts = [_repetitive(200 + i, n) for i, n in enumerate(lengths)]
        greedy = {"model": name, "temperature": 0, "max_tokens": 16, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(
                pool.map(
                    lambda ip: _complete(url, {**greedy, "prompt": ip[1]}, ip[0] % 2 == 1), enumerate(prompts)
                )
            )
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(model), num_kv_blocks=256)
    for prompt, (ids, values) in zip(prompts, got, strict=True):
        want = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
        )[0]
        assert ids == want.outputs[0].token_ids, len(prompt)
        assert values == pytest.approx([lp.logprob for lp in want.outputs[0].logprobs], abs=1e-4), len(prompt)


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
    # SmolLM2-135M: 9 attention heads, 3 KV heads
    assert "9 attention heads do not split over 2 ranks" in up(
        "--model", str(default_model_dir), "--prefill-tp", "2"
    )
    assert "runs with --prefill-tp 1 --decode-tp 1 only" in up(
        "--model", tiny, "--autoscale", "--decode-tp", "2"
    )
    assert not list(tmp_path.glob("*.log"))  # no child was started
