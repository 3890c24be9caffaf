"""bench/plot_results.py draws the results page's plots from a serve_studies output directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")


def _record(i: int, ttft: float, tokens: int, ok: bool = True) -> dict:
    return {"index": i, "ok": ok, "ttft_s": ttft if ok else None, "e2e_s": ttft + 0.1 * tokens if ok else None,
            "event_tokens": [1] * tokens if ok else []}  # fmt: skip


@pytest.mark.usefixtures("processes")
def test_plots_come_from_the_study_directory(tmp_path):
    study = tmp_path / "vllm"
    results = []
    for i, label in enumerate(("pdserve 1P+1D mix", "vLLM server (2 cores) mix")):
        runs = []
        for rate in (0.5, 1.0):
            records = [_record(k, 0.2 + 0.01 * k + i, 8) for k in range(5)] + [_record(5, 0, 0, ok=False)]
            summary = {"goodput": rate * 0.9, "output_throughput": 20.0 * rate + i}
            runs.append({"request_rate": rate, "summary": summary, "records": records})
            results.append({"point": label, "rate": rate})
        (study / f"point{i}").mkdir(parents=True)
        (study / f"point{i}" / "bench.json").write_text(json.dumps({"runs": runs}))
    (study / "results.json").write_text(json.dumps(results))
    out = tmp_path / "plots"
    run = subprocess.run(
        [sys.executable, "bench/plot_results.py", str(study), "--rate", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    for name in ("goodput_vs_rate.png", "latency_cdf.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
