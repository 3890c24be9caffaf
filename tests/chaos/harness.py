"""The chaos suite's processes: a restartable cluster (router, nodes, Redis) and the faults only a
process can take (a frozen engine loop, a Redis restarted empty). The load and the checks every
fault ends with are in tests/chaos/load.py.

    LoadGenerator ──HTTP──► router ──► prefill x2 ──KV──► decode x2        Redis (registry)
         │                                                                     ▲
         └─ every Outcome: tokens, finish, error (status / SSE event / connection), timings

Expected outputs come from Hugging Face greedy on the same tiny weights, computed once per prompt.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import httpx

from tests import web
from tests.cluster import ROOT, NodeProcess, RedisServer, free_port

STALL_TIMEOUT_S = 1.5  # a node whose loop made no progress for this long leaves the registry
HEARTBEAT = ["--heartbeat-interval", "0.2", "--heartbeat-ttl", "1.5", "--stall-timeout", str(STALL_TIMEOUT_S)]
NODE_ARGS = ["--num-kv-blocks", "256", *HEARTBEAT]
CHUNK_TIMEOUT_S = 6.0  # the router's no-output deadline in these tests
# A request's whole life in the router: its attempts, each waiting at most a chunk timeout per reply.
REQUEST_DEADLINE_S = 3 * CHUNK_TIMEOUT_S + 10
ROUTER_ARGS = [
    "--disagg-threshold",
    "32",
    "--chunk-timeout-s",
    str(CHUNK_TIMEOUT_S),
    "--node-expiry-s",
    "1.5",
    "--request-ttl-s",
    "60",
]
_GAUGE_RE = re.compile(r'^pdserve_node_kv_blocks_used\{node_id="([^"]+)",role="(\w+)"\} (\d+)(?:\.0)?$', re.M)


class Router:
    """``pdserve router`` on a given (or free) port; restartable on the same port. ``redis_url``
    None: static mode, the nodes' control addresses in ``extra`` (--prefill A B --decode C D)."""

    def __init__(self, model: pathlib.Path, redis_url: str | None, tmp: pathlib.Path, *extra: str, port=None):
        self.model, self.redis_url, self.tmp, self.extra = model, redis_url, tmp, extra
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.log_path = self.tmp / f"router-{self.port}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pdserve", "router", "--model", str(self.model), "--port"]
        cmd += [str(self.port), *(["--redis", self.redis_url] if self.redis_url else [])]
        cmd += ["--poll-interval-s", "0.2", *self.extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited:\n{self.log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if web.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"router not healthy:\n{self.log_path.read_text()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


class PasswordRedis:
    """redis-server that needs a password (requirepass); ``url`` carries it."""

    def __init__(self, tmp: pathlib.Path, password: str) -> None:
        import shutil

        import redis as redis_py

        self.port = free_port()
        self.url = f"redis://:{password}@127.0.0.1:{self.port}/0"
        cmd = [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(tmp), "--requirepass", password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis_py.Redis.from_url(self.url, socket_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis_py.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)


class Cluster:
    """Redis, 2 prefill and 2 decode nodes, a router; nodes and Redis can be killed and replaced.

    ``static``: no Redis; each node has fixed ports, the router lists their control addresses
    (``pdserve up --no-redis``), and a replacement takes its victim's ports."""

    def __init__(
        self,
        tmp: pathlib.Path,
        model: pathlib.Path,
        roles=("prefill", "prefill", "decode", "decode"),
        redis_password: str | None = None,
        static: bool = False,
        tp: int = 1,
    ):
        """``tp``: every node's tensor-parallel size (its ranks: the node and tp - 1 workers)."""
        self.tmp, self.model, self.static = tmp, model, static
        self.node_args = [*NODE_ARGS, *(["--tensor-parallel-size", str(tp)] if tp > 1 else [])]
        self.redis = (
            None if static else PasswordRedis(tmp, redis_password) if redis_password else RedisServer(tmp)
        )
        self._ports: dict[int, list[str]] = {}  # slot -> the node's fixed port flags (static mode)
        self.nodes: list[NodeProcess] = [self._node(role, slot) for slot, role in enumerate(roles)]
        if static:
            addrs = {
                r: [f"tcp://127.0.0.1:{self._ports[i][1]}" for i, x in enumerate(roles) if x == r]
                for r in roles
            }
            nodes = ["--prefill", *addrs["prefill"], "--decode", *addrs["decode"]]
            self.router = Router(model, None, tmp, *ROUTER_ARGS, *nodes)
        else:
            self.router = Router(model, self.redis.url, tmp, *ROUTER_ARGS)
        for node in self.nodes:
            node.wait_ready()
        self.router.wait_healthy()
        self.wait_members(roles.count("prefill"), roles.count("decode"))

    def _node(self, role: str, slot: int) -> NodeProcess:
        if not self.static:
            return NodeProcess(role, str(self.model), self.tmp, self.redis.url, self.node_args)
        ports = self._ports.setdefault(slot, ["--port", str(free_port()), "--kv-port", str(free_port())])
        return NodeProcess(role, str(self.model), self.tmp, None, [*self.node_args, *ports])

    def live(self, role: str) -> list[NodeProcess]:
        return [n for n in self.nodes if n.role == role and n.proc.poll() is None]

    def replace(self, victim: NodeProcess) -> NodeProcess:
        """A fresh node of the victim's role in its place (the victim must be gone)."""
        assert victim.proc.poll() is not None
        node = self._node(victim.role, self.nodes.index(victim))
        node.wait_ready()
        self.nodes[self.nodes.index(victim)] = node
        victim.close()
        return node

    def health(self) -> dict:
        return web.get(self.router.url + "/health", timeout=5).json()

    def wait_members(self, num_prefill: int, num_decode: int, timeout_s: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                health = self.health()
                if (health["num_prefill"], health["num_decode"]) == (num_prefill, num_decode):
                    return health
            if time.monotonic() > deadline:
                raise AssertionError(f"router sees {health}, wanted {num_prefill}P + {num_decode}D")
            time.sleep(0.1)

    def used_blocks(self) -> dict[str, int]:
        """KV blocks held by live requests on each node the router lists, read through /metrics."""
        text = web.get(self.router.url + "/metrics", timeout=5).text
        return {node_id: int(num) for node_id, _, num in _GAUGE_RE.findall(text)}

    def wait_idle(self, timeout_s: float = 15.0) -> dict[str, int]:
        """Used blocks per node once all are 0 (or as they stand at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            used = self.used_blocks()
            if (used and not any(used.values())) or time.monotonic() > deadline:
                return used
            time.sleep(0.2)

    def close(self) -> None:
        self.router.close()
        for node in self.nodes:
            if node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.proc.pid, signal.SIGCONT)
            node.close()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                os.kill(self.redis.proc.pid, signal.SIGCONT)
            self.redis.stop()


# --------------------------------------------------------------------------- a stuck loop
@contextlib.contextmanager
def main_thread_frozen(pid: int):
    """Stop only the main thread of ``pid`` (the node's engine loop) with ptrace, leaving its other
    threads (heartbeats, ZeroMQ I/O) running: a loop stuck in a step, not a dead process. The
    ptrace calls must come from one thread, the caller's."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    seize, interrupt, detach = 0x4206, 0x4207, 17
    if libc.ptrace(seize, pid, None, None) != 0:
        raise OSError(ctypes.get_errno(), "PTRACE_SEIZE failed")
    try:
        if libc.ptrace(interrupt, pid, None, None) != 0:
            raise OSError(ctypes.get_errno(), "PTRACE_INTERRUPT failed")
        os.waitpid(pid, 0x40000000)  # __WALL: the main thread is in its ptrace stop
        yield
    finally:
        libc.ptrace(detach, pid, None, None)


def restart_redis(redis: RedisServer, tmp: pathlib.Path, timeout_s: float = 10.0) -> None:
    """A fresh, empty redis-server on the port the dead one had (the nodes and router reconnect)."""
    import shutil

    import redis as redis_py

    redis.proc = subprocess.Popen(
        [shutil.which("redis-server"), "--port", str(redis.port), "--bind", "127.0.0.1", "--save", ""]
        + ["--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis_py.Redis(port=redis.port, socket_timeout=2)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis_py.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
