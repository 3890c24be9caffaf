"""The closing table of a bench/gpu_oneshot.sh run, read back from the step logs in its output folder.

Every step writes a section into a ``*.log`` file there::

    == step NAME (limit N s): COMMAND
    ...the command's output...
    == exit NAME RC (S s)

or, when it was not run, one line ``== skip NAME: REASON``. This module finds each step's section,
turns its exit status into pass / fail / timeout / n-a and pulls the headline figures out of the
output (the formats are those of the commands in bench/gpu_oneshot.sh, bench/gpu_decode_bench.py and
bench/gpu_offline.py). It prints a Markdown table, ready for bench/README.md's GPU section.

    python3 bench/gpu_oneshot_summary.py OUT_DIR

Exit status 0 only when every step that ran passed and none is missing. Standard library only: it
runs last, and on any Python.
"""

from __future__ import annotations

import dataclasses
import enum
import pathlib
import re
import sys

# (name, what it checks), in the order the script runs them
STEPS = (
    ("wheels", "pyzmq, llguidance from .whl/"),
    ("env", "environment, ceilings"),
    ("kernels", "Triton kernel tests"),
    ("hd256", "bf16 head_dim-256 prefill"),
    ("lora", "LoRA kernels"),
    ("decode", "decode attention bandwidth"),
    ("probe", "engine runs on CUDA"),
    ("nccl", "executor over an NCCL group of one"),
    ("engine", "engine GPU tests"),
    ("paths", "beam search, speculation vs CPU"),
    ("transfer", "P/D device KV transfer, one GPU"),
    ("offline", "offline bf16 throughput"),
)
TIMEOUT_RCS = (124, 137)  # timeout(1): the limit passed (137: killed after the grace period)
DECODE_TARGET_PCT = 70  # decode attention, % of the device-to-device copy bandwidth
DECODE_TARGET_CELL = (32, 4096)  # (batch, context) the decode target is held at
DECODE_MIN_MIB = 256  # cells with less KV than this run partly from the 60 MB L2: not counted as best
OFFLINE_TARGET_RATIO = 2.0  # pdserve / HF's best static batch
STAGING_TARGET_FRACTION = 0.7  # KV device-to-host staging, of the pinned D2H ceiling

HEADER_RE = re.compile(r"^== step (\w+) \(limit (\d+) s\)", re.M)
EXIT_RE = re.compile(r"^== exit (\w+) (\d+) \((\d+) s\)", re.M)
SKIP_RE = re.compile(r"^== skip (\w+): (.*)$", re.M)


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    TIMEOUT = "timeout"
    NA = "n-a"  # not run: skipped on purpose, or no log of it at all


@dataclasses.dataclass(frozen=True, slots=True)
class Section:
    """One step's part of the logs."""

    limit_s: int | None  # its time limit; None when it was skipped
    output: str  # what the command printed ("" when skipped)
    rc: int | None  # exit status; None when skipped or cut off before its exit line
    elapsed_s: int | None  # seconds it ran, from the exit line
    skip_reason: str | None  # why it was not run, for a skipped step


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One line of the table."""

    name: str  # the step's name in the logs
    label: str  # what it checks
    status: Status
    time: str  # "S / LIMIT s", or "" when it did not run
    figures: str  # headline figures, or why there are none
    target: str  # the target held to it and whether it is met; "" for none
    missing: bool = False  # no log of it at all: the run broke off before it (a skip is logged)


def read_sections(text: str) -> dict[str, Section]:
    """Each step's section in ``text`` (the logs concatenated), by step name."""
    sections = {m.group(1): Section(None, "", None, None, m.group(2).strip()) for m in SKIP_RE.finditer(text)}
    headers = list(HEADER_RE.finditer(text))
    for i, header in enumerate(headers):
        name = header.group(1)
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        body = text[header.end() : end]
        exit_line = next((m for m in EXIT_RE.finditer(body) if m.group(1) == name), None)
        output = body[: exit_line.start()] if exit_line else body
        output = output.split("\n", 1)[1] if "\n" in output else ""  # past the header's command
        sections[name] = Section(
            int(header.group(2)),
            output,
            int(exit_line.group(2)) if exit_line else None,
            int(exit_line.group(3)) if exit_line else None,
            None,
        )
    return sections


def status_of(section: Section | None) -> Status:
    if section is None or section.skip_reason is not None:
        return Status.NA
    if section.rc == 0:
        return Status.PASS
    return Status.TIMEOUT if section.rc in TIMEOUT_RCS else Status.FAIL


def _number(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else None


# The first line that says what went wrong: an exception's line (the traceback's own header
# skipped), a CUDA kernel's device-side assertion (printed before the Python error it causes), or
# a CUDA error.
ERROR_LINE_RE = re.compile(
    r"^\s*([\w.]*(Error|Exception|Exit|Interrupt)\b.*|.*\bAssertion\b.*\bfailed\b.*|.*\bCUDA error\b.*)$",
    re.M,
)


def first_error_line(text: str) -> str:
    m = ERROR_LINE_RE.search(text)
    return m.group(0).strip()[:160] if m else f"no error line; last: {_last_line(text)}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:160] if lines else "no output"


def pytest_counts(output: str) -> str:
    """pytest's closing line, cut to its counts: "12 passed, 1 failed"."""
    closing = re.compile(
        r"\b(no tests ran|\d+ (passed|failed|errors?|skipped|xfailed|xpassed))\b.* in [\d.]+s"
    )
    lines = [line.strip(" =") for line in output.splitlines() if closing.search(line)]
    if not lines:
        return f"no pytest summary line; last: {_last_line(output)}"
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped)", lines[-1])
    return ", ".join(f"{n} {what}" for n, what in counts) or "no tests ran"


def wheels_figures(output: str) -> tuple[str, str]:
    m = re.search(r"^Successfully installed (.+)$", output, re.M)
    return (f"installed {m.group(1).strip()}" if m else _last_line(output)), ""


def env_figures(output: str) -> tuple[str, str]:
    parts = []
    device = re.search(r"^nvidia-smi: (.+)$", output, re.M)
    if device:
        parts.append(device.group(1).strip())
    versions = re.search(r"^(torch .*?), device", output, re.M)
    if versions:
        parts.append(versions.group(1))
    copy = _number(r"^copy d2d: ([\d.]+) GB/s", output)
    if copy is not None:
        parts.append(f"copy {copy:.0f} GB/s")
    transfers = {
        (way, kind): _number(rf"^{way} {kind}: ([\d.]+) GB/s", output)
        for way in ("h2d", "d2h")
        for kind in ("pinned", "pageable")
    }
    for way in ("h2d", "d2h"):
        pinned, pageable = transfers[(way, "pinned")], transfers[(way, "pageable")]
        if pinned is not None or pageable is not None:
            parts.append(f"{way.upper()} {_fmt(pinned)} pinned / {_fmt(pageable)} pageable GB/s")
    tflops = _number(r"^matmul bf16 \S+: ([\d.]+) TFLOP/s", output)
    if tflops is not None:
        parts.append(f"bf16 matmul {tflops:.0f} TFLOP/s")
    d2h = transfers[("d2h", "pinned")]
    target = (
        f"KV D2H staging >= {STAGING_TARGET_FRACTION:.0%} of pinned D2H: >= {STAGING_TARGET_FRACTION * d2h:.1f} GB/s"
        if d2h is not None
        else ""
    )
    return ("; ".join(parts) or _last_line(output)), target


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def kernels_figures(output: str) -> tuple[str, str]:
    return pytest_counts(output), ""


def decode_figures(output: str) -> tuple[str, str]:
    # rows of bench/gpu_decode_bench.py: batch, context, KV MiB, ms, GB/s, % of copy
    row_re = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+\s+(\d+)\s+(\d+)%\s*$", re.M)
    cells = {(int(b), int(c)): (int(mib), int(pct)) for b, c, mib, _, pct in row_re.findall(output)}
    if not cells:
        return f"no table; last: {_last_line(output)}", ""
    copy = _number(r"^device-to-device copy: ([\d.]+) GB/s", output)
    parts = [f"copy {copy:.0f} GB/s"] if copy is not None else []
    large = {cell: pct for cell, (mib, pct) in cells.items() if mib >= DECODE_MIN_MIB}
    if large:
        (batch, context), pct = max(large.items(), key=lambda item: item[1])
        parts.append(f"best {pct}% of copy at {batch} x {context} (cells with >= {DECODE_MIN_MIB} MiB of KV)")
    batch, context = DECODE_TARGET_CELL
    target = f">= {DECODE_TARGET_PCT}% of copy at {batch} x {context}: "
    if DECODE_TARGET_CELL in cells:
        pct = cells[DECODE_TARGET_CELL][1]
        parts.append(f"{batch} x {context}: {pct}%")
        target += f"{'met' if pct >= DECODE_TARGET_PCT else 'missed'} ({pct}%)"
    else:
        target += "no such cell"
    return "; ".join(parts), target


def probe_figures(output: str) -> tuple[str, str]:
    m = re.search(r"^engine probe: ok(.*)$", output, re.M)
    if m is None:
        return f"engine probe failed: {first_error_line(output)}", ""
    return f"ok{m.group(1).rstrip()}", ""


def nccl_figures(output: str) -> tuple[str, str]:
    group = re.search(r"^executor over a (\w+) group of one: ok", output, re.M)
    return (f"{group.group(1)} group of one: ok" if group else f"failed: {first_error_line(output)}"), ""


def paths_figures(output: str) -> tuple[str, str]:
    lines = re.findall(r"^path (.+?): (ok|differs)", output, re.M)
    if not lines:
        return f"no path line; {first_error_line(output)}", ""
    return "; ".join(f"{name}: {verdict}" for name, verdict in lines), ""


def engine_figures(output: str) -> tuple[str, str]:
    return pytest_counts(output), ""


def offline_figures(output: str) -> tuple[str, str]:
    parts = []
    hf = re.search(r"^hf best: ([\d.]+) tok/s at batch (\d+)", output, re.M)
    parts.append(f"HF {float(hf.group(1)):.0f} tok/s (batch {hf.group(2)})" if hf else "HF n/a")
    ours = _number(r"^pdserve: ([\d.]+) tok/s", output)
    parts.append(f"pdserve {ours:.0f} tok/s" if ours is not None else "pdserve n/a")
    ratio = _number(r"^ratio pdserve/hf: ([\d.]+)x", output)
    if ratio is not None:
        parts.append(f"ratio {ratio:.2f}x")
    target = f">= {OFFLINE_TARGET_RATIO:g}x HF: "
    if ratio is None:
        target += "n/a"
    else:
        target += f"{'met' if ratio >= OFFLINE_TARGET_RATIO else 'missed'} ({ratio:.2f}x)"
    return "; ".join(parts), target


FIGURES = {
    "wheels": wheels_figures,
    "env": env_figures,
    "kernels": kernels_figures,
    "hd256": kernels_figures,
    "lora": kernels_figures,
    "decode": decode_figures,
    "probe": probe_figures,
    "nccl": nccl_figures,
    "engine": engine_figures,
    "paths": paths_figures,
    "transfer": engine_figures,
    "offline": offline_figures,
}


def summarize(out_dir: pathlib.Path) -> list[Row]:
    text = "\n".join(path.read_text(errors="replace") for path in sorted(out_dir.glob("*.log")))
    sections = read_sections(text)
    rows = []
    for name, label in STEPS:
        section = sections.get(name)
        status = status_of(section)
        if section is None:
            rows.append(Row(name, label, status, "", "no log of this step", "", missing=True))
            continue
        if section.skip_reason is not None:
            rows.append(Row(name, label, status, "", f"skipped: {section.skip_reason}", ""))
            continue
        figures, target = FIGURES[name](section.output)
        if section.rc is None:
            figures = f"cut off (no exit line); {figures}"
        elif status is Status.FAIL:
            figures = f"exit {section.rc}; {figures}"
        time = f"{section.elapsed_s if section.elapsed_s is not None else '?'} / {section.limit_s} s"
        rows.append(Row(name, label, status, time, figures, target))
    return rows


def passed(rows: list[Row]) -> bool:
    """Every step that ran passed, and every step left a log (a missing one means the run broke)."""
    return all(r.status in (Status.PASS, Status.NA) and not r.missing for r in rows)


def markdown(rows: list[Row]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| step | status | time / limit | figures | target |", "|---|---|---|---|---|"]
    lines += [
        f"| {r.name} ({r.label}) | {r.status.value} | {r.time} | {cell(r.figures)} | {cell(r.target)} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 bench/gpu_oneshot_summary.py OUT_DIR", file=sys.stderr)
        return 2
    rows = summarize(pathlib.Path(argv[0]))
    print(markdown(rows))
    if passed(rows):
        print("\ngpu_oneshot: every step that ran passed")
        return 0
    print("\ngpu_oneshot: some step failed, timed out or left no log")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
