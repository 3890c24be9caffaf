"""bench/gpu_oneshot.sh and its summary, checked on the CPU before a GPU is ever lent.

The script itself needs a GPU, so its plumbing (step logs, exit lines, skips, the file count and
the exit status) runs here with a stand-in for python3 that "passes" every step; the summary
parser reads canned logs in the formats the real commands print.
"""

from __future__ import annotations

import os
import pathlib
import re
import stat
import subprocess
import sys

import pytest

from bench import gpu_oneshot_summary as summary

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_oneshot.sh"
MAX_FILES = 8  # what comes back from the lent machine's output folder
MAX_RUN_S = 590  # under the 600 s a device command may run, even when every step hits its limit

# Stands in for python3 on a GPU machine: says torch sees CUDA, runs the summary for real and
# "passes" everything else, failing instead where the command or its stdin contains $FAKE_FAIL.
FAKE_PYTHON = """#!/usr/bin/env bash
code=""
if [ "${1:-}" = - ]; then code="$(cat)"; fi
case "$*" in
*gpu_oneshot_summary.py*) exec REAL_PYTHON "$@" ;;
*cuda.is_available*) echo "2.11.0+cu130 True"; exit 0 ;;
esac
echo "fake python ran: $*"
if [ -n "${FAKE_FAIL:-}" ] && [[ "$* $code" == *"$FAKE_FAIL"* ]]; then echo "Error: $FAKE_FAIL failed"; exit 1; fi
exit 0
"""


def _run_script(out: pathlib.Path, python: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OUT": str(out), "PYTHON": python, **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full_env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def fake_python(tmp_path) -> str:
    path = tmp_path / "python3"
    path.write_text(FAKE_PYTHON.replace("REAL_PYTHON", sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.usefixtures("processes")
def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_even_a_run_where_every_step_hits_its_limit_ends_within_480_s_and_every_timeout_uses_one():
    text = SCRIPT.read_text()
    limits = {name: int(s) for name, s in re.findall(r"^LIMIT_(\w+)=(\d+)$", text, re.M)}
    assert set(limits) == {
        "CHECK", "WHEELS", "ENV", "KERNELS", "HD256", "LORA", "DECODE", "PROBE", "NCCL", "ENGINE", "PATHS",
        "TRANSFER", "OFFLINE",
    }  # fmt: skip
    grace = int(re.search(r"^GRACE=(\d+)", text, re.M).group(1))  # timeout -k: after the limit
    assert sum(limits.values()) + grace * len(limits) + 5 <= MAX_RUN_S  # 5: the summary
    assert limits["ENGINE"] > limits["OFFLINE"]  # the engine tests pay the cold Triton compiles
    for name in limits:  # each is used
        assert f'"$LIMIT_{name}"' in text
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    timeouts = [line for line in code if re.search(r"\btimeout\s", line)]
    assert timeouts
    for line in timeouts:  # no limit outside the counted ones
        assert re.search(r'\btimeout (-k "\$GRACE" )?"\$(LIMIT_\w+|limit)"', line), line


def test_script_never_contacts_an_index_nor_collects_the_whole_tests_tree():
    text = SCRIPT.read_text().replace("\\\n", " ")
    for line in re.findall(r"^.*pip install.*$", text, re.M):
        assert "--no-index" in line, line
    pytest_lines = re.findall(r"^.*-m pytest.*$", text, re.M)
    # the kernels (on the GPU, and interpreted in a dry run), head_dim 256, LoRA, the engine, the transfer
    assert len(pytest_lines) == 6
    for line in pytest_lines:
        args = line.split("-m pytest", 1)[1].split()
        targets = [a for a in args if a.startswith("tests")]
        assert targets and all(a.endswith(".py") for a in targets), line


@pytest.mark.usefixtures("processes")
def test_without_cuda_it_exits_3_at_once_and_writes_nothing(tmp_path):
    # This machine's torch is the CPU wheel: the GPU script must refuse, not pass quietly.
    out = tmp_path / "out"
    result = _run_script(out, sys.executable)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "sees no CUDA device" in result.stderr and "Nothing was run" in result.stderr
    assert list(out.iterdir()) == []


@pytest.mark.usefixtures("processes")
def test_script_rejects_arguments():
    result = subprocess.run(["bash", str(SCRIPT), "--iters", "3"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


@pytest.mark.usefixtures("processes")
def test_every_step_runs_and_logs_into_at_most_8_files(tmp_path, fake_python):
    out = tmp_path / "out"
    result = _run_script(out, fake_python)
    assert result.returncode == 0, result.stdout + result.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= MAX_FILES
    assert files == [
        "decode.log",
        "engine.log",
        "env.log",
        "kernels.log",
        "offline.log",
        "probe.log",
        "summary.txt",
    ]
    table = (out / "summary.txt").read_text()
    for name, _ in summary.STEPS:
        assert f"| {name} (" in table
    assert "every step that ran passed" in table
    assert "--skip-pdserve" not in (out / "offline.log").read_text()


@pytest.mark.usefixtures("processes")
def test_a_failed_probe_skips_the_engine_tests_and_pdserve(tmp_path, fake_python):
    out = tmp_path / "out"
    result = _run_script(out, fake_python, FAKE_FAIL="gpu_probe")
    assert result.returncode == 1
    rows = {row.name: row for row in summary.summarize(out)}
    assert rows["probe"].status is summary.Status.FAIL
    assert rows["probe"].figures == "exit 1; engine probe failed: Error: gpu_probe failed"
    assert rows["engine"].status is summary.Status.NA
    assert rows["engine"].figures == "skipped: the engine probe failed"
    assert rows["offline"].status is summary.Status.PASS
    assert "--skip-pdserve" in (out / "offline.log").read_text()
    assert len(list(out.iterdir())) <= MAX_FILES


# ---------------------------------------------------------------- the summary on canned logs

WHEELS_AND_ENV = """\
== step wheels (limit 15 s): python3 -m pip install --no-index --no-deps --disable-pip-version-check --upgrade --target /tmp/pdserve-wheels .whl/llguidance-1.6.1-cp39-abi3-manylinux_2_28_x86_64.whl .whl/pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl
Processing ./.whl/llguidance-1.6.1-cp39-abi3-manylinux_2_28_x86_64.whl
Processing ./.whl/pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl
Installing collected packages: pyzmq, llguidance
Successfully installed llguidance-1.6.1 pyzmq-27.3.0
== exit wheels 0 (3 s)
== step env (limit 30 s): python3 -
nvidia-smi: NVIDIA H200, 143771 MiB, 580.95.05
torch 2.11.0+cu130 (CUDA 13.0), triton 3.6.0, device NVIDIA H200
copy d2d: 4301 GB/s (read + write of 1 GiB)
h2d pinned: 55.2 GB/s (256 MiB)
d2h pinned: 54.8 GB/s (256 MiB)
h2d pageable: 19.4 GB/s (256 MiB)
d2h pageable: 12.1 GB/s (256 MiB)
matmul bf16 8192^3: 788 TFLOP/s
== exit env 0 (11 s)
"""

KERNELS_ONE_FAILED = """\
== step kernels (limit 90 s): python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels_triton.py tests/test_kernels_gpu.py
8 workers [13 items]
............F                                                            [100%]
=================================== FAILURES ===================================
FAILED tests/test_kernels_gpu.py::test_int8_scales_match - AssertionError: scale differs
12 passed, 1 failed in 30.2s
== exit kernels 1 (34 s)
"""

# (batch, context, KV MiB, ms, GB/s, % copy), printed with gpu_decode_bench.py's own format
DECODE_CELLS = [
    (1, 512, 2, 0.012, 175, 4),
    (1, 4096, 16, 0.020, 839, 20),
    (32, 4096, 512, 0.170, 3158, 74),
    (256, 4096, 4096, 1.310, 3279, 76),
    (256, 32768, 32768, 10.200, 3369, 79),
]


def _decode_log(cells) -> str:
    rows = "".join(
        f"{b:>6} {c:>8} {mib:>9.0f} {ms:>9.3f} {gbs:>8.0f} {pct:>6.0f}%\n"
        for b, c, mib, ms, gbs, pct in cells
    )
    return (
        "== step decode (limit 70 s): python3 bench/gpu_decode_bench.py\n"
        "device: NVIDIA H200  torch 2.11.0+cu130\n"
        "device-to-device copy: 4289 GB/s (read + write of 1 GiB)\n"
        "decode: bfloat16, heads 32/8 kv, head_dim 128, block_size 16\n"
        f"{'batch':>6} {'context':>8} {'KV MiB':>9} {'ms':>9} {'GB/s':>8} {'% copy':>7}\n"
        f"{rows}"
        "   256   131072  skipped: KV does not fit in free memory\n"
        "== exit decode 0 (41 s)\n"
    )


PROBE_OK = """\
== step probe (limit 35 s): python3 -
engine: KV pool 0 MiB = 64 blocks x 16 tokens; dtype bfloat16; CUDA graphs: decode batches up to 64
engine probe: ok, greedy tokens [17, 4, 250, 250, 9, 31, 31, 2]
== exit probe 0 (9 s)
== step nccl (limit 25 s): python3 bench/gpu_probe.py --group-of-one
executor over a nccl group of one: ok, greedy tokens equal
== exit nccl 0 (8 s)
"""

# the rows a GPU run adds beside the first ones, all passed (in the logs they share)
NEW_ROWS_PASSED = """\
== step hd256 (limit 30 s): python3 -m pytest -q tests/test_kernels_triton.py -k head_dim_256
1 passed, 28 deselected in 6.01s
== exit hd256 0 (7 s)
== step lora (limit 30 s): python3 -m pytest -q tests/test_lora_kernels.py
12 passed in 9.50s
== exit lora 0 (10 s)
== step paths (limit 35 s): python3 bench/gpu_paths.py
path beam search (3 beams): ok
path ngram speculation: ok
== exit paths 0 (20 s)
== step transfer (limit 45 s): python3 -m pytest -q tests/test_transfer_gpu.py
1 passed in 30.02s
== exit transfer 0 (31 s)
"""

ENGINE_TIMED_OUT = """\
== step engine (limit 80 s): python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py
.....
== exit engine 124 (80 s)
"""

PROBE_FAILED = """\
== step probe (limit 35 s): python3 -
Traceback (most recent call last):
  File "<stdin>", line 4, in <module>
ValueError: device cuda: the engine's CUDA path is not built yet; use --device cpu
== exit probe 1 (6 s)
"""

OFFLINE_HF_ONLY = """\
== step offline (limit 120 s): python3 bench/gpu_offline.py --skip-pdserve
model: random Llama, hidden 2048, 16 layers, 32/8 heads, vocab 32000: 1,100,048,384 parameters, bfloat16 on cuda, built and saved in 6.1 s
workload: 128 prompts x 128 tokens in, 128 out (greedy, EOS ignored)
hf batch 32: 2875.3 tok/s
hf batch 64: 5210.9 tok/s
hf batch 128: 8815.0 tok/s
hf best: 8815.0 tok/s at batch 128
pdserve: n/a (skipped: --skip-pdserve)
ratio pdserve/hf: n/a
== exit offline 0 (52 s)
"""

OFFLINE_BOTH = OFFLINE_HF_ONLY.replace(" --skip-pdserve\n", "\n").replace(
    "pdserve: n/a (skipped: --skip-pdserve)\nratio pdserve/hf: n/a",
    "pdserve: 20361.7 tok/s (max_num_seqs 128)\nratio pdserve/hf: 2.31x (target >= 2x)",
)


def _write_logs(folder: pathlib.Path, **logs: str) -> pathlib.Path:
    folder.mkdir()
    for name, text in logs.items():
        (folder / f"{name}.log").write_text(text)
    return folder


def test_summary_reads_figures_failures_timeouts_and_a_missing_log(tmp_path):
    out = _write_logs(
        tmp_path / "out",
        env=WHEELS_AND_ENV,
        kernels=KERNELS_ONE_FAILED,
        decode=_decode_log(DECODE_CELLS),
        probe=PROBE_OK,
        engine=ENGINE_TIMED_OUT,
        rows=NEW_ROWS_PASSED,
    )  # no offline.log: the run broke off before it
    rows = {row.name: row for row in summary.summarize(out)}
    assert list(rows) == [name for name, _ in summary.STEPS]
    S = summary.Status
    assert {name: row.status for name, row in rows.items()} == {
        "wheels": S.PASS,
        "env": S.PASS,
        "kernels": S.FAIL,
        "hd256": S.PASS,
        "lora": S.PASS,
        "decode": S.PASS,
        "probe": S.PASS,
        "nccl": S.PASS,
        "engine": S.TIMEOUT,
        "paths": S.PASS,
        "transfer": S.PASS,
        "offline": S.NA,
    }
    assert rows["wheels"].figures == "installed llguidance-1.6.1 pyzmq-27.3.0"
    assert rows["env"].figures == (
        "NVIDIA H200, 143771 MiB, 580.95.05; torch 2.11.0+cu130 (CUDA 13.0), triton 3.6.0; copy 4301 GB/s; "
        "H2D 55.2 pinned / 19.4 pageable GB/s; D2H 54.8 pinned / 12.1 pageable GB/s; bf16 matmul 788 TFLOP/s"
    )
    assert rows["env"].target == "KV D2H staging >= 70% of pinned D2H: >= 38.4 GB/s"
    assert rows["env"].time == "11 / 30 s"
    assert rows["kernels"].figures == "exit 1; 12 passed, 1 failed"
    assert rows["decode"].figures == (
        "copy 4289 GB/s; best 79% of copy at 256 x 32768 (cells with >= 256 MiB of KV); 32 x 4096: 74%"
    )
    assert rows["decode"].target == ">= 70% of copy at 32 x 4096: met (74%)"
    assert rows["probe"].figures == "ok, greedy tokens [17, 4, 250, 250, 9, 31, 31, 2]"
    assert rows["nccl"].figures == "nccl group of one: ok"  # a row of its own
    assert rows["paths"].figures == "beam search (3 beams): ok; ngram speculation: ok"
    assert (rows["hd256"].figures, rows["transfer"].figures) == ("1 passed", "1 passed")
    assert rows["engine"].figures.startswith("no pytest summary line")
    assert rows["engine"].time == "80 / 80 s"
    assert rows["offline"].figures == "no log of this step" and rows["offline"].missing
    assert not summary.passed(list(rows.values()))


def test_summary_of_a_failed_probe_keeps_hf_figures_and_reads_the_error(tmp_path):
    out = _write_logs(
        tmp_path / "out",
        env=WHEELS_AND_ENV,
        probe=PROBE_FAILED + "== skip engine: the engine probe failed\n",
        offline=OFFLINE_HF_ONLY,
    )
    rows = {row.name: row for row in summary.summarize(out)}
    assert rows["probe"].status is summary.Status.FAIL
    assert rows["probe"].figures == (
        "exit 1; engine probe failed: ValueError: device cuda: the engine's CUDA path is not built yet; use --device cpu"
    )
    assert (rows["engine"].status, rows["engine"].figures) == (
        summary.Status.NA,
        "skipped: the engine probe failed",
    )
    assert rows["offline"].status is summary.Status.PASS
    assert rows["offline"].figures == "HF 8815 tok/s (batch 128); pdserve n/a"
    assert rows["offline"].target == ">= 2x HF: n/a"


def test_summary_passes_when_every_step_passed_and_prints_a_markdown_table(tmp_path, capsys):
    engine_passed = ENGINE_TIMED_OUT.replace(
        ".....\n== exit engine 124 (80 s)", "9 passed in 41.75s\n== exit engine 0 (47 s)"
    )
    out = _write_logs(
        tmp_path / "out",
        env=WHEELS_AND_ENV,
        kernels=KERNELS_ONE_FAILED.replace("12 passed, 1 failed", "13 passed").replace(
            "exit kernels 1", "exit kernels 0"
        ),
        decode=_decode_log([(32, 4096, 512, 0.250, 2150, 50)]),
        probe=PROBE_OK,
        engine=engine_passed,
        rows=NEW_ROWS_PASSED,
        offline=OFFLINE_BOTH,
    )
    assert summary.main([str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("| step | status | time / limit | figures | target |\n|---|---|---|---|---|\n")
    assert "| engine (engine GPU tests) | pass | 47 / 80 s | 9 passed |  |" in printed
    assert ">= 70% of copy at 32 x 4096: missed (50%)" in printed  # a target is reported, not enforced
    assert "HF 8815 tok/s (batch 128); pdserve 20362 tok/s; ratio 2.31x | >= 2x HF: met (2.31x)" in printed
    assert "every step that ran passed" in printed


PROBE_DEVICE_ASSERT = """\
== step probe (limit 60 s): python3 bench/gpu_probe.py
/pytorch/aten/src/ATen/native/cuda/IndexKernel.cu:93: operator(): block: [3,0,0], thread: [64,0,0] Assertion `-sizes[i] <= index && index < sizes[i] && "index out of bounds"` failed.
Traceback (most recent call last):
  File "bench/gpu_probe.py", line 30, in main
    llm = LLM(str(make_tiny_model("llama")), device=args.device)
torch.AcceleratorError: CUDA error: device-side assert triggered
== exit probe 1 (14 s)
"""


def test_a_failed_step_keeps_its_row_with_the_first_error_line(tmp_path):
    # the kernel's assertion comes first, and says more than the Python error it causes
    out = _write_logs(tmp_path / "out", probe=PROBE_DEVICE_ASSERT)
    row = next(r for r in summary.summarize(out) if r.name == "probe")
    assert row.status is summary.Status.FAIL and row.time == "14 / 60 s"
    assert row.figures.startswith(
        "exit 1; engine probe failed: /pytorch/aten/src/ATen/native/cuda/IndexKernel.cu:93"
    )
    assert "Assertion `-sizes[i] <= index" in row.figures


@pytest.mark.usefixtures("processes")
def test_without_its_wheels_the_run_says_how_to_make_them(tmp_path, fake_python):
    if all(any((ROOT / ".whl").glob(f"{name}-*.whl")) for name in ("pyzmq", "llguidance")):
        pytest.skip("this checkout carries the wheels (.whl/)")
    out = tmp_path / "out"
    _run_script(out, fake_python)
    row = next(r for r in summary.summarize(out) if r.name == "wheels")
    assert row.status is summary.Status.NA
    assert "in .whl/: run `bash scripts/gpu_wheels.sh` where pip reaches PyPI and carry .whl/" in row.figures


@pytest.mark.usefixtures("processes")
def test_the_dry_run_on_the_cpu_prints_a_full_table_and_its_probe_profiles_the_default_budget(tmp_path):
    """``--dry-run`` runs every step that can run on this CPU. Its kernels step is the CPU suite's
    run of the Triton kernel tests (tests/test_kernels_triton.py and test_kernels_gpu.py) in
    Triton's interpreter, in a child process with TRITON_INTERPRET=1. Its probe is the GPU probe's
    own code on the split platform: the engine profiles the default 2048-token budget on a model of
    512 positions before sizing its pool (on the first GPU that profile indexed past the rotary
    table), then generates."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"OUT": str(out)}
    result = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = {row.name: row for row in summary.summarize(out)}
    assert list(rows) == [name for name, _ in summary.STEPS] and not any(r.missing for r in rows.values())
    ran = {name for name, row in rows.items() if row.status is summary.Status.PASS}
    assert ran == {"kernels", "probe", "nccl", "paths", "offline"}, (
        rows,
        {log.name: log.read_text()[-2500:] for log in sorted(out.glob("*.log"))},  # read on failure only
    )
    assert re.fullmatch(r"ok, greedy tokens \[(\d+, ){7}\d+\]", rows["probe"].figures), rows["probe"]
    assert rows["nccl"].figures == "gloo group of one: ok"  # the executor's collectives: gloo here
    assert rows["paths"].figures.count(": ok") == 3, rows["paths"]  # beam search, two speculations
    # the offline bench's smoke run prints what its row reads (HF's best batch is whichever ran
    # fastest: on a loaded CPU any of the smoke run's sizes)
    offline = rows["offline"]
    assert re.fullmatch(
        r"HF \d+ tok/s \(batch \d+\); pdserve \d+ tok/s; ratio \d+\.\d\dx", offline.figures
    ), offline
    assert re.fullmatch(r">= 2x HF: (met|missed) \(\d+\.\d\dx\)", offline.target), offline
    probe_log = (out / "probe.log").read_text()
    assert "max_num_batched_tokens 2048" in probe_log and "the profiled step" in probe_log
    assert len(list(out.iterdir())) <= MAX_FILES


def test_a_step_cut_off_before_its_exit_line_fails(tmp_path):
    out = _write_logs(
        tmp_path / "out", decode=_decode_log(DECODE_CELLS).replace("== exit decode 0 (41 s)\n", "")
    )
    row = next(r for r in summary.summarize(out) if r.name == "decode")
    assert row.status is summary.Status.FAIL
    assert row.figures.startswith("cut off (no exit line); copy 4289 GB/s")


@pytest.mark.parametrize(
    "line, counts",
    [
        ("12 passed, 1 failed in 30.2s", "12 passed, 1 failed"),
        (
            "======= 3 failed, 40 passed, 2 skipped in 75.20s (0:01:15) =======",
            "3 failed, 40 passed, 2 skipped",
        ),
        ("1 passed, 2 errors in 4.01s", "1 passed, 2 errors"),
        ("no tests ran in 0.01s", "no tests ran"),
    ],
)
def test_pytest_counts_are_read_from_the_closing_line(line, counts):
    assert summary.pytest_counts(f"collected 43 items\n....\n{line}\n") == counts
