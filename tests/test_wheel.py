"""The wheel as a user installs it: built from this checkout, installed into a fresh venv with no
source tree on the path, beside the newest transformers (which brings Hugging Face's ``kernels``).
It installs only ``pdserve``, carries the C++ kernels' sources and runs the kernel built from
them, serves through ``pdserve up``, and its other commands start."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile

import pytest

from pdserve.kernels import cpu_ext
from pdserve.launcher.ports import free_port
from tests import web
from tests.test_autoscale_cluster import PROFILE
from tests.test_packaging import build_wheel
from tests.test_router_cluster import tiny_model_with_tokenizer

pytestmark = pytest.mark.usefixtures("processes")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A fresh venv with the wheel installed (no deps: those come from this venv's site-packages
    through a path file, read as plain paths: its editable install's hook is not among them)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (pathlib.Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{venv / 'bin'}:{env['PATH']}"}
    # The C++ CPU kernel from the installed package's own sources. Its build is cached under a key
    # of those sources' bytes, so where `make native` built this checkout's identical files the
    # library is found, not rebuilt (the image's build compiles it from the installed sources into
    # an empty cache: make compose-test); a missing source file fails the key, and the kernel.
    code = "from pdserve.kernels import cpu_ext; print(cpu_ext.CSRC); print(cpu_ext.load())"
    built = subprocess.run(
        [python, "-c", code], cwd=tmp, env=env, capture_output=True, text=True, timeout=600
    )
    assert built.returncode == 0, built.stderr[-3000:]
    csrc, library = built.stdout.split()
    return {
        "wheel": wheel,
        "python": python,
        "site": pathlib.Path(site),
        "env": env,
        "tmp": tmp,
        "csrc": csrc,
        "library": library,
    }


def _run(installed, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args),
        cwd=installed["tmp"],
        env=installed["env"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_wheel_installs_only_pdserve_with_the_kernels_sources(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert {name.split("/")[0] for name in names} == {
        "pdserve",
        installed["wheel"].name.split("-py3")[0] + ".dist-info",
    }
    assert "pdserve/kernels/csrc/paged_attention_cpu.cpp" in names and "pdserve/router/app.py" in names
    found = _run(
        installed,
        str(installed["python"]),
        "-c",
        "import pdserve, kernels, transformers; print(pdserve.__file__, kernels.__file__, transformers.__version__)",
    )
    assert found.returncode == 0, found.stderr
    ours, theirs, _ = found.stdout.split()
    assert ours.startswith(str(installed["site"])) and "pdserve/__init__.py" in ours
    assert "/kernels/__init__.py" in theirs and not theirs.startswith(str(installed["site"] / "pdserve"))


def test_the_installed_package_loads_its_cpu_kernel_keyed_by_its_own_sources(installed):
    assert installed["csrc"] == str(installed["site"] / "pdserve" / "kernels" / "csrc")
    # the key hashes the installed csrc/ files: this checkout's key means they are the same bytes
    assert installed["library"].endswith(f"{cpu_ext.NAME}-{cpu_ext.build_key()}/{cpu_ext.NAME}.so")


def test_its_other_commands_start(installed):
    for args in (["plan", "--help"], ["bench", "serve", "--help"]):
        result = _run(installed, "pdserve", *args)
        assert result.returncode == 0 and "usage: pdserve" in result.stdout, (args, result.stderr[-2000:])


def _until_up(proc: subprocess.Popen, out: pathlib.Path, url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while "pdserve is up" not in out.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.2)
    web.get(url + "/health", timeout=10).raise_for_status()


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("autoscale", [False, True], ids=["up", "up-autoscale"])
def test_pdserve_up_from_the_wheel_serves_a_request_on_the_cpu_kernel(
    installed, default_model_dir, autoscale
):
    model = tiny_model_with_tokenizer(default_model_dir)
    port, tmp = free_port(), installed["tmp"] / f"up-{autoscale}"
    tmp.mkdir()
    flags = ["--model", str(model), "--port", str(port), "--log-dir", str(tmp / "logs")]
    if autoscale:  # a profile given: no minute of calibration
        PROFILE.save(tmp / "profile.json")
        flags += ["--autoscale", "--autoscale-profile", str(tmp / "profile.json")]
    out = tmp / "up.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(
            ["pdserve", "up", *flags], cwd=tmp, env=installed["env"], stdout=sink, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _until_up(proc, out, url)
        body = {"model": model.name, "prompt": "one two three four", "max_tokens": 4, "temperature": 0}
        reply = web.post(url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        if autoscale:
            assert "autoscale: on" in out.read_text()
    finally:
        _stop(proc)
    node_logs = [
        p.read_text() for p in (tmp / "logs").glob("*.log") if p.name not in ("router.log", "redis.log")
    ]
    started = [line for text in node_logs for line in text.splitlines() if "attention:" in line]
    assert started and all("attention: C++ CPU kernel" in line for line in started), started
