"""A fork server for the tests' node processes: `python -m pdserve prefill|decode ...` without
paying its imports each time.

A node's start is about 4 s of CPU, nearly all of it imports (torch, and transformers' config
chain, which pulls in torch.distributed.tensor and sympy); the suite starts a hundred nodes.
This module runs one process per test session that imports what a node imports, once, then forks
a child for each node it is asked for. The child is the node: it runs ``pdserve``'s own ``main``
with the node's arguments, its output in the node's log, its exit code reported back. Nothing
runs in the server before a fork but imports (no thread, no torch operation, no socket beyond
its own), so a child starts as a fresh ``python -m pdserve`` would, minus the import time.

A server serves one environment, the one it was started with: modules read some variables when
they load (the fault switches in kv_transfer/sender.py, libgomp's own), so a node forked from it
must have been given exactly that environment. An environment gets its server at its second request
(the first starts with python, as does every one with PDSERVE_TEST_FORKSERVER=0); past MAX_SERVERS
the least recently used server is retired. ``STATS`` counts what happened (printed at the end of a
run, tests/conftest.py).

The handle ``spawn`` returns answers as much of ``subprocess.Popen`` as the tests use: ``pid``,
``poll``, ``wait``, ``returncode``, ``send_signal``, ``terminate``, ``kill``. The node is not the
test process's child, so the server reaps it and writes its exit code (negative: the signal that
ended it, as Popen says) to a status file the handle reads.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import pathlib
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENABLE_ENV = "PDSERVE_TEST_FORKSERVER"
_PRELOAD = (  # what a node imports on its way to ready (python -X importtime -m pdserve decode ...)
    "pdserve.cli.main",  # first: it sets the OpenMP wait policy before torch loads
    "torch",
    "transformers",
    "pdserve.node.host",
    "pdserve.engine.llm_engine",
    "pdserve.decode_node.server",
    "pdserve.prefill_node.server",
    "pdserve.router.app",  # the routers the tests start come from here too (tests/test_router_cluster.py)
)
_POLL_S = 0.02
_PER_TEST = ("PYTEST_CURRENT_TEST",)  # pytest sets it for each test; no node reads it
MAX_SERVERS = 4  # each holds a node's imports (about 0.5 GB, shared with its children until written)


def _served(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The environment a server is started with and known by."""
    return tuple(sorted((key, value) for key, value in env.items() if key not in _PER_TEST))


class ForkedProcess:
    """A node forked by the server: the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, pid: int, args: list[str], status: pathlib.Path) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(_POLL_S)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Client:
    """One environment's server, as the test process sees it (``_server_for`` starts and retires them)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="pdserve-forkserver-"))
        self.socket_path = self.dir / "server.sock"
        self.log = open(self.dir / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", str(self.socket_path)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.count = 0

    def ready(self, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def spawn(
        self, args: list[str], cwd: pathlib.Path, log: pathlib.Path, cpus: set[int] | None
    ) -> ForkedProcess:
        self.count += 1
        status = self.dir / f"status-{self.count}"
        request = {"args": args, "cwd": str(cwd), "log": str(log), "cpus": sorted(cpus) if cpus else None}
        request["status"] = str(status)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(str(self.socket_path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(conn.makefile("rb").readline())
        return ForkedProcess(reply["pid"], args, status)

    def retire(self) -> None:
        """No more nodes from it; it exits once the ones it forked have (it reports their exits)."""
        if self.proc.poll() is None:
            self.proc.terminate()


_servers: dict[tuple[tuple[str, str], ...], _Client] = {}  # by environment, least recently used first
_retired: list[_Client] = []
_requests: collections.Counter = collections.Counter()  # requests by environment
STATS = {"forked": 0, "started with python": 0, "servers": 0}


@atexit.register
def _shutdown() -> None:
    for server in [*_servers.values(), *_retired]:
        server.retire()
    for server in [*_servers.values(), *_retired]:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(2)
        server.log.close()
        shutil.rmtree(server.dir, ignore_errors=True)


def _server_for(env: dict[str, str]) -> _Client | None:
    """The server for ``env``: started at its second request (a one-off environment, say a test's own
    variable, is cheaper started with python), the least recently used one retired past
    MAX_SERVERS (the test process's environment moves on as in-process engines set variables)."""
    key = _served(env)
    _requests[key] += 1
    server = _servers.pop(key, None)
    if server is None and _requests[key] >= 2:
        if len(_servers) >= MAX_SERVERS:
            oldest = next(iter(_servers))
            _retired.append(_servers.pop(oldest))
            _retired[-1].retire()
        server = _Client(dict(key))
        STATS["servers"] += 1
        if not server.ready():
            print(f"tests/forkserver.py: a server did not start; see {server.log.name}")
            _retired.append(server)
            return None
    if server is not None:
        _servers[key] = server  # now the most recently used
    return server


def spawn(
    args: list[str], *, env: dict[str, str], cwd: pathlib.Path, log, cpus: set[int] | None = None
) -> ForkedProcess | subprocess.Popen:
    """``python -m pdserve ARGS`` with ``env``, its output into the open file ``log``: forked by the
    session's server for ``env`` where there is one (``_server_for``), else started with python."""
    if os.environ.get(ENABLE_ENV, "1") != "0":
        server = _server_for(env)
        if server is not None and server.proc.poll() is None:
            STATS["forked"] += 1
            return server.spawn(args, cwd, pathlib.Path(log.name), cpus)
    STATS["started with python"] += 1
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve", *args],
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None,
    )


# The server's side.


def _reap(children: dict[int, str]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            with contextlib.suppress(OSError):  # the test process is gone and took the folder
                pathlib.Path(path + ".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
                os.replace(path + ".tmp", path)


def _become_node(request: dict) -> int:
    """In the forked child: the node, as `python -m pdserve ARGS` runs it; its exit code."""
    os.chdir(request["cwd"])
    fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if request["cpus"]:
        os.sched_setaffinity(0, request["cpus"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import random

    random.seed()  # the server's state is every child's: draw fresh, as a new interpreter does
    import pdserve
    from pdserve.cli.main import main

    sys.argv = [str(pathlib.Path(pdserve.__file__).parent / "__main__.py"), *request["args"]]
    try:
        return main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def serve(socket_path: str) -> int:
    """Import what a node imports, then fork a node per request until the test process is gone."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pdserve.engine.models import MODEL_REGISTRY

    # the config class of every model type the engine runs (transformers imports each on demand)
    for model_type, architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if architecture in MODEL_REGISTRY:
            transformers.AutoConfig.for_model(model_type)
    from pdserve.kernels import cpu_ext

    cpu_ext.load()  # the node's C++ kernels: built once by `make native`, loaded here
    import threading

    if threading.active_count() != 1:  # a fork copies only this thread: refuse rather than hang
        print(f"forkserver: {threading.active_count()} threads after the imports; not serving")
        return 1
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(64)
    os.replace(socket_path + ".tmp", socket_path)  # the path appears once it accepts
    retiring: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: retiring.append(True))
    children: dict[int, str] = {}
    while os.getppid() == parent:
        if retiring and listener.fileno() >= 0:  # no new nodes; the ones under way still get reaped
            listener.close()
            os.unlink(socket_path)
        if retiring and not children:
            break
        readable, _, _ = select.select([listener] if listener.fileno() >= 0 else [], [], [], _POLL_S * 5)
        _reap(children)
        if not readable:
            continue
        conn, _ = listener.accept()
        request = json.loads(conn.makefile("rb").readline())
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            code = _become_node(request)
            sys.stdout.flush()
            sys.stderr.flush()
            # unwind to the interpreter's own exit (its threads joined, atexit run), as a node does
            raise SystemExit(code)
        children[pid] = request["status"]
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
