"""LocalCluster: registry, nodes and router started in order, watched, and stopped together.

    start():  [redis-server] ─► N prefill + M decode (+ C colocated) nodes ─► (ready files) ─► router ─► /health 200
    stop():   router + nodes get SIGTERM (nodes drain and deregister) ─► redis-server last

Every wait has a deadline; a child that exits during start-up fails the launch with its log tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pdserve
from pdserve.launcher.children import Child, stop_all
from pdserve.launcher.commands import pdserve_argv
from pdserve.launcher.plan import ClusterPlan, gpu_share_per_node, kv_fraction_per_node
from pdserve.launcher.registry import find_redis_server, start_redis
from pdserve.protocol.cluster_key import write_new_key

# The folder that holds pdserve/: a checkout's root (its children import it uninstalled) or site-packages.
SOURCE_ROOT = pathlib.Path(pdserve.__file__).resolve().parent.parent


def child_env(threads: int) -> dict[str, str]:
    """A child's environment: this checkout importable, ``threads`` OpenMP/MKL threads."""
    path = os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    n = str(threads)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
    }


class LaunchError(RuntimeError):
    """The cluster could not start; the message says which child and why."""


class LocalCluster:
    def __init__(self, plan: ClusterPlan, say: Callable[[str], None] = print) -> None:
        self.plan = plan
        self.say = say
        self.redis: Child | None = None
        self.redis_url: str | None = plan.redis_url
        self.nodes: list[Child] = []
        self.router: Child | None = None
        self.ready: dict[str, dict] = {}  # node child name -> its ready file (node_id, addresses, pid)
        self._reported: set[str] = set()  # children whose exit was already reported
        self.key_file: pathlib.Path | None = None  # this cluster's key, made at start

    # ----------------------------------------------------------------- start
    def start(self) -> None:
        self._check_port_free()
        if self.redis_url is None and self.plan.use_redis:
            self._start_registry()
        # a key of this cluster's own: it signs the registry records and authenticates every socket
        self.key_file = self.plan.log_dir / "cluster.key"
        write_new_key(self.key_file)
        for role, count in (
            ("prefill", self.plan.num_prefill),
            ("decode", self.plan.num_decode),
            ("colocated", self.plan.num_colocated),
        ):
            self.nodes += [self._start_node(role, i) for i in range(count)]
        self._wait_nodes_ready()
        self.router = self._spawn("router", self._router_argv(), threads=1)
        self._wait_healthy()

    def _env(self, threads: int) -> dict[str, str]:
        return child_env(threads)

    def _spawn(self, name: str, argv: list[str], threads: int) -> Child:
        return Child(name, argv, self.plan.log_dir / f"{name}.log", self._env(threads))

    def _check_port_free(self) -> None:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((self.plan.host, self.plan.port))
            except OSError as exc:
                raise LaunchError(
                    f"cannot bind the router to {self.plan.host}:{self.plan.port} ({exc.strerror}); "
                    "choose another --port"
                ) from None

    def _start_registry(self) -> None:
        binary = find_redis_server()
        if binary is None:
            self.say("registry: no redis-server found; nodes are given to the router as static addresses")
            return
        try:
            self.redis, self.redis_url = start_redis(
                binary, self.plan.log_dir, self._env(1), self.plan.start_timeout_s
            )
        except RuntimeError as exc:
            raise LaunchError(str(exc)) from None

    def _start_node(self, role: str, index: int) -> Child:
        return self._spawn(f"{role}-{index}", self.node_argv(role, index), self.plan.threads_per_node)

    def node_argv(self, role: str, index: int) -> list[str]:
        name = f"{role}-{index}"
        command = ["decode", "--colocated"] if role == "colocated" else [role]
        argv = [
            *pdserve_argv(*command),
            "--model",
            self.plan.model,
            "--host",
            "127.0.0.1",
            "--ready-file",
            str(self._ready_path(name)),
            "--threads" if self.plan.fixed_threads else "--max-threads",
            str(self.plan.threads_per_node * self.plan.tp_of(role)),  # the engine splits them by rank
            *self._tp_args(role),
            *self._kv_share(),
            *self._gpu_share(),
            *self._key_args(),
            *self._offload_args(name),
            *self.plan.node_args,  # after the flags above: a flag given here wins
            *self._device_args(role, index),  # ... but a node's own GPUs win over its --device
        ]
        if self.redis_url:
            argv += ["--redis", self.redis_url]
        return argv

    def _tp_args(self, role: str) -> list[str]:
        tp = self.plan.tp_of(role)
        return [] if tp == 1 else ["--tensor-parallel-size", str(tp)]

    def _kv_share(self) -> list[str]:
        share = kv_fraction_per_node(self.plan.node_budget)
        return [] if share is None else ["--kv-cache-memory-fraction", f"{share:.4g}"]

    def _gpu_share(self) -> list[str]:
        layout = self.plan.gpu_layout
        sharing = self.plan.node_budget if layout is None else layout.nodes_per_gpu
        share = gpu_share_per_node(self.plan.node_args, sharing)
        return [] if share is None else ["--gpu-memory-utilization", f"{share:.4g}"]

    def _device_args(self, role: str, index: int) -> list[str]:
        """The node's first GPU (launcher/gpus.py), where the plan lays the nodes out on GPUs."""
        layout = self.plan.gpu_layout
        return [] if layout is None else ["--device", layout.device_of(self.plan.ordinal(role, index))]

    def _offload_args(self, name: str) -> list[str]:
        """A folder of its own for the node's offload tier (one node per folder)."""
        plan = self.plan
        if plan.kv_offload_dir is None:
            return []
        budget = (
            [] if plan.kv_offload_disk_mb is None else ["--kv-offload-disk-mb", str(plan.kv_offload_disk_mb)]
        )
        return ["--kv-offload-dir", str(plan.kv_offload_dir / name), *budget]

    def _key_args(self) -> list[str]:
        return [] if self.key_file is None else ["--cluster-key-file", str(self.key_file)]

    def _ready_path(self, name: str) -> pathlib.Path:
        return self.plan.log_dir / f"{name}.ready.json"

    def _router_argv(self) -> list[str]:
        argv = [
            *pdserve_argv("router"),
            "--model",
            self.plan.model,
            "--host",
            self.plan.host,
            "--port",
            str(self.plan.port),
            *self._key_args(),
            *self.plan.router_args,
        ]
        if self.redis_url:
            return argv + ["--redis", self.redis_url]
        addrs = {
            role: [r["control_addr"] for r in self.ready.values() if r["role"] == role]
            for role in ("prefill", "decode", "colocated")
        }
        addrs["decode"] += addrs["colocated"]  # the router tells them apart by their status
        return (
            argv
            + (["--prefill", *addrs["prefill"]] if addrs["prefill"] else [])
            + ["--decode", *addrs["decode"]]
        )

    def _fail_if_exited(self, children: list[Child]) -> None:
        for child in children:
            code = child.exit_code()
            if code is not None:
                raise LaunchError(
                    f"{child.name} exited with code {code} during start-up; "
                    f"the end of {child.log_path}:\n{child.log_tail()}"
                )

    def _wait_nodes_ready(self) -> None:
        self._wait_ready(self.nodes)

    def _wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.plan.start_timeout_s
        waiting = list(children)
        while waiting:
            self._fail_if_exited(waiting)
            for child in [c for c in waiting if self._ready_path(c.name).exists()]:
                self.ready[child.name] = json.loads(self._ready_path(child.name).read_text())
                waiting.remove(child)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(c.name for c in waiting)
                raise LaunchError(
                    f"{names} not serving after {self.plan.start_timeout_s:.0f}s; "
                    f"the end of {waiting[0].log_path}:\n{waiting[0].log_tail()}"
                )
            time.sleep(0.05)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.plan.start_timeout_s
        while not self._all_in_pool():
            self._fail_if_exited([self.router, *self.nodes])
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"router's /health not 200 after {self.plan.start_timeout_s:.0f}s; "
                    f"the end of its log:\n{self.router.log_tail()}"
                )
            time.sleep(0.1)

    def _all_in_pool(self) -> bool:
        """Healthy, with every planned node in the router's pool (a decode node alone already
        makes the router healthy, and the first requests would all skip the prefill nodes)."""
        try:
            with urllib.request.urlopen(self.plan.url + "/health", timeout=1) as response:
                body = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False
        p = self.plan
        return (
            body.get("num_prefill", 0) >= p.num_prefill
            and body.get("num_decode", 0) >= p.num_decode
            and body.get("num_colocated", 0) >= p.num_colocated
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.plan.url + "/health", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    # ----------------------------------------------------------------- resizing (launcher/autoscale.py)
    def node_roles(self) -> dict[str, str]:
        """Each running node's role by child name, as its ready file says (a switch rewrites it)."""
        roles = {}
        for child in self.nodes:
            if child.exit_code() is None and child.name in self.ready:
                with contextlib.suppress(OSError, ValueError):
                    self.ready[child.name] = json.loads(self._ready_path(child.name).read_text())
                roles[child.name] = self.ready[child.name]["role"]
        return roles

    def node_id(self, name: str) -> str:
        return self.ready[name]["node_id"]

    def add_node(self, role: str) -> str:
        """Start one more node of ``role``; its child name once it serves (its ready file)."""
        index = sum(c.name.startswith(f"{role}-") for c in self.nodes)
        child = self._start_node(role, index)
        self.nodes.append(child)
        self._wait_ready([child])
        return child.name

    def stop_node(self, name: str) -> None:
        """Drain one node and wait for it to exit (SIGTERM: it finishes or hands back its work)."""
        child = next(c for c in self.nodes if c.name == name)
        stop_all([child], self.plan.stop_timeout_s)

    # ----------------------------------------------------------------- run and stop
    def watch(self, poll_s: float = 0.2, tick: Callable[[], None] | None = None) -> int:
        """Until the router exits (its code is returned); reports nodes that leave meanwhile, and
        calls ``tick`` (the autoscaler) each poll. A node that exits is not restarted: the pools
        shrink, as when one is drained."""
        assert self.router is not None, "start() first"
        while True:
            if tick is not None:
                tick()
            code = self.router.exit_code()
            if code is not None:
                self.say(f"router exited with code {code}; the end of its log:\n{self.router.log_tail()}")
                return code or 1
            for child in self.nodes:
                self._report_exit(child)
            time.sleep(poll_s)

    def _report_exit(self, child: Child) -> None:
        code = child.exit_code()
        if code is None or child.name in self._reported:
            return
        self._reported.add(child.name)
        if code == 0:
            self.say(f"{child.name} left the cluster (drained, exit 0)")
        else:
            self.say(f"{child.name} exited with code {code}; the end of its log:\n{child.log_tail()}")

    def stop(self) -> None:
        """Router and nodes first (nodes drain and deregister while Redis is still up), Redis last."""
        stop_all([c for c in (self.router, *self.nodes) if c is not None], self.plan.stop_timeout_s)
        if self.redis is not None:
            stop_all([self.redis], self.plan.stop_timeout_s)

    def children(self) -> list[Child]:
        return [c for c in (self.redis, *self.nodes, self.router) if c is not None]
