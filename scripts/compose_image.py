"""`make compose-test`'s image phase: the image passes the wheel's checks (tests/test_wheel.py). In
one container of the project's image, apart from the compose cluster: only ``pdserve`` was
installed at site-packages' top level and no checkout is on the path, the C++ CPU kernel loads
(built at image build from the installed sources), `pdserve plan --help` and `pdserve bench serve
--help` run, `pdserve up` (the baked-in default model, its own registry) serves a completion, and
`pdserve up --autoscale` starts."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from scripts import compose_engine as ce

if TYPE_CHECKING:
    from scripts.compose_test import Harness

# Run in the container (the image's python, cwd /app); prints one JSON line of what it found.
CHECK = r"""
import importlib.metadata, json, os, pathlib, signal, subprocess, sys, time, urllib.request

out = {}
files = importlib.metadata.distribution("pdserve").files
out["top_level"] = sorted({f.parts[0] for f in files if not f.parts[0].endswith((".dist-info", ".."))})
import pdserve
out["installed"] = "site-packages" in pdserve.__file__ and not os.environ.get("PYTHONPATH")
from pdserve.kernels import cpu_ext
out["cpu_kernel"] = cpu_ext.load() is not None
out["helps"] = all(
    subprocess.run(["pdserve", *args, "--help"], capture_output=True, timeout=120).returncode == 0
    for args in (["plan"], ["bench", "serve"])
)

def started(args, line, timeout_s):
    log = open(f"/tmp/{args[0]}.out", "w+")
    proc = subprocess.Popen(["pdserve", "up", "--port", "8123", *args], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    try:
        while line not in pathlib.Path(log.name).read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                return False, pathlib.Path(log.name).read_text()[-1500:]
            time.sleep(0.5)
        return True, proc
    finally:
        if line not in pathlib.Path(log.name).read_text() and proc.poll() is None:
            proc.kill()

ok, proc = started(["--colocated", "1"], "pdserve is up", 240)
if ok:
    with urllib.request.urlopen("http://127.0.0.1:8123/v1/models", timeout=30) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    request = urllib.request.Request("http://127.0.0.1:8123/v1/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        out["up_served"] = json.load(reply)["usage"]["completion_tokens"] == 4
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
else:
    out["up_served"], out["up_log"] = False, proc
ok, proc = started(["--autoscale"], "autoscale: calibrating", 120)
out["autoscale_started"] = ok
if ok:
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
else:
    out["autoscale_log"] = proc
print(json.dumps(out))
"""


def phase_image(h: Harness) -> None:
    start = time.monotonic()
    found = ce.docker("run", "--rm", "--entrypoint", "python", "pdserve:local", "-c", CHECK, timeout_s=600)
    said = json.loads(found.strip().splitlines()[-1])
    phase = h.record(
        "image: the wheel's checks",
        [],
        start,
        only_pdserve_installed=said["top_level"] == ["pdserve"] and said["installed"],
        cpu_kernel_loads=said["cpu_kernel"],
        plan_and_bench_help=said["helps"],
        up_serves=said["up_served"],
        up_autoscale_starts=said["autoscale_started"],
    )
    phase.notes.append(
        f"top level {said['top_level']}" + (f"; up: {said['up_log'][-200:]}" if "up_log" in said else "")
    )
