"""The compose test's handle on Docker: one compose project, its containers, and the router's view.

Runs the repository's docker-compose.yml as it is, plus override files named on the command line
(kept outside the repository, e.g. host networking for builds on machines without a registry).
`docker compose` (v2) is used where installed, else Debian's `docker-compose` (v1): both read the
same file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# A node's line in the router's /metrics: one per live node record in Redis.
_NODE_SAMPLE = re.compile(r'^pdserve_node_kv_blocks_total\{node_id="([^"]+)",role="(\w+)"\}', re.M)


def compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> float:
    """Seconds until ``check()`` held; RuntimeError after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)
    return time.monotonic() - start


class Project:
    def __init__(self, client: list[str], name: str, overrides: list[Path], env: dict[str, str]) -> None:
        files = [ROOT / "docker-compose.yml", *overrides]
        self.base = [*client, "-p", name, *(arg for f in files for arg in ("-f", str(f)))]
        self.name = name
        self.env = {**os.environ, **env}

    def run(self, *args: str, timeout_s: float = 300, check: bool = True) -> str:
        result = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, cwd=ROOT, env=self.env, timeout=timeout_s
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        return result.stdout

    def up(self, num_prefill: int, num_decode: int, build: bool = False, timeout_s: float = 900) -> None:
        """Bring the pools to these sizes; existing containers are kept (stopped ones are started)."""
        extra = ["--build"] if build else ["--no-recreate"]
        self.run(
            "up",
            "-d",
            *extra,
            "--scale",
            f"prefill={num_prefill}",
            "--scale",
            f"decode={num_decode}",
            timeout_s=timeout_s,
        )

    def containers(self, service: str, running_only: bool = True) -> list[str]:
        """Container ids of a service, oldest first."""
        flags = [
            "--filter",
            f"label=com.docker.compose.project={self.name}",
            "--filter",
            f"label=com.docker.compose.service={service}",
            "--format",
            "{{.ID}}",
        ]
        out = subprocess.run(
            ["docker", "ps", *([] if running_only else ["-a"]), *flags],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        return list(reversed(out.split()))

    def container_state(self, container: str) -> str:
        return docker("inspect", "-f", "{{.State.Status}}", container).strip()

    def container_env(self, container: str) -> list[str]:
        """The container's environment as NAME=value strings."""
        return docker("inspect", "-f", "{{range .Config.Env}}{{println .}}{{end}}", container).split("\n")

    def logs_since(self, container: str, since: float) -> str:
        result = subprocess.run(
            ["docker", "logs", "--since", f"{since:.3f}", container],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result.stdout + result.stderr

    def follow_logs(self, container: str, path: Path) -> subprocess.Popen:
        """``docker logs -f`` into ``path``: it ends with the container, so a removed one's log stays."""
        with open(path, "w") as out:
            return subprocess.Popen(
                ["docker", "logs", "-f", "--since", f"{time.time():.3f}", container],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "-t", "10", timeout_s=300, check=False)


def docker(*args: str, timeout_s: float = 60) -> str:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, check=True, timeout=timeout_s
    ).stdout


def pools(base_url: str) -> dict[str, list[str]]:
    """Node ids by role, as the router sees the registry now (empty when it does not answer)."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, list[str]] = {}
    for node_id, role in _NODE_SAMPLE.findall(text):
        out.setdefault(role, []).append(node_id)
    return out


def counter(base_url: str, name: str) -> float:
    """A counter's value summed over its labels (0 before its first sample)."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def pool_size_is(base_url: str, num_prefill: int, num_decode: int) -> Callable[[], bool]:
    def check() -> bool:
        now = pools(base_url)
        return len(now.get("prefill", [])) == num_prefill and len(now.get("decode", [])) == num_decode

    return check


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False
