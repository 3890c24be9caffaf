"""PNG plots of a bench: latency CDFs per run, throughput and goodput against the request rate.

matplotlib is an optional dependency (``pip install 'pdserve[bench]'``); it is imported here only.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence

from pdserve.bench_serve.records import RequestRecord
from pdserve.bench_serve.report import RunReport

LATENCIES = (  # title, the values of one record
    ("TTFT", lambda r: [r.ttft_s] if r.ttft_s is not None else []),
    ("TPOT", lambda r: [r.tpot_s] if r.tpot_s is not None else []),
    ("ITL", lambda r: r.itl_s),
    ("end-to-end", lambda r: [r.e2e_s] if r.e2e_s is not None else []),
)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'pdserve[bench]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(out_dir: pathlib.Path, runs: Sequence[RunReport]) -> list[pathlib.Path]:
    """``latency_cdf.png`` always; ``throughput_vs_rate.png`` when the runs had finite rates."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_latency_cdfs(out_dir / "latency_cdf.png", runs)]
    if any(not math.isinf(run.request_rate) for run in runs):
        paths.append(_throughput_vs_rate(out_dir / "throughput_vs_rate.png", runs))
    return paths


def _cdf(records: Sequence[RequestRecord], values_of) -> tuple[list[float], list[float]]:
    values = sorted(v * 1e3 for r in records if r.ok for v in values_of(r))
    return values, [(i + 1) / len(values) for i in range(len(values))]


def _latency_cdfs(path: pathlib.Path, runs: Sequence[RunReport]) -> pathlib.Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, values_of) in zip(axes.flat, LATENCIES, strict=True):
        for run in runs:
            xs, ys = _cdf(run.result.records, values_of)
            if xs:
                ax.step(xs, ys, where="post", label=run.label)
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _throughput_vs_rate(path: pathlib.Path, runs: Sequence[RunReport]) -> pathlib.Path:
    plt = _pyplot()
    finite = sorted(
        (run for run in runs if not math.isinf(run.request_rate)), key=lambda run: run.request_rate
    )
    rates = [run.request_rate for run in finite]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(rates, [run.summary.request_throughput for run in finite], "o-", label="completed")
    left.plot(rates, [run.summary.goodput for run in finite], "s--", label="goodput (met the SLO)")
    left.plot(rates, rates, ":", color="grey", label="offered")
    left.set(title="requests per second", xlabel="request rate (req/s)", ylabel="req/s")
    left.legend(fontsize="small")
    right.plot(rates, [run.summary.output_throughput for run in finite], "o-")
    right.set(title="output tokens per second", xlabel="request rate (req/s)", ylabel="tok/s")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
