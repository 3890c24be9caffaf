"""The results page's plots, from a `bench/serve_studies.py` output directory.

    .venv/bin/python bench/plot_results.py /tmp/pdserve-studies/vllm --rate 1 --out bench/plots
    .venv/bin/python bench/plot_results.py /tmp/studies/autoscale --rate 1 --out bench/plots --prefix autoscale_

Each point of the study (one server shape: pdserve 1P+1D, pdserve colocated, vLLM) left a
``point<i>/bench.json`` of `pdserve bench serve`'s runs, one per request rate. This draws
- ``goodput_vs_rate.png``: goodput (requests that met both SLOs, per second) and output tok/s
  against the offered rate, one line per server;
- ``latency_cdf.png``: TTFT and TPOT distributions of every server at ``--rate``.

matplotlib comes with ``pip install 'pdserve[bench]'``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(study: pathlib.Path) -> list[tuple[str, list[dict]]]:
    """(server label, its runs) per point, in the study's order."""
    table = json.loads((study / "results.json").read_text())
    labels = list(dict.fromkeys(r["point"] for r in table))
    points = sorted(study.glob("point*/bench.json"), key=lambda p: int(p.parent.name[5:]))
    return [(label, json.loads(p.read_text())["runs"]) for label, p in zip(labels, points, strict=True)]


def _tpot(record: dict) -> float | None:
    n = sum(record["event_tokens"])
    if not record["ok"] or record["ttft_s"] is None or n < 2:
        return None
    return (record["e2e_s"] - record["ttft_s"]) / (n - 1)


def goodput_vs_rate(points, path: pathlib.Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, runs in points:
        rates = [r["request_rate"] for r in runs]
        left.plot(rates, [r["summary"]["goodput"] for r in runs], "o-", label=label)
        right.plot(rates, [r["summary"]["output_throughput"] for r in runs], "o-", label=label)
    top = max(r["request_rate"] for _, runs in points for r in runs)
    left.plot([0, top], [0, top], ":", color="grey", label="offered")
    left.set(title="goodput (met TTFT and TPOT SLOs)", xlabel="offered req/s", ylabel="req/s")
    right.set(title="output tokens per second", xlabel="offered req/s", ylabel="tok/s")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def latency_cdf(points, rate: float, path: pathlib.Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, runs in points:
        run = next(r for r in runs if r["request_rate"] == rate)
        records = run["records"]
        for ax, values in (
            (axes[0], [r["ttft_s"] for r in records if r["ok"] and r["ttft_s"] is not None]),
            (axes[1], [t for t in map(_tpot, records) if t is not None]),
        ):
            xs = sorted(v * 1e3 for v in values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    for ax, title in zip(axes, ("TTFT", "TPOT"), strict=True):
        ax.set(title=f"{title} at {rate:g} req/s", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=pathlib.Path, help="a serve_studies output directory, e.g. .../vllm")
    ap.add_argument("--rate", type=float, default=1.0, help="the rate whose latencies are drawn")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "plots")
    ap.add_argument("--prefix", default="", help="before each file's name (another study's plots)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    points = load(args.study)
    goodput, latency = (
        args.out / f"{args.prefix}goodput_vs_rate.png",
        args.out / f"{args.prefix}latency_cdf.png",
    )
    goodput_vs_rate(points, goodput)
    latency_cdf(points, args.rate, latency)
    print(f"wrote {goodput} and {latency}")


if __name__ == "__main__":
    main()
