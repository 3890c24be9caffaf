"""Real processes for end-to-end tests: a private redis-server, node processes, a minimal client."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import time

import zmq

from pdserve.launcher.commands import up_argv
from pdserve.launcher.ports import free_port
from pdserve.protocol.messages import (
    AbortRequest,
    GenerateRequest,
    NodeStatus,
    RequestFailed,
    StatusQuery,
    TokenChunk,
    decode,
    encode,
)
from tests import forkserver, web

ROOT = pathlib.Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def pdserve_up(model: str | pathlib.Path, log_dir: pathlib.Path, *flags: str, start_timeout_s: float = 240.0):
    """`pdserve up --model MODEL FLAGS` on a free port, as a user starts it: yields the router's URL
    once /health says 200; SIGINT to the launcher at the end (SIGKILL after 60 s)."""
    import httpx  # here: most users of this module run no HTTP

    port = free_port()
    cmd = up_argv(port, log_dir, *flags, model=model)
    out = open(log_dir / "up.out", "w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if web.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert up.poll() is None and time.monotonic() < deadline, (log_dir / "up.out").read_text()
            time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        out.close()


class RedisServer:
    """redis-server on a free loopback port, no persistence; stopped on exit."""

    def __init__(self, tmp: pathlib.Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not on PATH (make test installs it)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        self.client = redis.Redis(port=self.port, socket_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)


class NodeProcess:
    """``pdserve prefill|decode`` in a subprocess; ``addrs`` once it is serving."""

    def __init__(
        self,
        role: str,
        model: str,
        tmp: pathlib.Path,
        redis_url: str | None = None,
        extra: list[str] | None = None,
        threads: int | None = 1,  # None: the node's automatic count (engine/machine/cpu_share.py)
        cpus: set[int] | None = None,  # the CPUs the node may use; None: this process's
        pythonpath: tuple[str, ...] = (),  # folders ahead of the checkout on the node's PYTHONPATH
    ) -> None:
        self.role = role
        self.redis_url = redis_url
        self.ready_file = tmp / f"{role}-{time.monotonic_ns()}.json"
        self.log_path = tmp / f"{self.ready_file.stem}.log"
        args = [  # pdserve's, after `python -m pdserve`
            role,
            "--model",
            model,
            "--ready-file",
            str(self.ready_file),
            *(["--threads", str(threads)] if threads is not None else []),
            *(extra or []),
        ]
        if redis_url:
            args += ["--redis", redis_url]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(ROOT)])}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self._log = open(self.log_path, "w")
        # forked from the session's pre-imported node where it can be (tests/forkserver.py)
        self.proc = forkserver.spawn(args, env=env, cwd=ROOT, log=self._log, cpus=cpus)
        self.addrs: dict = {}

    def wait_ready(self, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.role} node did not start:\n{self.log()}")
            time.sleep(0.05)
        self.addrs = json.loads(self.ready_file.read_text())
        return self.addrs

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def events(self, name: str) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("event") == name:
                        out.append(record)
        return out

    def terminate(self, timeout_s: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._log.close()


def close_all(router, nodes: list[NodeProcess], redis: RedisServer) -> None:
    """Tear a cluster down: the router, then every node (continued first if a test left it
    stopped: a stopped process cannot take its SIGTERM), then Redis."""
    router.close()
    for node in nodes:
        if node.proc.poll() is None:
            os.kill(node.proc.pid, signal.SIGCONT)
        node.close()
    redis.stop()


class Client:
    """A bare node client (no router): sends GenerateRequests, collects TokenChunks."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind("tcp://127.0.0.1:0")
        self.reply_addr = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dealers: dict[str, zmq.Socket] = {}
        self._via_prefill: set[str] = set()  # request ids whose first token comes from a prefill node

    def _dealer(self, addr: str) -> zmq.Socket:
        if addr not in self.dealers:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self.dealers[addr] = sock
        return self.dealers[addr]

    def generate(
        self,
        node: dict,
        request_id: str,
        token_ids: list[int],
        params: dict,
        decode: dict | None = None,
        ttl_s: float = 60.0,
    ) -> None:
        decode_addr = decode["kv_addr"] if decode else None
        if decode is not None:
            self._via_prefill.add(request_id)
        now = time.time()
        msg = GenerateRequest(
            request_id=request_id,
            token_ids=tuple(token_ids),
            sampling_params=params,
            reply_addr=self.reply_addr,
            decode_addr=decode_addr,
            deadline=now + ttl_s,
            arrival_time=now,
        )
        self._dealer(node["control_addr"]).send(encode(msg))

    def status(self, node: dict, timeout_s: float = 5.0) -> dict:
        """The node's NodeInfo fields, asked over its control socket (static mode)."""
        sock = self._dealer(node["control_addr"])
        nonce = time.monotonic_ns() & 0xFFFFFFFF
        sock.send(encode(StatusQuery(nonce=nonce)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(100):
                msg = decode(sock.recv())
                if isinstance(msg, NodeStatus) and msg.nonce == nonce:
                    return dataclasses.asdict(msg.info) if msg.info is not None else {}
        raise TimeoutError(f"no status from {node['control_addr']}")

    def wait_idle(self, node: dict, timeout_s: float = 10.0) -> dict:
        """Status once every block is back in the free pool (transfers settle asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.status(node)
            if info["num_blocks_free"] == info["num_blocks_total"] or time.monotonic() > deadline:
                return info
            time.sleep(0.05)

    def abort(self, node: dict, request_id: str) -> None:
        self._dealer(node["control_addr"]).send(encode(AbortRequest(request_id=request_id, reason="test")))

    def collect(self, request_ids: list[str], timeout_s: float = 60.0) -> dict[str, dict]:
        """Until every request finished or failed: tokens, finish reason, chunk arrival times.

        The prefill node's first token and the decode node's chunks come on separate connections,
        so the decode node's may overtake it: as the router does, the first token goes first, and a
        request sent through a prefill node is done only once that token arrived too."""
        results = {
            rid: {"tokens": [], "finish": None, "chunks": [], "failed": None, "first": None}
            for rid in request_ids
        }
        pending = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            if not self.pull.poll(100):
                continue
            msg = decode(self.pull.recv())
            r = results.get(msg.request_id)
            if r is None:
                continue
            if isinstance(msg, RequestFailed):
                r["failed"] = msg
                pending.discard(msg.request_id)
            elif isinstance(msg, TokenChunk):
                r["chunks"].append((time.time(), msg))
                if msg.is_first and msg.request_id in self._via_prefill:
                    r["first"] = list(msg.token_ids)
                    r["tokens"] = r["first"] + r["tokens"]
                else:
                    r["tokens"] += list(msg.token_ids)
                if msg.finish_reason is not None:
                    r["finish"] = msg.finish_reason
                waits_for_first = msg.request_id in self._via_prefill and r["first"] is None
                if r["finish"] is not None and not waits_for_first:
                    pending.discard(msg.request_id)
        assert not pending, f"requests did not finish in {timeout_s}s: {sorted(pending)}"
        return results

    def close(self) -> None:
        self.ctx.destroy(linger=0)
