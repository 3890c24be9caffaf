"""The tests' fork server (tests/forkserver.py) starts nodes that behave as `python -m pdserve` ones:
exit codes as Popen reports them, a deadline on wait, each environment served by a server started
with it, and a node that serves."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess

import pytest

from tests import forkserver
from tests.cluster import ROOT, Client, NodeProcess
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.usefixtures("processes"),
    pytest.mark.skipif(
        os.environ.get(forkserver.ENABLE_ENV) == "0", reason="the fork server is off for this run"
    ),
]


def _spawn(args: list[str], tmp: pathlib.Path, **env: str):
    """``pdserve ARGS`` through the fork server, with NodeProcess's environment and ``env``."""
    log = open(tmp / f"{len(list(tmp.iterdir()))}.log", "w")
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return forkserver.spawn(args, env=full_env, cwd=ROOT, log=log), pathlib.Path(log.name)


def _forked(args: list[str], tmp: pathlib.Path, **env: str):
    """``pdserve ARGS`` from the server for that environment: its first request starts with python."""
    proc, log = _spawn(args, tmp, **env)
    if isinstance(proc, subprocess.Popen):
        assert proc.wait(30) == 0
        proc, log = _spawn(args, tmp, **env)
    assert isinstance(proc, forkserver.ForkedProcess)
    return proc, log


def test_a_forked_node_serves_exactly_and_ends_as_popen_says(tmp_path):
    _forked(["decode", "--help"], tmp_path)[0].wait(30)  # NodeProcess's environment has its server
    model = str(make_tiny_model("llama"))
    node = NodeProcess("decode", model, tmp_path, extra=["--block-size", "8", "--num-kv-blocks", "64"])
    try:
        assert isinstance(node.proc, forkserver.ForkedProcess)
        node.wait_ready()
        prompt = [5, 17, 23, 42, 8, 99, 3]
        client = Client()
        try:
            client.generate(
                node.addrs, "r1", prompt, {"temperature": 0.0, "ignore_eos": True, "max_tokens": 6}
            )
            tokens = client.collect(["r1"])["r1"]["tokens"]
        finally:
            client.close()
        assert tokens == hf_greedy(model, prompt, 6)
        with pytest.raises(subprocess.TimeoutExpired):
            node.proc.wait(0.1)
        assert node.proc.poll() is None
        node.proc.send_signal(signal.SIGKILL)
        assert node.proc.wait(10) == -signal.SIGKILL  # the signal that ended it, negated, as Popen says
    finally:
        node.close()


def test_exit_codes_and_environments(tmp_path):
    usage, log = _forked(["decode", "--help"], tmp_path)
    assert usage.wait(30) == 0 and "usage:" in log.read_text()
    refused, log = _spawn(["decode", "--no-such-flag"], tmp_path)
    assert isinstance(refused, forkserver.ForkedProcess)
    assert refused.wait(30) == 2 and "error:" in log.read_text()
    # another environment: its first node starts with python, the next ones fork from a server
    # started with that environment, so what modules read as they load (here the kv sender's
    # fault switch) is the node's own
    fault = {"PDSERVE_FAULT_CORRUPT_KV_EVERY": "3"}
    first, _ = _spawn(["decode", "--help"], tmp_path, **fault)
    second, _ = _spawn(["decode", "--help"], tmp_path, **fault)
    assert isinstance(first, subprocess.Popen) and isinstance(second, forkserver.ForkedProcess)
    assert first.wait(30) == second.wait(30) == 0
    (server,) = [
        server
        for key, server in forkserver._servers.items()
        if ("PDSERVE_FAULT_CORRUPT_KV_EVERY", "3") in key
    ]
    environ = pathlib.Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
    assert b"PDSERVE_FAULT_CORRUPT_KV_EVERY=3" in environ
