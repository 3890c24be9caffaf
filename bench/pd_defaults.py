"""PD against colocated at equal cores, each with the defaults `pdserve up` gives, past capacity,
driven by vLLM's own benchmark client (issue 53, item 6).

Each shape is a fresh `pdserve up` on the default model (its dtype, threads, pools, registry and
SLO defaults as a new user gets them). vLLM's client (from its own venv, run outside the project)
sends ``--num-prompts`` random-token prompts of 256-768 tokens (``--random-input-len 512
--random-range-ratio 0.5``; the same ratio makes the outputs 32-96 tokens, ``--ignore-eos``) at
each Poisson rate, a fresh seed per rate, and scores goodput against TTFT <= 4 s and TPOT <= 250 ms.
The router's ``pdserve_routes_total`` says where prompts were prefilled. Each row also splits the
server's CPU time over the point by process (psutil): the front end (pdserve's router, vLLM's API
server: HTTP, validation, tokenization, detokenization, SSE), the nodes or vLLM's engine core, and
the launcher; the front end's share per request is the router's own overhead.

    .venv/bin/python bench/pd_defaults.py --vllm-python /work/vllm-venv/bin/python
    .venv/bin/python bench/pd_defaults.py --vllm-python ... --shapes "pd:" "pd-no-guard:--tpot-slo-s 0"
    .venv/bin/python bench/pd_defaults.py --vllm-python ... --shapes "1P+1D:" "vLLM:--dtype bfloat16" --rates 1,2

A label that starts with "vLLM" starts vLLM's OpenAI server instead (its CPU build, every core;
the flags go to it, after ``--dtype float32``), serving the model under the same name.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from serve_crosscheck import VLLM_CLIENT, child_result  # noqa: E402
from serve_servers import VllmServer  # noqa: E402

ROUTES = re.compile(r'^pdserve_routes_total\{prefill="([a-z_]+)"\} (\S+)', re.M)


def start(flags: str, port: int, log: pathlib.Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(port), *shlex.split(flags)]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.loads(r.read()).get("status") in ("ok", "decode_only", "colocated"):
                    return proc
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("pdserve up did not come up")


def cpu_by_role(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's processes, by role: "front" (pdserve's
    router or vLLM's API server), "engine" (nodes and their ranks, or vLLM's engine core), "other"."""
    import psutil

    root = psutil.Process(root_pid)
    vllm = "vllm.entrypoints" in " ".join(root.cmdline())
    totals: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            argv, cpu = proc.cmdline(), proc.cpu_times()
        except psutil.Error:
            continue
        head = argv[:4]  # pdserve's children: python -m pdserve ROLE ...
        if "router" in head or (vllm and proc.pid == root_pid):
            role = "front"
        elif "prefill" in head or "decode" in head or vllm:
            role = "engine"  # a node, or anything vLLM's API server started (its engine core)
        else:
            role = "other"
        totals[role] = totals.get(role, 0.0) + cpu.user + cpu.system
    return totals


def routes(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {k: int(float(v)) for k, v in ROUTES.findall(text)}


def bench(args, port: int, rate: float, seed: int, tmp: pathlib.Path) -> dict:
    script = tmp / "vllm_client.py"
    script.write_text(VLLM_CLIENT)
    cmd = [
        args.vllm_python, str(script), "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions", "--model", "smollm2-135m-instruct", "--tokenizer", str(args.tokenizer),
        "--dataset-name", "random", "--random-input-len", "512", "--random-range-ratio", "0.5",
        "--random-output-len", "64", "--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
        "--ignore-eos", "--seed", str(seed), "--goodput", "ttft:4000", "tpot:250",
        "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99",
    ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=tmp, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    return child_result(done, "vLLM's client")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=["1P+1D:", "1 colocated:--colocated 1"],
        metavar="LABEL:FLAGS",
        help="each a label and `pdserve up` flags (default: both shapes with no other flag)",
    )
    ap.add_argument("--rates", default="0.5,1")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from pdserve.engine.model_fetch import fetch_default_model
    from pdserve.launcher.ports import free_port

    args.tokenizer = fetch_default_model(progress=False)
    print(
        "| shape | req/s | completed | goodput req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | prefilled where "
        "| CPU s: front end / engine / other | front end ms a request |",
        flush=True,
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for shape in args.shapes:
        label, flags = shape.split(":", 1)
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = pathlib.Path(tmp_name)
            vllm, proc = None, None
            if label.startswith("vLLM"):
                vllm = VllmServer(args.vllm_python, tmp, f"{flags} --served-model-name smollm2-135m-instruct")
                vllm.wait_up()
                port = vllm.port
            else:
                port = free_port()
                proc = start(flags, port, tmp / "up.log")
            try:
                for k, rate in enumerate(float(r) for r in args.rates.split(",")):
                    before = {} if vllm else routes(port)
                    server_pid = (vllm.proc if vllm else proc).pid
                    cpu0 = cpu_by_role(server_pid)
                    r = bench(args, port, rate, args.seed + k, tmp)
                    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_by_role(server_pid).items()}
                    after = {} if vllm else routes(port)
                    where = ", ".join(
                        f"{n} {after[n] - before.get(n, 0)}"
                        for n in sorted(after)
                        if after[n] > before.get(n, 0)
                    )
                    print(
                        f"| {label} | {rate:g} | {r['completed']}/{args.num_prompts} | {r.get('request_goodput', 0):.3f} | "
                        f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                        f"{r['median_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | {where} | "
                        f"{cpu.get('front', 0):.1f} / {cpu.get('engine', 0):.1f} / {cpu.get('other', 0):.1f} | "
                        f"{1000 * cpu.get('front', 0) / max(1, r['completed']):.1f} |",
                        flush=True,
                    )
            finally:
                if vllm is not None:
                    vllm.stop()
                else:
                    os.killpg(proc.pid, signal.SIGINT)
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
