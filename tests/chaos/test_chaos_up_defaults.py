"""Busy is not dead, with the defaults a user gets: `pdserve up --prefill 2 --decode 1` (its own
thread split, 1 torch thread a node on 2 cores, the default model, registry or none), 4 concurrent
streamed completions of 1,500-token prompts, one prefill node killed 1 s in; quiet, and with two
busy processes on the same cores. Every request must complete and no node may hold a KV block
afterwards. The stuck-loop cases in test_chaos_node_faults.py check the other side: a hung engine
still leaves the pool. And a whole machine paused past the heartbeat TTL (every node stopped at
once): no request lost, each equal to HF. ``make chaos`` only: each case starts a cluster of the
default model."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from tests import web
from tests.cluster import pdserve_up

pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.chaos]
PROMPT_TOKENS = 1500
_USED_RE = re.compile(r'^pdserve_node_kv_blocks_used\{node_id="[^"]+",role="(\w+)"\} (\d+)(?:\.0)?$', re.M)


def _stream(url: str, model: str, prompt: list[int]) -> tuple[int, object, object]:
    """(HTTP status, finish reason, SSE error) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "stream": True}
    with web.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        if response.status_code != 200:
            return response.status_code, 0, response.read().decode()
        finish, error = None, None
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                error = event.get("error", error)
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
        return 200, finish, error


@contextlib.contextmanager
def _busy_processes(num: int):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(num)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def _used_blocks(url: str) -> list[tuple[str, int]]:
    return [(role, int(n)) for role, n in _USED_RE.findall(web.get(url + "/metrics", timeout=10).text)]


@pytest.mark.parametrize("busy", [0, 2], ids=["quiet", "two-busy-processes"])
@pytest.mark.parametrize("registry", [True, False], ids=["redis", "static"])
def test_a_killed_prefill_node_under_long_prompts_loses_no_request_with_up_defaults(
    default_model_dir, tmp_path, registry, busy
):
    rng = random.Random(31)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(4)]
    flags = ["--prefill", "2", "--decode", "1", *([] if registry else ["--no-redis"])]
    with pdserve_up(default_model_dir, tmp_path, *flags) as url, _busy_processes(busy):
        model = web.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        ready = json.loads((tmp_path / "prefill-0.ready.json").read_text())
        victim = ready["pid"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_stream, url, model, p) for p in prompts]
            time.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
            results = [f.result() for f in futures]
        assert all(r == (200, "length", None) for r in results), results
        deadline = time.monotonic() + 30
        used = _used_blocks(url)
        while any(n for _, n in used) and time.monotonic() < deadline:
            time.sleep(0.5)
            used = _used_blocks(url)
        assert sorted(role for role, _ in used) == ["decode", "prefill"], used  # the survivors
        assert all(n == 0 for _, n in used), used
        expired = re.findall(r"node (\S+) \(\w+\) expired", (tmp_path / "router.log").read_text())
        assert set(expired) <= {ready["node_id"]}, expired  # busy survivors never left the pool


def test_every_node_paused_past_its_ttl_loses_no_request_with_up_defaults(default_model_dir, tmp_path):
    """A machine paused (a VM stopped or migrated), as `pdserve up` starts it (1P+1D, its Redis):
    both nodes stopped 4.5 s, past their heartbeat TTL, with samples decoding and more arriving;
    the records lapse, the router drops both, and every sample waits for them to come back
    (--reroute-wait-s) and completes equal to Hugging Face's greedy output."""
    from tests.engine_helpers import hf_greedy
    from tests.test_machine_pause import sample_tokens

    rng = random.Random(47)
    work = [  # (prompt, max_tokens, streamed): mixed lengths, under way through the pause
        ([rng.randrange(100, 40000) for _ in range(rng.randrange(8, 400))], rng.randrange(24, 48), i % 2 == 0)
        for i in range(6)
    ]
    with pdserve_up(default_model_dir, tmp_path, "--prefill", "1", "--decode", "1") as url:
        model = web.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        pids = [
            json.loads((tmp_path / f"{n}.ready.json").read_text())["pid"] for n in ("prefill-0", "decode-0")
        ]
        with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
            futures = [pool.submit(sample_tokens, url, model, *w) for w in work[:4]]
            time.sleep(2.0)  # prefilled, decoding
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            futures += [pool.submit(sample_tokens, url, model, *w) for w in work[4:]]
            time.sleep(4.5)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            results = [f.result() for f in futures]
        router_log = (tmp_path / "router.log").read_text()
        assert "left the registry" in router_log or "went away mid-stream" in router_log
        deadline = time.monotonic() + 30
        used = _used_blocks(url)
        while any(n for _, n in used) and time.monotonic() < deadline:
            time.sleep(0.5)
            used = _used_blocks(url)
        assert sorted(role for role, _ in used) == ["decode", "prefill"] and not any(n for _, n in used), used
    for (prompt, max_tokens, _), tokens in zip(work, results, strict=True):
        assert tokens == hf_greedy(str(default_model_dir), prompt, max_tokens)
