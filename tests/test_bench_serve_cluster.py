"""`pdserve bench serve` end to end: the command against a real `pdserve up` cluster on a tiny model.

Prompts below the router's disaggregation threshold (64 uncached tokens) prefill on the decode
node; longer ones go prefill node -> decode node. The tiny random model often emits tokens that
are incomplete UTF-8, whose text the router holds back: such a token shows in the stream only
as its logprob entry, so exact counts need every logprob the client asked for.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import web
from tests.cluster import ROOT
from tests.up_launcher import Launcher, tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def up(default_model_dir, tmp_path_factory):
    model = tiny_model_with_tokenizer(default_model_dir, tmp_path_factory.mktemp("model"))
    launcher = Launcher(tmp_path_factory.mktemp("up"), model, "--prefill", "1", "--decode", "1")
    try:
        launcher.wait_up()
        yield launcher
    finally:
        launcher.close()


def bench_serve(url: str, out: pathlib.Path, *flags: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "bench",
        "serve",
        "--base-url",
        url,
        "--result-json",
        str(out),
        "--no-progress",
        "--max-concurrency",
        "4",
        "--duration",
        "90",
        *flags,
    ]
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "12 sent, 12 ok, errors: none" in done.stdout, done.stdout
    return json.loads(out.read_text())


def assert_every_request_streamed_exactly_what_it_asked_for(run: dict) -> None:
    records = run["records"]
    assert [r["index"] for r in records] == list(range(12))
    for r in records:
        assert r["ok"] and r["error_kind"] is None and r["finish_reason"] == "length", r
        assert r["num_output_tokens"] == r["requested_tokens"] == r["usage_completion_tokens"], r
        assert not r["usage_mismatch"] and r["events_without_logprobs"] == 0, r
        times = r["token_times_s"]
        assert 0 < r["ttft_s"] == times[0] and times == sorted(times) and times[-1] <= r["e2e_s"]
    summary = run["summary"]
    assert (summary["num_sent"], summary["num_ok"], summary["errors"]) == (12, 12, {})
    assert summary["num_usage_mismatch"] == summary["num_usage_missing"] == summary["num_off_length"] == 0
    assert summary["total_output_tokens"] == sum(r["requested_tokens"] for r in records)


def assert_server_steps_count_the_runs_tokens(run: dict, prompt_role: str) -> None:
    """The server's engine steps during the run (bench_serve/server_steps.py), from the router's
    node counters: every uncached prompt token computed once, most on ``prompt_role``'s node (the
    router may prefill some on the decode node while the prefill node is busy), and every output
    token after the first a decode row on the decode node."""
    by_role: dict[str, dict[str, int]] = {}
    for line in run["server_steps"]:
        assert line["steps"] > 0 and line["seconds"] > 0, line
        totals = by_role.setdefault(line["role"], {"prompt": 0, "decode": 0})
        totals["prompt"] += line["prompt_tokens"]
        totals["decode"] += line["decode_tokens"]
    summary = run["summary"]
    uncached = summary["total_prompt_tokens"] - summary["total_cached_tokens"]
    assert sum(totals["prompt"] for totals in by_role.values()) == uncached, by_role
    assert by_role[prompt_role]["prompt"] >= uncached / 2, by_role
    assert by_role["decode"]["decode"] == summary["total_output_tokens"] - summary["num_ok"], by_role


@pytest.mark.usefixtures("processes")
def test_bench_serve_streams_token_id_completions_at_fixed_concurrency_with_exact_counts(up, tmp_path):
    result = bench_serve(
        up.url,
        tmp_path / "completions.json",
        "--api",
        "completions",
        "--workload",
        "fixed",
        "--num-requests",
        "12",
        "--input-len",
        "40",
        "--output-len",
        "9",
        "--plot-dir",
        str(tmp_path / "plots"),
    )
    (run,) = result["runs"]
    assert_every_request_streamed_exactly_what_it_asked_for(run)
    assert all(r["prompt_tokens"] == 40 and r["requested_tokens"] == 9 for r in run["records"])
    assert run["max_concurrency"] == 4 and run["request_rate"] is None
    assert_server_steps_count_the_runs_tokens(run, "decode")  # 40 tokens: below the threshold
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.usefixtures("processes")
def test_bench_serve_streams_multi_turn_chat_one_turn_after_another(up, tmp_path):
    result = bench_serve(
        up.url,
        tmp_path / "chat.json",
        "--api",
        "chat",
        "--workload",
        "multi-turn",
        "--num-conversations",
        "4",
        "--num-turns",
        "3",
        "--input-len",
        "12",
        "--output-len",
        "6",
        "--request-rate",
        "20",
    )
    (run,) = result["runs"]
    assert_every_request_streamed_exactly_what_it_asked_for(run)
    by_turn = {(r["conversation"], r["turn"]): r for r in run["records"]}
    for conv in range(4):
        turns = [by_turn[(conv, t)] for t in range(3)]
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later["sent_s"] >= earlier["sent_s"] + earlier["e2e_s"]  # sent after the last turn ended
            assert later["prompt_tokens"] > earlier["prompt_tokens"] + 12  # it resends the history


@pytest.mark.usefixtures("processes")
def test_bench_serve_counts_exactly_on_the_prefill_to_decode_path(up, tmp_path):
    result = bench_serve(
        up.url,
        tmp_path / "disagg.json",
        "--workload",
        "fixed",
        "--num-requests",
        "12",
        "--input-len",
        "80",
        "--output-len",
        "9",
    )
    assert_every_request_streamed_exactly_what_it_asked_for(result["runs"][0])
    assert_server_steps_count_the_runs_tokens(result["runs"][0], "prefill")


def _generated_tokens(url: str) -> float:

    text = web.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve_generation_tokens_total")
    )


@pytest.mark.usefixtures("processes")
def test_a_warm_up_is_served_but_not_counted(up, tmp_path):
    before = _generated_tokens(up.url)
    flags = ["--workload", "fixed", "--num-requests", "12", "--input-len", "40", "--output-len", "9"]
    result = bench_serve(up.url, tmp_path / "warm.json", *flags, "--warmup-requests", "5")
    assert result["config"]["warmup_requests"] == 5
    assert_every_request_streamed_exactly_what_it_asked_for(result["runs"][0])  # 12 records, no more
    assert _generated_tokens(up.url) - before == (5 + 12) * 9  # the server did see the warm-up


def test_warm_up_prompts_are_not_the_runs_and_a_negative_count_is_refused():
    from pdserve.bench_serve.metrics import Slo
    from pdserve.bench_serve.runner import Limits
    from pdserve.bench_serve.spec import PromptStyle, WorkloadKind, WorkloadSpec
    from pdserve.bench_serve.sweep import WARMUP_SEED, SweepSpec

    spec = WorkloadSpec(WorkloadKind.FIXED, PromptStyle.TOKEN_IDS, num_requests=4, input_len=16, output_len=4)
    runs = [item.prompt for k in range(3) for item in spec.build(k)]
    assert not {tuple(i.prompt) for i in spec.build(WARMUP_SEED)} & {tuple(p) for p in runs}
    with pytest.raises(ValueError, match="warm-up"):
        SweepSpec((1.0,), 1.0, Limits(), Slo(1.0, 1.0), 0, warmup=-1)
