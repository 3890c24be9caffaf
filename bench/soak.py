"""Soak: a local cluster (``pdserve up``) under ~80% of its measured capacity for a long while,
with the variable-length mix; fails when memory, file descriptors, held KV blocks or latency grow.

    python -m bench.soak [--minutes 30] [--model DIR] [--load 0.8] [--out bench/results/soak]

1. Capacity: ``--concurrency`` closed-loop clients for ``--calibrate-s``; completed requests per second.
2. Soak: Poisson arrivals at ``--load`` x capacity (prompts 16-512 tokens, outputs 8-128, streamed
   or not, logprobs or not), every ``--sample-s`` seconds: each process's RSS and open fds, the
   nodes' used KV blocks (/metrics), the window's latency percentiles and errors.
3. The load stops; every node's used blocks must return to 0. Growth check: the last quarter of the
   run against the second (the first is warm-up): RSS within +max(10%, 64 MB), fds within +16,
   p50 latency within 2x; any 5xx or connection error fails too.

Writes soak.json (every sample) and soak.png (four panels over time) into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

import httpx
import psutil

from pdserve.launcher.commands import up_argv  # bench.soak runs from the checkout (make soak)

ROOT = pathlib.Path(__file__).resolve().parent.parent
_USED = re.compile(r'^pdserve_node_kv_blocks_used\{node_id="([^"]+)",role="\w+"\} (\d+)(?:\.0)?$', re.M)


def _start_cluster(args) -> tuple[subprocess.Popen, str]:
    port = args.port
    cmd = up_argv(port, args.out / "logs", *shlex.split(args.up_args), model=args.model or None)
    up = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return up, url
        if up.poll() is not None:
            raise SystemExit(f"pdserve up exited with {up.returncode}; see {args.out / 'logs'}")
        time.sleep(0.5)
    up.terminate()
    raise SystemExit("the cluster did not become healthy in 5 minutes")


def _model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]


def _request(rng: random.Random, model: str) -> dict:
    prompt_len, max_tokens = rng.choice([16, 64, 128, 256, 512]), rng.choice([8, 32, 64, 128])
    body = {
        "model": model,
        "prompt": [rng.randrange(100, 30000) for _ in range(prompt_len)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": rng.choice([0.0, 0.8]),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.5:
        body["logprobs"] = 1
    return body


async def _one(client: httpx.AsyncClient, body: dict, record: list) -> None:
    started = time.monotonic()
    status = "ok"
    try:
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith('data: {"error"'):
                        status = "stream_error"
                if reply.status_code != 200:
                    status = str(reply.status_code)
        else:
            reply = await client.post("/v1/completions", json=body)
            status = "ok" if reply.status_code == 200 else str(reply.status_code)
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    record.append((time.monotonic(), time.monotonic() - started, status))


async def _capacity(url: str, model: str, concurrency: int, seconds: float, seed: int) -> float:
    rng, record = random.Random(seed), []
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def worker():
            while time.monotonic() < end:
                await _one(client, _request(rng, model), record)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sum(1 for _, _, s in record if s == "ok") / seconds


def _processes(up: subprocess.Popen) -> dict[str, psutil.Process]:
    out = {}
    for child in psutil.Process(up.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            line = " ".join(child.cmdline())
            role = next((r for r in ("router", "prefill", "decode", "redis-server") if r in line), None)
            if role:
                out[f"{role}-{child.pid}"] = child
    return out


def _rss_parts_mb(pid: int) -> dict[str, float]:
    """RssAnon / RssFile / RssShmem: a KV pool's pages count once touched, and a decode node's
    RSS also counts the pages of a same-host prefill node's shared cache it has copied from."""
    parts = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            parts[key] = int(value.split()[0]) / 1024
    return parts


def _sample(url: str, procs: dict[str, psutil.Process], record: list, since: float) -> dict:
    now = time.monotonic()
    window = [r for r in record if r[0] >= since]
    latencies = sorted(seconds for _, seconds, status in window if status == "ok")
    used = {}
    with contextlib.suppress(httpx.HTTPError):
        used = {n: int(v) for n, v in _USED.findall(httpx.get(url + "/metrics", timeout=5).text)}
    sample = {"t": now, "rss_mb": {}, "rss_parts_mb": {}, "fds": {}, "used_blocks": sum(used.values())}
    sample["completed"] = len(window)
    for name, proc in procs.items():
        with contextlib.suppress(psutil.Error, OSError):
            sample["rss_mb"][name] = proc.memory_info().rss / 2**20
            sample["rss_parts_mb"][name] = _rss_parts_mb(proc.pid)
            sample["fds"][name] = proc.num_fds()
    sample["p50_s"] = statistics.median(latencies) if latencies else None
    sample["p99_s"] = latencies[int(0.99 * (len(latencies) - 1))] if latencies else None
    sample["errors"] = sum(1 for _, _, status in window if status != "ok" and status != "429")
    return sample


async def _soak(url: str, model: str, rate: float, seconds: float, procs, sample_s: float, seed: int):
    rng, record, samples, tasks = random.Random(seed + 1), [], [], set()
    limits = httpx.Limits(max_connections=512)
    start = time.monotonic()
    next_sample = start + sample_s
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        while time.monotonic() - start < seconds:
            await asyncio.sleep(rng.expovariate(rate))
            task = asyncio.create_task(_one(client, _request(rng, model), record))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if time.monotonic() >= next_sample:
                samples.append(_sample(url, procs, record, next_sample - sample_s))
                next_sample += sample_s
        await asyncio.gather(*tasks)
    return samples, record


def _growth(samples: list[dict], max_latency_growth: float = 2.0) -> list[str]:
    """What grew from the second quarter of the run to the last."""
    quarter = max(1, len(samples) // 4)
    early, late = samples[quarter : 2 * quarter], samples[-quarter:]
    problems = []
    for name in samples[0]["rss_mb"]:
        a = statistics.median(s["rss_mb"].get(name, 0) for s in early)
        b = statistics.median(s["rss_mb"].get(name, 0) for s in late)
        if b > a + max(0.1 * a, 64):
            problems.append(f"{name}: RSS {a:.0f} -> {b:.0f} MB")
        fa = max(s["fds"].get(name, 0) for s in early)
        fb = max(s["fds"].get(name, 0) for s in late)
        if fb > fa + 16:
            problems.append(f"{name}: open fds {fa} -> {fb}")
    p50a = [s["p50_s"] for s in early if s["p50_s"] is not None]
    p50b = [s["p50_s"] for s in late if s["p50_s"] is not None]
    if p50a and p50b and statistics.median(p50b) > max_latency_growth * statistics.median(p50a):
        problems.append(f"p50 latency {statistics.median(p50a):.2f} -> {statistics.median(p50b):.2f} s")
    errors = sum(s["errors"] for s in samples)
    if errors:
        problems.append(f"{errors} requests failed (5xx, stream errors or connection errors)")
    return problems


def _plot(samples: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = samples[0]["t"]
    minutes = [(s["t"] - t0) / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    for name in samples[0]["rss_mb"]:
        axes[0].plot(minutes, [s["rss_mb"].get(name) for s in samples], label=name)
        axes[1].plot(minutes, [s["fds"].get(name) for s in samples], label=name)
    axes[2].plot(minutes, [s["used_blocks"] for s in samples])
    axes[3].plot(minutes, [s["p50_s"] for s in samples], label="p50")
    axes[3].plot(minutes, [s["p99_s"] for s in samples], label="p99")
    for ax, title in zip(
        axes, ("RSS (MB)", "open fds", "used KV blocks (all nodes)", "latency (s)"), strict=True
    ):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[3].legend(fontsize=7)
    axes[3].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop clients when measuring")
    parser.add_argument("--calibrate-s", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument(
        "--up-args",
        default="",
        help='more `pdserve up` flags, e.g. "--node-args=--kv-cache-memory-mb=64"',
    )
    parser.add_argument(
        "--max-latency-growth", type=float, default=2.0, help="fail when p50 latency grows more than this"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "soak")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    up, url = _start_cluster(args)
    stop_problem = None
    try:
        model = _model_name(url)
        capacity = asyncio.run(_capacity(url, model, args.concurrency, args.calibrate_s, args.seed))
        rate = max(0.05, args.load * capacity)
        print(
            f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for {args.minutes:g} min", flush=True
        )
        procs = _processes(up)
        samples, record = asyncio.run(
            _soak(url, model, rate, 60 * args.minutes, procs, args.sample_s, args.seed)
        )
        deadline = time.monotonic() + 30
        while _sample(url, procs, [], 0)["used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.5)
        final = _sample(url, procs, [], 0)
    finally:
        # SIGTERM, not SIGINT: a shell that starts a job in the background has it ignore SIGINT.
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            stop_problem = "pdserve up did not stop within 60 s of SIGTERM"
            up.kill()  # its nodes die with it (PR_SET_PDEATHSIG)
            up.wait(10)
    problems = (
        _growth(samples, args.max_latency_growth) if len(samples) >= 4 else ["too few samples: run longer"]
    )
    if stop_problem:
        problems.append(stop_problem)
    if final["used_blocks"]:
        problems.append(f"{final['used_blocks']} KV blocks still held 30 s after the load stopped")
    summary = {
        "capacity_req_s": capacity,
        "rate_req_s": rate,
        "minutes": args.minutes,
        "requests": len(record),
        "ok": sum(1 for r in record if r[2] == "ok"),
        "problems": problems,
    }
    (args.out / "soak.json").write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    if samples:
        _plot(samples, args.out / "soak.png")
    print(json.dumps(summary, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
