"""lm-eval-harness against a real `pdserve up` cluster, item by item against lm-eval's own `hf` model.

Two local tasks (tests/data/lm_eval): a generate_until task scored by exact match and a
multiple_choice task scored by loglikelihood. Each runs twice through `lm_eval.simple_evaluate`:
once as `local-completions` on the router's /v1/completions (4 requests in flight), once as `hf`
on the same weights in float32. Greedy output must be the same text for every doc; every
choice's loglikelihood must agree within LOGLIKELIHOOD_TOL, so the chosen answer and the scores
are the same. ``make eval`` only: it needs lm-eval installed and starts a cluster of the default model.
"""

from __future__ import annotations

import pathlib

import pytest

from tests import web
from tests.cluster import ROOT, pdserve_up

pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.eval, pytest.mark.timeout(420)]
TASKS_DIR = ROOT / "tests" / "data" / "lm_eval"
LOGLIKELIHOOD_TOL = 1e-3  # absolute, in nats: float32 on both sides, different kernels


@pytest.fixture(scope="module")
def router(default_model_dir, tmp_path_factory):
    """(router URL, served model id) of one cluster shared by both tasks."""
    with pdserve_up(
        default_model_dir, tmp_path_factory.mktemp("eval")
    ) as url:  # its defaults (1P+1D; one colocated node on a CPU of < 4 cores)
        yield url, web.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _evaluate(task: str, model: str, model_args: str, **kwargs) -> dict:
    """lm-eval's results for one task: {"scores": {metric: value}, "samples": {doc_id: sample}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        batch_size=1,
        log_samples=True,
        bootstrap_iters=0,
        **kwargs,
    )
    scores = {k: v for k, v in out["results"][task].items() if "stderr" not in k and k != "alias"}
    return {"scores": scores, "samples": {s["doc_id"]: s for s in out["samples"][task]}}


def _both(task: str, router: tuple[str, str], model_dir: pathlib.Path) -> tuple[dict, dict]:
    """(served, hf) results of `task`; hf runs first, while the cluster is idle."""
    hf = _evaluate(task, "hf", f"pretrained={model_dir},dtype=float32", device="cpu")
    url, model_id = router
    served_args = (
        f"base_url={url}/v1/completions,model={model_id},tokenizer={model_dir},"
        "tokenizer_backend=huggingface,num_concurrent=4,max_retries=2,timeout=120"
    )
    served = _evaluate(task, "local-completions", served_args)
    assert sorted(served["samples"]) == sorted(hf["samples"]) == list(range(15))
    return served, hf


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the task yamls' data_files are relative to the repository root


def test_generate_until_is_the_same_text_per_doc_as_hf(router, default_model_dir, in_root):
    served, hf = _both("pdserve_short_answers", router, default_model_dir)
    for doc_id, expected in hf["samples"].items():
        got = served["samples"][doc_id]
        assert got["resps"] == expected["resps"], (doc_id, expected["doc"])
        assert got["filtered_resps"] == expected["filtered_resps"], (doc_id, expected["doc"])
    assert served["scores"] == hf["scores"]


def test_multiple_choice_loglikelihoods_match_hf_per_choice(router, default_model_dir, in_root):
    served, hf = _both("pdserve_choices", router, default_model_dir)
    for doc_id, expected in hf["samples"].items():
        got = served["samples"][doc_id]["filtered_resps"]  # [(loglikelihood, is_greedy)] per choice
        want = expected["filtered_resps"]
        assert len(got) == len(want), doc_id
        for choice, ((ll, greedy), (hf_ll, hf_greedy)) in enumerate(zip(got, want, strict=True)):
            assert abs(ll - hf_ll) <= LOGLIKELIHOOD_TOL, (doc_id, choice, ll, hf_ll)
            assert greedy == hf_greedy, (doc_id, choice)  # the router's top_logprobs say so too
        chosen = max(range(len(got)), key=lambda i: got[i][0])
        assert chosen == max(range(len(want)), key=lambda i: want[i][0]), doc_id
    assert served["scores"] == hf["scores"]
