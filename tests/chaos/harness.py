"""The chaos suite's parts: a restartable cluster of real processes, a steady mixed load, and the
checks every fault ends with (each request ended in time, cleanly; survivors idle; a report row).

    LoadGenerator ──HTTP──► router ──► prefill x2 ──KV──► decode x2        Redis (registry)
         │                                                                     ▲
         └─ every Outcome: tokens, finish, error (status / SSE event / connection), timings

Expected outputs come from Hugging Face greedy on the same tiny weights, computed once per prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

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
_GAUGE_RE = re.compile(r'^pdserve_node_kv_blocks_used\{node_id="([^"]+)",role="(\w+)"\} (\d+)$', re.M)


class Router:
    """``pdserve router`` on a given (or free) port; restartable on the same port."""

    def __init__(self, model: pathlib.Path, redis_url: str, tmp: pathlib.Path, *extra: str, port=None):
        self.model, self.redis_url, self.tmp, self.extra = model, redis_url, tmp, extra
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.log_path = self.tmp / f"router-{self.port}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pdserve_cli", "router", "--model", str(self.model), "--port"]
        cmd += [str(self.port), "--redis", self.redis_url, "--poll-interval-s", "0.2", *self.extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited:\n{self.log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
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
    """Redis, 2 prefill and 2 decode nodes, a router; nodes and Redis can be killed and replaced."""

    def __init__(
        self,
        tmp: pathlib.Path,
        model: pathlib.Path,
        roles=("prefill", "prefill", "decode", "decode"),
        redis_password: str | None = None,
    ):
        self.tmp, self.model = tmp, model
        self.redis = PasswordRedis(tmp, redis_password) if redis_password else RedisServer(tmp)
        self.nodes: list[NodeProcess] = [self._node(role) for role in roles]
        self.router = Router(model, self.redis.url, tmp, *ROUTER_ARGS)
        for node in self.nodes:
            node.wait_ready()
        self.router.wait_healthy()
        self.wait_members(roles.count("prefill"), roles.count("decode"))

    def _node(self, role: str) -> NodeProcess:
        return NodeProcess(role, str(self.model), self.tmp, self.redis.url, NODE_ARGS)

    def live(self, role: str) -> list[NodeProcess]:
        return [n for n in self.nodes if n.role == role and n.proc.poll() is None]

    def replace(self, victim: NodeProcess) -> NodeProcess:
        """A fresh node of the victim's role in its place (the victim must be gone)."""
        assert victim.proc.poll() is not None
        node = self._node(victim.role)
        node.wait_ready()
        self.nodes[self.nodes.index(victim)] = node
        victim.close()
        return node

    def health(self) -> dict:
        return httpx.get(self.router.url + "/health", timeout=5).json()

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
        text = httpx.get(self.router.url + "/metrics", timeout=5).text
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
        with contextlib.suppress(Exception):
            os.kill(self.redis.proc.pid, signal.SIGCONT)
        self.redis.stop()


# --------------------------------------------------------------------------- load
@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    stream: bool
    logprobs: bool


@dataclasses.dataclass(slots=True)
class Outcome:
    spec: Spec
    started: float  # time.monotonic()
    ended: float = 0.0
    status: int | None = None  # HTTP status; None: the connection failed
    tokens: list[int] = dataclasses.field(default_factory=list)  # when logprobs were asked for
    text: str = ""
    finish_reason: str | None = None
    num_completion_tokens: int | None = None  # usage
    num_prompt_tokens: int | None = None  # usage
    error: dict | None = None  # the JSON error body or the SSE error event
    connection_error: str | None = None
    first_token_at: float | None = None  # streamed: when the first token event came

    @property
    def kind(self) -> str:
        """How it ended: complete, sse_error, http_<status>, connection_error, incomplete."""
        if self.connection_error is not None:
            return "connection_error"
        if self.status != 200:
            return f"http_{self.status}"
        if self.error is not None:
            return "sse_error"
        return "complete" if self.finish_reason == "length" else "incomplete"


def prompts(seed: int, num: int) -> list[tuple[int, ...]]:
    """Mixed lengths: short ones prefill on the decode node, long ones go through a prefill node."""
    rng = random.Random(seed)
    lengths = [rng.choice([6, 20, 80, 200, 400]) for _ in range(num)]
    return [tuple(rng.randrange(100, 40000) for _ in range(n)) for n in lengths]


def request_once(url: str, model_name: str, spec: Spec, timeout_s: float = REQUEST_DEADLINE_S) -> Outcome:
    body = {
        "model": model_name,
        "prompt": list(spec.prompt),
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": spec.stream,
    }
    if spec.logprobs:
        body |= {"logprobs": 1, "return_tokens_as_token_ids": True}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    out = Outcome(spec, time.monotonic())
    try:
        if spec.stream:
            _stream(url, body, out, timeout_s)
        else:
            reply = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
            out.status = reply.status_code
            data = reply.json()
            if reply.status_code == 200:
                choice = data["choices"][0]
                out.text, out.finish_reason = choice["text"], choice["finish_reason"]
                out.tokens = _token_ids(choice.get("logprobs"))
                out.num_completion_tokens = data["usage"]["completion_tokens"]
                out.num_prompt_tokens = data["usage"]["prompt_tokens"]
            else:
                out.error = data.get("error")
    except (httpx.TransportError, json.JSONDecodeError) as exc:
        out.connection_error = f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    return out


def _token_ids(logprobs: dict | None) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in (logprobs or {}).get("tokens", [])]


def _stream(url: str, body: dict, out: Outcome, timeout_s: float) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as reply:
        out.status = reply.status_code
        if reply.status_code != 200:
            out.error = json.loads(reply.read()).get("error")
            return
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
                continue
            if event.get("usage"):
                out.num_prompt_tokens = event["usage"]["prompt_tokens"]
                out.num_completion_tokens = event["usage"]["completion_tokens"]
            if not event["choices"]:
                continue
            choice = event["choices"][0]
            if choice["text"] or choice.get("logprobs"):
                out.first_token_at = out.first_token_at or time.monotonic()
            out.text += choice["text"]
            out.tokens += _token_ids(choice.get("logprobs"))
            out.finish_reason = choice["finish_reason"] or out.finish_reason


class LoadGenerator:
    """``concurrency`` client threads sending mixed requests back to back until ``stop()``."""

    def __init__(
        self, url: str, model_name: str, specs: list[Spec], concurrency: int = 8, seed: int = 0
    ) -> None:
        self.url, self.model_name, self.specs = url, model_name, specs
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._rng = random.Random(seed)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]

    def __enter__(self) -> LoadGenerator:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                spec = self._rng.choice(self.specs)
            outcome = request_once(self.url, self.model_name, spec)
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.connection_error is not None:
                time.sleep(0.2)  # the router is down: don't spin

    def in_flight_at(self, moment: float) -> int:
        """Requests started before ``moment`` and ended after it (call after ``stop``)."""
        with self._lock:
            return sum(1 for o in self.outcomes if o.started <= moment <= o.ended)

    def stop(self, timeout_s: float = REQUEST_DEADLINE_S + 10) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        assert not any(t.is_alive() for t in self._threads), "a client request did not end"
        return self.outcomes


def make_specs(seed: int, num: int = 16, long_output: bool = False) -> list[Spec]:
    rng = random.Random(seed)
    out = []
    for i, prompt in enumerate(prompts(seed, num)):
        max_tokens = rng.choice([64, 128]) if long_output and i % 2 == 0 else rng.choice([4, 16, 40])
        out.append(Spec(prompt, max_tokens, stream=i % 2 == 0, logprobs=(i // 2) % 2 == 0))
    return out


# --------------------------------------------------------------------------- checks
class Expected:
    """Hugging Face greedy outputs, each computed once."""

    def __init__(self, model: pathlib.Path) -> None:
        from router.tokenizer import Tokenizer

        self.model = model
        self.tokenizer = Tokenizer(model)
        self._cache: dict[tuple, list[int]] = {}

    def tokens(self, spec: Spec) -> list[int]:
        key = (spec.prompt, spec.max_tokens)
        if key not in self._cache:
            from tests.engine_helpers import hf_greedy

            self._cache[key] = hf_greedy(str(self.model), list(spec.prompt), spec.max_tokens)
        return self._cache[key]

    def check(self, outcome: Outcome) -> None:
        """A complete outcome's output is Hugging Face's, token for token (or as text)."""
        want = self.tokens(outcome.spec)
        if outcome.spec.logprobs:
            assert outcome.tokens == want, outcome
        else:
            assert outcome.text == self.tokenizer.decode(want), outcome
        # Usage counts the prompt once and each output token once (a migrated stream too).
        assert outcome.num_completion_tokens == outcome.spec.max_tokens, outcome
        assert outcome.num_prompt_tokens == len(outcome.spec.prompt), outcome


def check_outcomes(outcomes: list[Outcome], expected: Expected, allowed: set[str]) -> dict[str, int]:
    """Every request ended in time, a complete one equal to HF, every other in an allowed way with
    a clear error; a streamed one that failed had sent a token first (else it had to be retried)."""
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
        assert o.ended - o.started < REQUEST_DEADLINE_S, o
        if o.kind == "complete":
            expected.check(o)
            continue
        assert o.kind in allowed, o
        if o.kind == "sse_error":
            assert o.first_token_at is not None, f"failed before its first token, not retried: {o}"
            assert o.error.get("code") and o.error.get("message"), o
        if o.kind.startswith("http_"):
            assert o.error and o.error.get("message"), o
    return counts


def write_report_row(row: dict) -> None:
    """One line of docs/reliability.md's table, when scripts/chaos_report.py asked for it."""
    path = os.environ.get("PDSERVE_CHAOS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


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
