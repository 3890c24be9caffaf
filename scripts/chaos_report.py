"""Run the chaos suite (every case, ``-m "chaos or not chaos"``) and write its table into
docs/reliability.md: each fault, where it was injected, the requests sent and in flight at the
fault, how they ended, the blocks left held afterwards. Each case writes its row as JSON lines to
$PDSERVE_CHAOS_REPORT (tests/chaos/load.py write_report_row).

    python -m scripts.chaos_report [--out docs/reliability.md] [pytest args...]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- chaos-table:begin -->", "<!-- chaos-table:end -->"
COMMAND = 'make chaos-report   # = python -m scripts.chaos_report: pytest tests/chaos -m "chaos or not chaos"'


def table(rows: list[dict]) -> str:
    lines = [
        "| fault | injected at | requests (in flight at the fault) | how they ended | blocks leaked |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ended = ", ".join(f"{k}: {v}" for k, v in row["outcomes"].items())
        if "rss_mb" in row:
            ended += "; RSS MB before, after bursts 1-3: " + "; ".join(
                f"{k} {'/'.join(map(str, v))}" for k, v in row["rss_mb"].items()
            )
        lines.append(
            f"| {row['fault']} | {row['where']} | {row['requests']} ({row['in_flight']}) | {ended} "
            f"| {row['blocks_leaked']} |"
        )
    return "\n".join(lines)


def write(doc: pathlib.Path, rows: list[dict], result: str) -> None:
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    block = f"{BEGIN}\n{table(rows)}\n\nProduced by `{COMMAND}` ({result}).\n{END}"
    doc.write_text(head + block + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "reliability.md")
    args, pytest_args = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "rows.jsonl"
        env = {**os.environ, "PDSERVE_CHAOS_REPORT": str(report)}
        cmd = [sys.executable, "-m", "pytest", "-q", "tests/chaos", "-m", "chaos or not chaos", *pytest_args]
        done = subprocess.run(cmd, cwd=ROOT, env=env)
        rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    result = "all passed" if done.returncode == 0 else f"pytest exit status {done.returncode}"
    write(args.out, rows, result)
    print(f"{len(rows)} rows into {args.out} ({result})")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
