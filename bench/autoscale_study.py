"""`pdserve up --autoscale` against fixed splits at equal cores, under a load that shifts.

    .venv/bin/python bench/autoscale_study.py --out-dir /tmp/autoscale [--phase-s 60] [--profile FILE]

One seeded trace of the default model, its phases one after the other (PHASES): prefill-heavy
(long prompts, few tokens out), decode-heavy (short prompts, long outputs), long prompts with long
outputs, prefill-heavy again.
It runs, one server after the other on a quiet machine, against `pdserve up` in each shape of
SHAPES: the autoscaled cluster (starting 1P+1D or 2 colocated, a budget of 2 nodes) and the fixed splits of 2
nodes, each node a thread, every one with the same SLO flags (the router sheds by them). For
each: the share of requests within both SLOs (a shed or failed request is a miss) per window of
--window-s by send time and per phase, the pool's shape over time (the router's /admin/nodes,
polled), and for the autoscaled cluster the planner's predicted share for the shape it ran
beside the measured one. Writes results.json and autoscale.png in --out-dir, and prints a
markdown table.

The profile the autoscaler decides with is calibrated once (`pdserve plan calibrate`, one thread
and one busy neighbour, as `pdserve up --autoscale` would at launch) unless --profile gives one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.serve_servers import Up  # noqa: E402
from pdserve.bench_serve.client import Api, Endpoint  # noqa: E402
from pdserve.bench_serve.runner import Limits, run  # noqa: E402
from pdserve.bench_serve.workload import WorkItem  # noqa: E402
from pdserve.launcher.commands import pdserve_argv  # noqa: E402
from pdserve.planner.simulate import Cluster  # noqa: E402


@dataclasses.dataclass(frozen=True, slots=True)
class Phase:
    name: str
    rate: float  # requests per second (Poisson)
    prompt_len: tuple[int, int]  # uniform range, tokens
    output_len: tuple[int, int]


# On the 2026-12-05 profile (one thread, a busy neighbour) the planner's best 2-node shape is
# 2 colocated for the first phase, 1 colocated (fewer nodes) for the second, 1P+1D or 2 colocated
# for the third (long prompts and long outputs), and 2 colocated for the last.
PHASES = (
    Phase("prefill-heavy", 0.6, (384, 768), (2, 6)),
    Phase("decode-heavy", 0.8, (16, 48), (96, 160)),
    Phase("long in, long out", 0.45, (384, 768), (64, 128)),
    Phase("prefill-heavy", 0.6, (384, 768), (2, 6)),
)
TTFT_SLO_S, TPOT_SLO_S = 4.0, 0.25
SLO_FLAGS = ("--ttft-slo-s", f"{TTFT_SLO_S:g}", "--tpot-slo-s", f"{TPOT_SLO_S:g}")


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    label: str
    cluster: Cluster  # the shape it starts in
    autoscale: bool = False
    flags: tuple[str, ...] = ()  # more `pdserve up` flags


SHAPES = (
    # stops a node in a lull (--min-nodes defaults to the nodes started since 2026-12-05 evening)
    Shape("autoscaled (starts 1P+1D)", Cluster(1, 1), autoscale=True, flags=("--min-nodes", "1")),
    # at equal cores a node stopped leaves its core idle: this one keeps both nodes
    Shape("autoscaled, --min-nodes 2", Cluster(1, 1), autoscale=True, flags=("--min-nodes", "2")),
    # pdserve up --autoscale's own start without shape flags (pdserve.cli.up_slo.start_shape)
    Shape(
        "autoscaled, starts 2 colocated, --min-nodes 1",
        Cluster(0, 0, 2),
        autoscale=True,
        flags=("--min-nodes", "1"),
    ),
    Shape(  # pdserve up --autoscale's defaults
        "autoscaled, starts 2 colocated, --min-nodes 2",
        Cluster(0, 0, 2),
        autoscale=True,
        flags=("--min-nodes", "2"),
    ),
    Shape("fixed 1P+1D", Cluster(1, 1)),
    Shape("fixed 2 colocated", Cluster(0, 0, 2)),
)


def trace(phase_s: float, seed: int = 0) -> list[tuple[WorkItem, str]]:
    """The requests with their send times and phase names, seeded."""
    rng, items, start = random.Random(seed), [], 0.0
    for phase in PHASES:
        t = start + rng.expovariate(phase.rate)
        while t < start + phase_s:
            prompt = tuple(rng.randrange(100, 40000) for _ in range(rng.randint(*phase.prompt_len)))
            items.append((WorkItem(prompt, rng.randint(*phase.output_len), round(t, 3)), phase.name))
            t += rng.expovariate(phase.rate)
        start += phase_s
    return items


class ShapePoller:
    """The roles the router routes to (draining nodes left out), every second, in a thread."""

    def __init__(self, url: str) -> None:
        self.url, self.samples, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.start = time.perf_counter()

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            try:
                nodes = httpx.get(self.url + "/admin/nodes", timeout=5).json()["nodes"]
            except (httpx.HTTPError, ValueError):
                continue
            roles = [n["role"] for n in nodes if not n["draining"]]
            counts = {r: roles.count(r) for r in ("prefill", "decode", "colocated")}
            self.samples.append((round(time.perf_counter() - self.start, 1), counts))

    def __enter__(self) -> ShapePoller:
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def within_slo(record) -> bool:
    tpot = record.tpot_s
    return bool(record.ok and record.ttft_s <= TTFT_SLO_S and (tpot is None or tpot <= TPOT_SLO_S))


def measure(
    shape: Shape, items: list[tuple[WorkItem, str]], out: pathlib.Path, profile: pathlib.Path
) -> dict:
    extra = (*SLO_FLAGS, *shape.flags)
    if shape.autoscale:
        extra += ("--autoscale", "--autoscale-profile", str(profile))
    up = Up(shape.cluster, out / "logs", extra=extra)
    try:
        up.wait_up()
        print(up.settle_kv_pools(), flush=True)
        model = httpx.get(up.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        endpoint = Endpoint(up.url, Api.COMPLETIONS, model)
        work = [item for item, _ in items]
        with ShapePoller(up.url) as poller:
            run_started_at = time.time()
            result = run(work, [i.arrival_s for i in work], endpoint, Limits(drain_s=120.0), progress=False)
        decisions = []
        log = out / "logs" / "autoscale.log"
        if log.exists():
            decisions = [json.loads(line) for line in log.read_text().splitlines()]
    finally:
        up.stop()
    phase_of = [name for _, name in items]
    requests = [
        {
            "sent_s": r.sent_s,
            "phase": phase_of[r.index],
            "met": within_slo(r),
            "ok": r.ok,
            "error": r.error_kind,
            "ttft_s": r.ttft_s,
            "tpot_s": r.tpot_s,
        }
        for r in result.records
    ]
    return {
        "label": shape.label,
        "requests": requests,
        "shapes": poller.samples,
        "decisions": decisions,
        "run_started_at": run_started_at,
    }


def attainment(requests: list[dict], key) -> dict:
    groups: dict = {}
    for r in requests:
        groups.setdefault(key(r), []).append(r["met"])
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def predicted_by_phase(run_result: dict, phase_s: float) -> dict[int, float]:
    """The planner's predicted share within the SLOs for the shape the autoscaler ran, averaged
    over the decisions made in each phase (by the decision's wall-clock time from the run's start)."""
    by_phase: dict[int, list[float]] = {}
    for d in run_result["decisions"]:
        if d.get("event") != "decision" or d["current"] not in d["predicted_slo_fraction"]:
            continue
        phase = int((d["time"] - run_result["run_started_at"]) // phase_s)
        if 0 <= phase < len(PHASES):
            by_phase.setdefault(phase, []).append(d["predicted_slo_fraction"][d["current"]])
    return {p: statistics.mean(v) for p, v in sorted(by_phase.items())}


def plot(results: list[dict], phase_s: float, window_s: float, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for res in results:
        windows = attainment(res["requests"], lambda r: int(r["sent_s"] // window_s))
        xs = [(w + 0.5) * window_s for w in windows]
        bottom.plot(xs, [100 * v for v in windows.values()], marker="o", label=res["label"])
    auto = next((r for r in results if r["label"].startswith("autoscaled")), None)
    if auto is None:
        return
    times = [t for t, _ in auto["shapes"]]
    for role, lift in (("prefill", 0.04), ("decode", 0.0), ("colocated", -0.04)):  # apart where equal
        counts = [c[role] + lift for _, c in auto["shapes"]]
        top.step(times, counts, where="post", label=f"{role} nodes")
    for k in range(1, len(PHASES)):
        for ax in (top, bottom):
            ax.axvline(k * phase_s, color="grey", lw=0.8, ls="--")
    for k, phase in enumerate(PHASES):
        top.text((k + 0.5) * phase_s, 2.15, phase.name, ha="center", fontsize=8)
    top.set_ylabel(f"pool: {auto['label']}", fontsize=8)
    top.set_ylim(-0.1, 2.4)
    top.legend(loc="center right", fontsize=8)
    bottom.set_ylabel(f"% within SLO ({window_s:g} s windows)")
    bottom.set_xlabel("seconds (by send time)")
    bottom.set_ylim(-5, 105)
    bottom.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def calibrate(out: pathlib.Path) -> pathlib.Path:
    path = out / "profile.json"
    argv = pdserve_argv("plan", "calibrate", "--threads", "1", "--busy-neighbours", "1", "--out", str(path))
    subprocess.run(argv, cwd=ROOT, check=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=pathlib.Path, required=True)
    parser.add_argument("--phase-s", type=float, default=75.0, help="seconds of each phase")
    parser.add_argument("--window-s", type=float, default=20.0, help="SLO attainment windows")
    parser.add_argument("--profile", type=pathlib.Path, help="the planner's profile (default: calibrate)")
    parser.add_argument("--only", nargs="*", help="shape labels to run (default: all)")
    parser.add_argument(
        "--with-results",
        type=pathlib.Path,
        help="an earlier run's results.json: its other shapes join the table",
    )
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    profile = args.profile or calibrate(args.out_dir)
    items = trace(args.phase_s)
    print(f"{len(items)} requests over {len(PHASES) * args.phase_s:.0f} s", flush=True)
    results = []
    for k, shape in enumerate(s for s in SHAPES if not args.only or s.label in args.only):
        res = measure(shape, items, args.out_dir / f"shape{k}", profile)
        res["predicted_by_phase"] = predicted_by_phase(res, args.phase_s)
        results.append(res)
        print(
            json.dumps({"label": res["label"], "overall": attainment(res["requests"], lambda r: 0)}),
            flush=True,
        )
    if args.with_results:
        ran = {r["label"] for r in results}
        earlier = json.loads(args.with_results.read_text())
        for res in earlier:
            res["predicted_by_phase"] = {int(k): v for k, v in (res.get("predicted_by_phase") or {}).items()}
        results += [r for r in earlier if r["label"] not in ran]
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.phase_s, args.window_s, args.out_dir / "autoscale.png")
    print(table(results, args.phase_s))


def node_seconds(samples: list[tuple[float, dict]]) -> float:
    """Seconds of routable nodes over the run, from the poller's samples (each held to the next)."""
    return sum((b[0] - a[0]) * sum(a[1].values()) for a, b in zip(samples, samples[1:], strict=False))


def table(results: list[dict], phase_s: float) -> str:
    head = " | ".join(f"{p.name} ({k * phase_s:.0f}-{(k + 1) * phase_s:.0f} s)" for k, p in enumerate(PHASES))
    lines = [f"| shape | {head} | all | node-seconds |", "|---" * (len(PHASES) + 3) + "|"]
    for res in results:
        by_phase = attainment(res["requests"], lambda r: int(r["sent_s"] // phase_s))
        cells = [f"{100 * by_phase.get(k, 0):.0f}%" for k in range(len(PHASES))]
        overall = attainment(res["requests"], lambda r: 0)[0]
        used = node_seconds(res["shapes"])
        lines.append(f"| {res['label']} | {' | '.join(cells)} | **{100 * overall:.0f}%** | {used:.0f} |")
        predicted = res.get("predicted_by_phase") or {}
        if predicted:
            cells = [f"{100 * predicted[k]:.0f}%" if k in predicted else "-" for k in range(len(PHASES))]
            lines.append(f"| planner's prediction for the shape it ran | {' | '.join(cells)} | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
