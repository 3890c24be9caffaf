"""The servers the serving studies measure: `pdserve up` in a given shape, and vLLM's OpenAI server
(its CPU build, from a venv of its own) on the default model. Each runs in the background until stop()."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import time
import urllib.request

from pdserve.launcher.commands import up_argv
from pdserve.launcher.plan import usable_cores
from pdserve.launcher.ports import free_port
from pdserve.planner.simulate import Cluster

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMITTED_GAUGE = re.compile(r"^pdserve_node_kv_blocks_committed\{[^}]*\} (\S+)", re.M)
TOTAL_GAUGE = re.compile(r"^pdserve_node_kv_blocks_total\{[^}]*\} (\S+)", re.M)


def up_flags(cluster: Cluster) -> list[str]:
    return [
        "--prefill",
        str(cluster.num_prefill),
        "--decode",
        str(cluster.num_decode),
        "--colocated",
        str(cluster.num_colocated),
    ]


class Up:
    """`pdserve up` in the background, until stop()."""

    def __init__(
        self,
        cluster: Cluster,
        log_dir: pathlib.Path,
        node_args: str = "",
        router_args: str = "",
        threads: int | None = None,  # torch threads per node; None: pdserve up's even split
        extra: tuple[str, ...] = (),  # more `pdserve up` flags (--autoscale ...)
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path = log_dir / "up.out"
        self._out = open(self.out_path, "w")
        cmd = up_argv(
            self.port,
            log_dir,
            *up_flags(cluster),
            f"--node-args={node_args}",
            f"--router-args={router_args}",
            *extra,
        )
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def wait_up(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "pdserve is up" not in self.out_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up failed:\n{self.out_path.read_text()[-3000:]}")
            time.sleep(0.5)

    def settle_kv_pools(self, timeout_s: float = 300.0, still_s: float = 10.0) -> str:
        """Wait until every node's KV pool is committed (``--kv-commit idle`` does it in the
        background, as vLLM does at start-up), or has not grown for ``still_s`` (lazy, or short
        of memory); what it saw, for the log."""
        start = time.monotonic()
        last, last_change = None, start
        while time.monotonic() - start < timeout_s:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
                text = response.read().decode()
            committed = [float(v) for v in COMMITTED_GAUGE.findall(text)]
            total = [float(v) for v in TOTAL_GAUGE.findall(text)]
            if committed and committed == total:
                return f"KV pools committed {time.monotonic() - start:.0f} s after start-up"
            if committed != last:
                last, last_change = committed, time.monotonic()
            elif time.monotonic() - last_change > still_s:
                break
            time.sleep(1.0)
        share = sum(last or []) / max(1.0, sum(total))
        return f"KV pools at {share:.0%} committed after {time.monotonic() - start:.0f} s"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


class VllmServer(Up):
    """vLLM's OpenAI server (CPU build, its own venv) on the default model, every core, until stop()."""

    def __init__(self, vllm_python: str, log_dir: pathlib.Path, args: str = "") -> None:
        from pdserve.engine.model_fetch import fetch_default_model

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path = log_dir / "vllm.out"
        self._out = open(self.out_path, "w")
        cmd = [
            vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(fetch_default_model()),
            "--dtype",
            "float32",
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            *args.split(),
        ]
        cores = usable_cores()
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            cmd, cwd="/tmp", stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_up(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server failed:\n{self.out_path.read_text()[-3000:]}")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its engine runs in child processes of its own
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._out.close()
