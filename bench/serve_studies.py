"""Serving studies: `pdserve up` in a given shape, `pdserve bench serve` against it, a table per study.

    .venv/bin/python bench/serve_studies.py check --calibrate   # calibrate, measure, calibrate again, predict
    .venv/bin/python bench/serve_studies.py colocated --profile-1t p1.json --profile-2t p2.json
    .venv/bin/python bench/serve_studies.py ratio        # P:D 1:1, 1:2, 2:1
    .venv/bin/python bench/serve_studies.py overload --ttft-slo-ms 4000 --tpot-slo-ms 250
        # 1P+1D and 1 colocated past capacity, with and without the router's SLO flags
        # (--only "1P+1D, SLO flags" "1 colocated, SLO flags": some points alone)
    .venv/bin/python bench/serve_studies.py prefix       # prefix caching / prefix-aware routing on and off
    .venv/bin/python bench/serve_studies.py vllm --vllm-python /work/vllm-venv/bin/python   # 1P+1D vs vLLM, 2 cores
    .venv/bin/python bench/serve_studies.py load --vllm-python /work/vllm-venv/bin/python --rounds 3
        # the same servers (and 1P+1D without local prefill) at 2, 4 and 8 req/s, 48 requests a rate
    .venv/bin/python bench/serve_studies.py int8 --vllm-python /work/vllm-venv/bin/python
        # 1P+1D and 1 colocated with and without --quantization int8, and vLLM in bf16, 1-4 req/s
    .venv/bin/python bench/serve_studies.py speculative --vllm-python /work/vllm-venv/bin/python
        # 1P+1D without and with --speculative ngram (and with the int8 KV cache too), and vLLM, on the
        # rep trace (edit/quote prompts)
    .venv/bin/python bench/serve_studies.py autoscale --ttft-slo-ms 4000 --tpot-slo-ms 250 --profile-1t p1.json
        # 1P+1D, 2 colocated, 1 colocated of 2 threads and pdserve up --autoscale, 0.25-2 req/s

Every point starts a fresh cluster (default model, cores split evenly between its nodes), runs the
workload at each rate (run k uses seed + k, fresh prompts), and stops the cluster. Where a profile
for the nodes' thread count is given, the point's prediction by `pdserve plan simulate` is shown
beside it. Results (every summary, the tables) go to --out-dir. ``check --calibrate`` measures a
1-thread profile right before and right after the measured runs and shows both predictions: on a
shared machine the gap between the two is the drift of the machine itself. The points of every
study are in bench/serve_points.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serve_points import Point, rep_trace, studies  # noqa: E402
from serve_servers import Up, VllmServer  # noqa: E402

from pdserve.bench_serve.metrics import Slo  # noqa: E402
from pdserve.bench_serve.spec import WorkloadKind, WorkloadSpec  # noqa: E402
from pdserve.bench_serve.workload import PromptStyle  # noqa: E402
from pdserve.launcher.commands import pdserve_argv  # noqa: E402
from pdserve.launcher.plan import threads_per_node, usable_cores  # noqa: E402
from pdserve.planner.predict import predict, sim_requests  # noqa: E402
from pdserve.planner.profile import Profile  # noqa: E402


def workload_flags(workload: dict) -> list[str]:
    flags = ["--workload", workload["kind"]]
    for key, value in workload.items():
        if key != "kind":
            flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def workload_spec(workload: dict) -> WorkloadSpec:
    fields = {k: v for k, v in workload.items() if k != "kind"}
    return WorkloadSpec(WorkloadKind(workload["kind"]), PromptStyle.TOKEN_IDS, **fields)


def measure(
    point: Point,
    out_dir: pathlib.Path,
    slo: Slo,
    vllm_python: str | None = None,
    warmup: int = 0,
    profile: pathlib.Path | None = None,
) -> list[dict]:
    """One summary per rate, as `pdserve bench serve` wrote it, with the server's engine steps
    during the run under ``server_steps`` (none for vLLM)."""
    if point.vllm and not vllm_python:
        raise SystemExit("the vllm study needs --vllm-python PATH (a venv with vLLM's CPU build)")
    if point.vllm:
        up = VllmServer(vllm_python, out_dir / "logs", point.node_args)
    else:
        extra: tuple[str, ...] = ()
        if point.slo_flags or point.autoscale:
            extra = ("--ttft-slo-s", f"{slo.ttft_s:g}", "--tpot-slo-s", f"{slo.tpot_s:g}")
        if point.autoscale:
            if profile is None:
                raise SystemExit("an autoscaled point needs --profile-1t PATH (pdserve plan calibrate)")
            extra = ("--autoscale", "--autoscale-profile", str(profile), *extra)
        extra += point.flags
        up = Up(point.cluster, out_dir / "logs", point.node_args, point.router_args, point.threads, extra)
    try:
        up.wait_up()
        if not point.vllm:  # vLLM commits its KV cache before it answers
            print(up.settle_kv_pools(), flush=True)
        result = out_dir / "bench.json"
        cmd = [
            *pdserve_argv("bench", "serve"),
            "--base-url",
            up.url,
            "--no-progress",
            "--request-rate",
            ",".join(f"{r:g}" for r in point.rates),
            "--result-json",
            str(result),
            "--ttft-slo-ms",
            f"{slo.ttft_s * 1e3:g}",
            "--tpot-slo-ms",
            f"{slo.tpot_s * 1e3:g}",
            "--warmup-requests",
            str(warmup),
            *workload_flags(point.workload),
        ]
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        runs = json.loads(result.read_text())["runs"]
        return [{**run["summary"], "server_steps": run.get("server_steps", [])} for run in runs]
    finally:
        up.stop()


def predicted(point: Point, profiles: dict[int, Profile], slo: Slo) -> list[dict | None]:
    threads = point.threads or threads_per_node(usable_cores(), point.cluster.num_nodes)
    profile = profiles.get(threads)
    if (
        profile is None or point.vllm or point.autoscale or point.cluster.num_nodes > usable_cores()
    ):  # shared cores, or a shape that changes: not modelled
        return [None] * len(point.rates)
    spec = workload_spec(point.workload)
    flags = point.slo_flags or "--ttft-slo-s" in point.router_args  # the cluster runs with the SLO flags
    return [
        dataclasses.asdict(
            predict(profile, point.cluster, sim_requests(spec.build(k), rate, 1.0, k), slo, flags)
        )
        for k, rate in enumerate(point.rates)
    ]


def calibrate(path: pathlib.Path, busy_neighbours: int = 0) -> Profile:
    """`pdserve plan calibrate` of the default model with one thread, in a child process."""
    cmd = [
        *pdserve_argv("plan", "calibrate"),
        "--threads",
        "1",
        "--repeats",
        "3",
        "--out",
        str(path),
        "--busy-neighbours",
        str(busy_neighbours),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return Profile.load(path)


def row(label: str, rate: float, s: dict) -> str:
    def ms(stats: dict | None, key: str) -> str:
        return f"{stats[key] * 1e3:.0f}" if stats else "-"

    return (
        f"| {label} | {rate:g} | {s['num_ok']}/{s['num_sent']} | {s['request_throughput']:.3f} | "
        f"{s['output_throughput']:.1f} | {ms(s['ttft'], 'p50')} | {ms(s['ttft'], 'p99')} | {ms(s['tpot'], 'p50')} | "
        f"{ms(s['tpot'], 'p99')} | {s['goodput']:.3f} | {s['total_cached_tokens']} | {steps_cell(s)} |"
    )


def steps_cell(s: dict) -> str:
    """The server's mean engine step by role and kind, e.g. "colocated decode 36, mixed 191"."""
    by_role: dict[str, list[str]] = {}
    for line in s.get("server_steps") or []:
        by_role.setdefault(line["role"], []).append(
            f"{line['kind']} {line['seconds'] / line['steps'] * 1e3:.0f}"
        )
    return "; ".join(f"{role} {', '.join(kinds)}" for role, kinds in by_role.items()) or "-"


HEADER = (
    "| point | req/s offered | ok | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
    "| goodput req/s | cached prompt tokens | mean engine step ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", choices=sorted(studies()))
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("serve-studies"))
    parser.add_argument(
        "--profile-1t", type=pathlib.Path, default=None, help="profile calibrated with 1 thread"
    )
    parser.add_argument(
        "--profile-2t", type=pathlib.Path, default=None, help="profile calibrated with 2 threads"
    )
    parser.add_argument(
        "--vllm-python", default=None, help="the vllm study: python of a venv with vLLM's CPU build"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure a 1-thread profile before the study and after each point (about 1 min each)",
    )
    parser.add_argument("--busy-neighbours", type=int, default=0, help="--calibrate: plan calibrate's flag")
    parser.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=300.0)
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="bench serve's: requests each server gets before its first rate, not counted",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the study's points this many times, in turn (noisy machines)",
    )
    parser.add_argument(
        "--only", nargs="+", default=None, metavar="LABEL", help="run only the points of these labels"
    )
    parser.add_argument(
        "--rates", type=float, nargs="+", default=None, help="run only these of the points' rates"
    )
    args = parser.parse_args()
    if args.study == "speculative":
        rep_trace()
    slo = Slo(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    profiles = {t: Profile.load(p) for t, p in ((1, args.profile_1t), (2, args.profile_2t)) if p is not None}
    out_dir = args.out_dir / args.study
    if args.calibrate:
        profiles[1] = calibrate(out_dir / "profile-before.json", args.busy_neighbours)
    lines, results = [HEADER], []
    points = [p for p in studies()[args.study] if args.only is None or p.label in args.only]
    if args.rates is not None:
        points = [dataclasses.replace(p, rates=tuple(r for r in p.rates if r in args.rates)) for p in points]
        points = [p for p in points if p.rates]
    if args.rounds > 1:
        points = [
            dataclasses.replace(p, label=f"{p.label} (round {k + 1})")
            for k in range(args.rounds)
            for p in points
        ]
    for i, point in enumerate(points):
        started = time.monotonic()
        measured = measure(
            point, out_dir / f"point{i}", slo, args.vllm_python, args.warmup_requests, args.profile_1t
        )
        after = (
            {1: calibrate(out_dir / f"profile-after{i}.json", args.busy_neighbours)} if args.calibrate else {}
        )
        predictions = {"predicted": predicted(point, profiles, slo)}
        if after:
            predictions = {
                "predicted, profile before": predictions["predicted"],
                "predicted, profile after": predicted(point, after, slo),
            }
        for k, (rate, m) in enumerate(zip(point.rates, measured, strict=True)):
            lines.append(row(point.label, rate, m))
            for name, preds in predictions.items():
                if preds[k] is not None:
                    lines.append(row(f"{point.label} ({name})", rate, preds[k]))
            results.append(
                {
                    "point": point.label,
                    "rate": rate,
                    "measured": m,
                    **{name: preds[k] for name, preds in predictions.items()},
                }
            )
        print(f"{point.label}: {time.monotonic() - started:.0f} s", flush=True)
    table = "\n".join(lines)
    print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
