"""Shared test set-up: no model hub, gpu-marked tests skipped without CUDA, the default model,
and the ``processes`` marker that splits the suite into tiers.

A test that starts a process (a node, a router, Redis, a cluster, a child Python) says so by using
the ``processes`` fixture, directly or through a fixture that uses it, or with
``pytestmark = pytest.mark.usefixtures("processes")``; the fixture gives it the ``processes``
marker. ``make test-fast`` runs the tests without it. Any other test that starts a process fails:
the spawning calls are guarded for the duration of each unmarked test (setup, call, teardown).

Markers are declared in pyproject.toml's [tool.pytest.ini_options], not here.
"""

from __future__ import annotations

import multiprocessing.process
import os
import pathlib
import subprocess

import pytest

# Set before any test imports transformers or huggingface_hub, which read them once:
# the tests must never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _worker_port_range() -> None:
    """Under pytest-xdist each worker chooses its servers' ports (launcher.ports) from its own slice
    of the span below the ephemeral range, inherited by every process it starts: two workers never
    pick one port in the moment between choosing it and a server binding it."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit():
        return
    from pdserve.launcher import ports

    span = ports._below_ephemeral()
    if span is None:
        return
    width = len(span) // int(count)
    low = span.start + int(worker[2:]) * width
    os.environ[ports.RANGE_ENV] = f"{low}-{low + width - 1}"


_worker_port_range()


PROCESSES = "processes"
SESSION_CLUSTERS = ("api_cluster", "default_model_cluster")  # started once, shared by modules


@pytest.fixture(scope="session")
def processes() -> None:
    """Marks the tests that use it (through any fixture) as starting processes; see the module doc."""


class _ProcessGuard:
    """Fails an unmarked test the moment it starts a process, naming the call."""

    def __init__(self) -> None:
        self.allowed = True  # outside a test (collection, the session's own set-up)

    def wrap(self, owner, name: str) -> None:
        real = getattr(owner, name)
        guard = self

        def guarded(*args, **kwargs):
            if not guard.allowed:
                raise AssertionError(
                    f"this test started a process ({owner.__name__}.{name}) without the `processes` "
                    "fixture: use it, directly or through a fixture (tests/conftest.py)"
                )
            return real(*args, **kwargs)

        setattr(owner, name, guarded)


_GUARD = _ProcessGuard()


def pytest_configure(config: pytest.Config) -> None:
    spawners: list = []
    try:  # a node forked by the session's server (tests/forkserver.py) is a process started too
        from tests import forkserver

        spawners.append((forkserver, "spawn"))
    except ModuleNotFoundError:  # this file copied where tests/ is not a package (tests/test_tiers.py)
        pass
    for owner, name in (
        *spawners,
        (subprocess.Popen, "__init__"),
        (os, "fork"),
        (os, "forkpty"),
        (os, "posix_spawn"),
        (os, "posix_spawnp"),
        (os, "system"),
        (multiprocessing.process.BaseProcess, "start"),
    ):
        _GUARD.wrap(owner, name)


def pytest_terminal_summary(terminalreporter) -> None:
    try:
        from tests import forkserver
    except ModuleNotFoundError:  # this file copied where tests/ is not a package (tests/test_tiers.py)
        return
    if forkserver.STATS["forked"] or forkserver.STATS["started with python"]:
        counts = ", ".join(f"{name} {count}" for name, count in forkserver.STATS.items())
        terminalreporter.write_line(f"tests/forkserver.py: nodes and routers {counts}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _GUARD.allowed = item.get_closest_marker(PROCESSES) is not None
    try:
        yield
    finally:
        _GUARD.allowed = True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if PROCESSES in fixtures:
            item.add_marker(PROCESSES)
        # pytest-xdist (--dist loadgroup) sends a group to one worker: a module's tests share its
        # module-scoped clusters, and every user of one of the session's clusters shares that one
        shared = [name for name in SESSION_CLUSTERS if name in fixtures]
        group = shared[0] if shared else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when gpu tests were collected: torch is slow to import

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: torch.cuda.is_available() is false")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def shipped_default_model() -> pathlib.Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, as users get it.

    Converted once into the shared cache ($PDSERVE_CACHE or ~/.cache/pdserve, about 30 s and
    520 MB the first time); later sessions find it there. Its config.json names the GGUF it was
    dequantized from, so ``--dtype auto`` runs it in bfloat16 on CPUs with bf16 arithmetic.
    """
    from pdserve.engine.model_fetch import fetch_default_model

    return fetch_default_model(progress=False)


@pytest.fixture(scope="session")
def default_model_dir(shipped_default_model: pathlib.Path, tmp_path_factory) -> pathlib.Path:
    """The default model as a float32 checkpoint, under the same folder name (the served model
    id): the shipped folder's files linked, its config.json without the quantized source, so that
    ``--dtype auto`` runs it in float32 on any CPU and the tests that compare it with HF fp32, or
    one path with another, compare token for token (bf16 agrees only within its rounding)."""
    import json

    from pdserve.engine.config import DEQUANTIZED_FROM_KEY

    folder = tmp_path_factory.mktemp("default-model-fp32") / shipped_default_model.name
    folder.mkdir()
    for item in shipped_default_model.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((shipped_default_model / "config.json").read_text())
    config.pop(DEQUANTIZED_FROM_KEY, None)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


@pytest.fixture(scope="session")
def api_cluster(processes, tmp_path_factory, default_model_dir):
    """The API-surface cluster, started once for every module that uses it: 1 prefill + 1 decode
    node on a real Redis with two routers ("pd" disaggregates every prompt of 8 tokens or more,
    "decode_only" never does), and a colocated node with its own router ("colocated", on the same
    Redis's database 1); the P/D routers allow vLLM's -1 (--max-logprobs -1). Yields (model
    folder, routers by name, nodes by name)."""
    from tests.cluster import NodeProcess, RedisServer
    from tests.test_router_cluster import RouterProcess, serving, tiny_model_with_tokenizer

    tmp = tmp_path_factory.mktemp("api-surface")
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)
    redis = RedisServer(tmp)
    second = redis.url.removesuffix("/0") + "/1"  # the colocated node's own registry
    extra = ["--num-kv-blocks", "512", "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2"]
    nodes = {role: NodeProcess(role, str(model), tmp, redis.url, extra) for role in ("prefill", "decode")}
    nodes["colocated"] = NodeProcess("decode", str(model), tmp, second, [*extra, "--colocated"])
    whole_vocab = ("--max-logprobs", "-1")  # vLLM's -1 (the whole vocabulary) allowed, as vLLM's flag does
    routers = {
        "pd": RouterProcess(
            model, redis.url, tmp, "--disagg-threshold", "8", "--local-prefill-margin-s", "-1", *whole_vocab
        ),
        "decode_only": RouterProcess(model, redis.url, tmp, "--disagg-threshold", "100000", *whole_vocab),
        "colocated": RouterProcess(model, second, tmp),
    }
    with serving(redis, nodes.values(), routers.values()):
        yield model, routers, nodes


@pytest.fixture(scope="session")
def default_model_cluster(processes, tmp_path_factory, default_model_dir):
    """The default model (float32, default_model_dir) served by 1 prefill + 1 decode node on a real
    Redis, started once for the modules that ask a trained model (answers that finish, grammars that
    close) through two routers: "pd" disaggregates every prompt, "decode_only" never does. Yields
    (routers by name, nodes by role)."""
    from tests.cluster import NodeProcess, RedisServer
    from tests.test_router_cluster import RouterProcess, serving

    tmp = tmp_path_factory.mktemp("default-model-cluster")
    redis = RedisServer(tmp)
    extra = ["--kv-cache-memory-mb", "128", "--heartbeat-interval", "0.2"]
    nodes = {
        role: NodeProcess(role, str(default_model_dir), tmp, redis.url, extra)
        for role in ("prefill", "decode")
    }
    routers = {
        "pd": RouterProcess(default_model_dir, redis.url, tmp, "--disagg-threshold", "0"),
        "decode_only": RouterProcess(default_model_dir, redis.url, tmp, "--disagg-threshold", "100000"),
    }
    with serving(redis, nodes.values(), routers.values(), start_timeout_s=120):
        yield routers, nodes
