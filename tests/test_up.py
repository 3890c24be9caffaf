"""`pdserve up` end to end: real launcher, router, nodes and Redis on a tiny model.

The slow tests share one 2-prefill + 2-decode cluster and run in file order: traffic, a node
joining, a node draining, a node killed, then the launcher's shutdown. The last two start
launches of their own.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import socket
import threading
import time

import psutil
import pytest

from pdserve.cli.main import build_parser
from pdserve.launcher.children import Child, stop_all
from pdserve.launcher.cluster import LocalCluster
from pdserve.launcher.plan import ClusterPlan, threads_per_node
from pdserve.node.options import options_from_args
from pdserve.protocol.registry import Role
from tests import web
from tests.cluster import NodeProcess
from tests.engine_helpers import hf_greedy
from tests.up_launcher import FILLER, NODE_ARGS, Launcher, tiny_model_with_tokenizer


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``text`` (zombies count as gone)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = web.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def complete_all(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, p, max_tokens), prompts))


def plan_of(tmp_path: pathlib.Path, **fields) -> ClusterPlan:
    """A ClusterPlan of one prefill and one decode node unless ``fields`` say otherwise."""
    defaults = dict(
        model="m",
        num_prefill=1,
        num_decode=1,
        host="127.0.0.1",
        port=8000,
        redis_url=None,
        use_redis=True,
        threads_per_node=1,
        log_dir=tmp_path,
    )
    return ClusterPlan(**{**defaults, **fields})


def test_threads_split_the_cores_evenly_with_at_least_one_per_node():
    assert [threads_per_node(16, n) for n in (1, 2, 3, 4, 16, 40)] == [16, 8, 5, 4, 1, 1]
    assert threads_per_node(2, 4) == 1


@pytest.mark.parametrize(("num_prefill", "num_decode"), [(0, 1), (1, 0)])
def test_plan_refuses_a_cluster_without_both_roles(tmp_path, num_prefill, num_decode):
    with pytest.raises(ValueError, match="at least one prefill and one decode node .* or a colocated one"):
        plan_of(tmp_path, num_prefill=num_prefill, num_decode=num_decode)


def test_plan_of_colocated_nodes_alone_is_complete(tmp_path):
    plan = plan_of(tmp_path, num_prefill=0, num_decode=0, num_colocated=2)
    assert plan.num_nodes == 2 and plan.describe() == "2 colocated"


@pytest.mark.parametrize(
    ("flags", "shape"),
    [
        ((), (1, 1, 0)),
        (("--colocated", "3"), (0, 0, 3)),
        (("--autoscale",), (0, 0, 2)),  # before a load is measured: nodes that serve any mix
        (("--autoscale", "--max-nodes", "4"), (0, 0, 2)),
        (("--autoscale", "--max-nodes", "1"), (0, 0, 1)),
        (("--autoscale", "--prefill", "1", "--decode", "1"), (1, 1, 0)),  # the user's shape wins
        (("--autoscale", "--decode", "2"), (1, 2, 0)),
        (("--autoscale", "--colocated", "1"), (0, 0, 1)),
    ],
)
def test_the_shape_it_starts_in(flags, shape):
    from pdserve.cli.up_slo import start_shape

    assert start_shape(build_parser().parse_args(["up", *flags])) == shape


@pytest.mark.parametrize(
    ("flags", "cores", "on_cpu", "shape"),
    [
        ((), 2, True, (0, 0, 1)),  # each phase would compute on one core: one colocated node
        ((), 3, True, (0, 0, 1)),
        ((), 4, True, (1, 1, 0)),
        ((), 2, False, (1, 1, 0)),  # on GPUs the split is the default at any core count
        (("--prefill", "1", "--decode", "1"), 2, True, (1, 1, 0)),  # asked for: kept
        (("--decode", "2"), 2, True, (1, 2, 0)),
        (("--colocated", "2"), 2, True, (0, 0, 2)),
        (("--prefill-tp", "2"), 2, True, (1, 1, 0)),  # a tensor-parallel prefill node asks for one
        (("--autoscale",), 2, True, (0, 0, 2)),
    ],
)
def test_a_small_cpu_machine_starts_one_colocated_node_unless_a_shape_is_asked_for(
    flags, cores, on_cpu, shape
):
    from pdserve.cli.up_slo import small_cpu_machine, start_shape

    args = build_parser().parse_args(["up", *flags])
    assert start_shape(args, small_cpu_machine(args, cores, on_cpu)) == shape


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--prefill", "2", "--decode", "1"), "--autoscale with 3 nodes to start at 1 thread"),
        (("--max-nodes", "3"), "--max-nodes 3 at 1 thread"),
        (("--colocated", "2", "--threads", "2"), "--autoscale with 2 nodes to start at 2 thread"),
    ],
)
def test_an_autoscale_budget_beyond_the_cores_is_refused_naming_what_asked_for_it(flags, message):
    from pdserve.cli.up_slo import node_budget, start_shape

    args = build_parser().parse_args(["up", "--autoscale", *flags])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}.*2 are usable here: start fewer nodes"):
        node_budget(args, num_started=sum(start_shape(args)), cores=2)


@pytest.mark.parametrize(
    ("flags", "nodes"),
    [
        ((), (2, 2)),  # (min, max): a node stopped would leave its core idle
        (("--max-nodes", "4"), (2, 4)),  # it may grow, and shrink back to where it started
        (("--min-nodes", "1"), (1, 2)),  # stopping nodes in a lull is asked for
    ],
)
def test_autoscale_keeps_the_nodes_it_starts_with_unless_told(tmp_path, flags, nodes):
    from pdserve.cli.up_slo import autoscale_options

    argv = ["up", "--autoscale", "--ttft-slo-s", "4", "--tpot-slo-s", "0.25", *flags]
    args = build_parser().parse_args(argv)
    plan = plan_of(tmp_path, num_prefill=0, num_decode=0, num_colocated=2, max_nodes=args.max_nodes or 2)
    options = autoscale_options(args, plan)
    assert (options.min_nodes, options.max_nodes) == nodes
    with pytest.raises(ValueError, match="need 1 <= --min-nodes"):
        autoscale_options(
            build_parser().parse_args([*argv, "--min-nodes", "3"]), plan_of(tmp_path, max_nodes=2)
        )


@pytest.mark.parametrize(("fixed", "flag"), [(False, "--max-threads"), (True, "--threads")])
def test_a_nodes_share_of_the_cores_is_its_ceiling_unless_threads_were_set(model, tmp_path, fixed, flag):
    """Without --threads a node's share is a ceiling it gives way under (engine.cpu_share)."""
    plan = plan_of(
        tmp_path,
        model=str(model),
        num_prefill=0,
        num_decode=0,
        num_colocated=1,
        use_redis=False,
        threads_per_node=2,
        fixed_threads=fixed,
    )
    argv = LocalCluster(plan).node_argv("colocated", 0)
    assert argv[argv.index(flag) + 1] == "2"
    assert ("--threads" in argv) is fixed and ("--max-threads" in argv) is not fixed
    args = build_parser().parse_args(argv[argv.index("decode") :])
    _, engine = options_from_args(Role.COLOCATED, args)
    assert (engine.num_threads, engine.max_threads) == ((2, None) if fixed else (None, 2))


@pytest.mark.parametrize(
    ("node_args", "share"),
    [
        (("--device", "cuda"), "0.3"),  # three nodes on one GPU: 90% of it between them
        (("--device=cuda:1", "--dtype", "bfloat16"), "0.3"),
        (("--device", "cuda", "--gpu-memory-utilization", "0.5"), None),  # the user's share wins
        (("--device", "cpu"), None),
        ((), None),
    ],
)
def test_nodes_on_one_gpu_split_its_memory(model, tmp_path, node_args, share):
    plan = plan_of(tmp_path, model=str(model), num_prefill=1, num_decode=2, node_args=node_args)
    argv = LocalCluster(plan).node_argv("decode", 0)
    flag = "--gpu-memory-utilization"
    assert (argv[argv.index(flag) + 1] if flag in argv and share is not None else None) == share
    args = build_parser().parse_args(argv[argv.index("decode") :])
    _, engine = options_from_args(Role.DECODE, args)
    assert engine.gpu_memory_utilization == (float(share) if share else 0.5 if flag in node_args else 0.9)


def test_plan_url_reaches_a_wildcard_bind_over_loopback(tmp_path):
    plan = plan_of(tmp_path, host="0.0.0.0", port=8123)
    assert plan.url == "http://127.0.0.1:8123"


@pytest.mark.usefixtures("processes")
def test_stop_all_kills_a_child_that_ignores_sigterm_and_everything_it_started(tmp_path):
    argv = ["bash", "-c", "trap '' TERM; sleep 60 & sleep 60; wait"]  # the sleeps ignore TERM too
    child = Child("stubborn", argv, tmp_path / "stubborn.log", dict(os.environ))
    wait_for(lambda: len(psutil.Process(child.pid).children()) == 2, 10, "both sleeps")
    grandchildren = psutil.Process(child.pid).children()
    started = time.monotonic()
    stop_all([child], timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert child.proc.returncode == -signal.SIGKILL
    assert not psutil.wait_procs(grandchildren, timeout=5)[1]


@pytest.mark.usefixtures("processes")
def test_a_reaped_childs_log_tail_is_still_read(tmp_path):
    """A child that failed is stopped, then its log quoted: a calibration that failed was
    reported as "flush of closed file", its own error lost."""
    child = Child("failing", ["bash", "-c", "echo the cause; exit 3"], tmp_path / "f.log", dict(os.environ))
    wait_for(lambda: child.exit_code() is not None, 10, "the child's exit")
    stop_all([child], timeout_s=1)
    assert child.log_tail() == "the cause"


@pytest.fixture(scope="module")
def model(default_model_dir, tmp_path_factory) -> pathlib.Path:
    return tiny_model_with_tokenizer(default_model_dir, tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def up(model, tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("up"), model, "--prefill", "2", "--decode", "2")
    try:
        launcher.wait_up()
        yield launcher
    finally:
        launcher.close()


@pytest.mark.usefixtures("processes")
def test_forty_concurrent_requests_match_hf_and_use_both_nodes_of_each_role(up, model):
    from pdserve.router.tokenizer import Tokenizer

    tokenizer = Tokenizer(model)
    prompts = [f"Request {i}: {FILLER}" for i in range(40)]
    results = complete_all(up.url, prompts, max_tokens=6)
    for prompt, result in zip(prompts, results, strict=True):
        ids = tokenizer.encode(prompt)
        assert len(ids) >= 64  # above the router's disaggregation threshold: prefill node, then decode
        assert result["usage"] == {**result["usage"], "prompt_tokens": len(ids), "completion_tokens": 6}
        assert result["choices"][0]["text"] == tokenizer.decode(hf_greedy(str(model), ids, 6))
    for child in ("prefill-0", "prefill-1"):
        assert up.events(child, "request_added"), f"{child} got no request"
    for child in ("decode-0", "decode-1"):
        assert up.events(child, "request_finished"), f"{child} got no request"


@pytest.mark.usefixtures("processes")
def test_decode_node_started_later_takes_requests_within_two_seconds(up, model, tmp_path_factory):
    key = ["--cluster-key-file", str(up.log_dir / "cluster.key")]  # the banner says where it is
    node = NodeProcess(
        "decode", str(model), tmp_path_factory.mktemp("joined"), up.redis_url(), [*NODE_ARGS.split(), *key]
    )
    up.joined = node  # the drain test stops it
    node.wait_ready()
    joined_at = node.ready_file.stat().st_mtime  # it registered in Redis just before writing this
    stop = threading.Event()

    def keep_sending(k: int) -> None:  # short prompts: decode-only, logged as request_added on arrival
        while not stop.is_set():
            complete(up.url, f"Join {k} {time.monotonic_ns()}", 2)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        senders = [pool.submit(keep_sending, k) for k in range(4)]
        try:
            wait_for(lambda: node.events("request_added"), 10, "a request on the joined node")
        finally:
            stop.set()
        for sender in senders:
            sender.result()
    assert min(e["ts"] for e in node.events("request_added")) - joined_at < 2.0


@pytest.mark.usefixtures("processes")
def test_sigterm_drains_a_decode_node_without_failing_a_request(up):
    node = up.joined
    prompts = [f"Drain {k}: {FILLER}" for k in range(9)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, up.url, p, 48) for p in prompts]
        wait_for(lambda: node.events("kv_adopted"), 20, "a request on the joined node")
        node.proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in futures]  # complete() asserts every status is 200
    assert all(r["usage"]["completion_tokens"] == 48 for r in results)
    assert node.proc.wait(30) == 0
    assert node.events("request_finished")  # it finished what it had before leaving
    # The router forgets a withdrawn node node_expiry_s (3 s) after its last poll that saw it.
    wait_for(lambda: web.get(up.url + "/health").json()["num_decode"] == 2, 4.5, "the router to drop it")
    node.close()


@pytest.mark.usefixtures("processes")
def test_killed_decode_node_leaves_the_pool_within_two_heartbeat_ttls_and_traffic_goes_on(up):
    pid = json.loads((up.log_dir / "decode-1.ready.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: web.get(up.url + "/health").json()["num_decode"] == 1, 10, "the registry to drop it")
    # The Redis key expires 3 s (the heartbeat ttl) after the last beat; the router then keeps the
    # node for its own node_expiry_s (3 s) after the last poll that saw it: about 6 s in all.
    assert time.monotonic() - killed_at < 2 * 3.0 + 1.0
    results = complete_all(up.url, [f"After kill {k}: {FILLER}" for k in range(8)], max_tokens=4)
    assert [r["usage"]["completion_tokens"] for r in results] == [4] * 8
    wait_for(lambda: "decode-1 exited with code -9" in up.output(), 5, "the launcher to report it")
    assert up.proc.poll() is None  # the launcher keeps serving with what is left


@pytest.mark.usefixtures("processes")
def test_sigterm_to_the_launcher_stops_every_child_and_frees_every_port(up, model):
    ready = [json.loads(p.read_text()) for p in up.log_dir.glob("*.ready.json")]
    ports = [up.port, int(up.redis_url().rsplit(":", 1)[1].split("/")[0])]
    ports += [
        int(addr.rsplit(":", 1)[1]) for r in ready for addr in (r["control_addr"], r["kv_addr"]) if addr
    ]
    launcher = psutil.Process(up.proc.pid)
    assert len(launcher.children()) == 6  # redis, 4 nodes, router
    children = launcher.children(recursive=True)  # with theirs (e.g. multiprocessing's resource tracker)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(30) == 0
    assert "stopped" in up.output()
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not processes_mentioning(str(model))  # nodes and router name the model folder
    for port in ports:
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass


@pytest.mark.usefixtures("processes")
def test_colocated_nodes_serve_concurrent_requests_equal_to_hf_on_both_nodes_without_kv(
    model, tmp_path, capsys
):
    from pdserve.cli.main import main
    from pdserve.router.tokenizer import Tokenizer

    launcher = Launcher(tmp_path, model, "--colocated", "2")
    try:
        launcher.wait_up()
        assert "pdserve is up: 2 colocated node(s)" in launcher.output()
        health = web.get(launcher.url + "/health")
        assert health.status_code == 200
        assert health.json() == {
            "status": "ok",
            "num_prefill": 0,
            "num_decode": 0,
            "num_colocated": 2,
            "num_pairs": 0,
        }
        tokenizer = Tokenizer(model)
        prompts = [
            f"Colocated {i}: {FILLER}" for i in range(16)
        ]  # >= 64 tokens: a P/D cluster would transfer
        results = complete_all(launcher.url, prompts, max_tokens=6)
        for prompt, result in zip(prompts, results, strict=True):
            ids = tokenizer.encode(prompt)
            assert len(ids) >= 64
            assert result["choices"][0]["text"] == tokenizer.decode(hf_greedy(str(model), ids, 6))
        for child in ("colocated-0", "colocated-1"):
            finished = launcher.events(child, "request_finished")
            assert finished, f"{child} got no request"
            assert all(e["local_prefill"] for e in finished)
            assert not launcher.events(child, "kv_adopted")
        assert sum(len(launcher.events(c, "request_finished")) for c in ("colocated-0", "colocated-1")) == 16
        assert 'role="colocated"' in web.get(launcher.url + "/metrics").text
        assert main(["status", "--redis", launcher.redis_url()]) == 0
        assert "colocated: 2 node(s), 2 serving" in capsys.readouterr().out
    finally:
        launcher.close()


@pytest.mark.usefixtures("processes")
def test_node_failing_at_start_fails_the_launch_with_its_log_and_leaves_nothing(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    launcher = Launcher(tmp_path, broken, "--prefill", "1", "--decode", "1", "--no-redis")
    try:
        assert launcher.proc.wait(60) == 1
        out = launcher.output()
        failed = re.search(r"(prefill|decode)-0 exited with code 1 during start-up", out).group(0).split()[0]
        assert (launcher.log_dir / f"{failed}.log").read_text().splitlines()[-1] in out  # its log tail
        assert not processes_mentioning(str(launcher.log_dir))
    finally:
        launcher.close()


@pytest.mark.usefixtures("processes")
def test_children_die_with_a_launcher_killed_by_sigkill(model, tmp_path):
    launcher = Launcher(tmp_path, model, "--prefill", "1", "--decode", "1", "--no-redis")
    try:
        launcher.wait_up()
        assert "registry: none: static node addresses" in launcher.output()
        assert complete(launcher.url, "Hello", 2)["usage"]["completion_tokens"] == 2
        children = psutil.Process(launcher.proc.pid).children(recursive=True)
        launcher.proc.kill()
        launcher.proc.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive
        assert not processes_mentioning(str(model))
    finally:
        launcher.close()


def test_up_lora_flags_reach_every_node_and_the_router():
    from pdserve.cli.up import lora_args

    args = build_parser().parse_args(
        ["up", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2"]
    )
    nodes, router = lora_args(args)
    assert nodes == ("--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2")
    assert router == ("--lora-modules", "sql=/a/sql", "chat=/a/chat")
    assert lora_args(build_parser().parse_args(["up"])) == ((), ())
    assert lora_args(build_parser().parse_args(["up", "--enable-lora"])) == (("--enable-lora",), ())
    with pytest.raises(ValueError, match="NAME=PEFT_FOLDER"):
        lora_args(build_parser().parse_args(["up", "--lora-modules", "sql"]))


@pytest.mark.parametrize(
    ("checkpoint", "node_args", "expected"),
    [
        ("float32", "", "float32 on every node (auto: the checkpoint is float32)"),
        ("float32", "--dtype bfloat16", "bfloat16 on every node (--dtype)"),
        ("bfloat16", "--device cuda:1", "bfloat16 on every node (auto on CUDA)"),
        ("bfloat16", "", None),  # as this CPU allows
    ],
)
def test_up_says_which_dtype_its_nodes_compute_in_and_why(tmp_path, checkpoint, node_args, expected):
    from pdserve.cli.up import _node_dtype
    from pdserve.engine.machine.device import cpu_computes_bf16, explain_dtype

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": checkpoint}))
    line = _node_dtype(str(tmp_path), tuple(node_args.split()))
    if expected is None:
        dtype, why = explain_dtype("auto", "cpu", "bfloat16")
        assert dtype == ("bfloat16" if cpu_computes_bf16() else "float32")
        expected = f"{dtype} on every node ({why})"
    assert line == expected


@pytest.mark.parametrize(
    ("flags", "router", "nodes"),
    [
        ((), (), ("--max-decode-step-seconds", "0.2")),  # no targets: steps with decodes kept short
        (
            ("--tpot-slo-s", "0.5", "--ttft-slo-s", "6"),
            ("--ttft-slo-s", "6", "--tpot-slo-s", "0.5"),
            ("--max-decode-step-seconds", "0.4"),
        ),
        (
            ("--autoscale",),
            ("--ttft-slo-s", "4", "--tpot-slo-s", "0.25"),
            ("--max-decode-step-seconds", "0.2"),
        ),
        (("--node-args", "--max-decode-step-seconds 0.1"), (), ()),  # the user's own
    ],
)
def test_up_gives_its_nodes_a_decode_step_target_and_the_router_its_targets(flags, router, nodes):
    """Without a TPOT target the router lets no busy decode node prefill (router/policy.py) and the
    nodes keep steps that carry decodes to 0.2 s (bench/notes/serving.md, "PD past capacity")."""
    from pdserve.cli.up_slo import apply_slo_defaults, slo_node_args, slo_router_args

    args = build_parser().parse_args(["up", *flags])
    apply_slo_defaults(args)
    assert slo_router_args(args) == router
    assert slo_node_args(args) == nodes
    with pytest.raises(ValueError, match="--tpot-slo-s must be > 0, got 0"):
        apply_slo_defaults(build_parser().parse_args(["up", *flags, "--tpot-slo-s", "0"]))


@pytest.mark.parametrize(
    ("flags", "router", "store"),
    [
        ((), (), (1024, 3600.0)),  # the router's own defaults
        (
            ("--responses-store-size", "64", "--responses-store-ttl-s", "90"),
            ("--responses-store-size", "64", "--responses-store-ttl-s", "90.0"),
            (64, 90.0),
        ),
        (("--responses-store-size", "0"), ("--responses-store-size", "0"), (0, 3600.0)),  # store none
        (("--responses-store-size", "64", "--router-args=--responses-store-size=8"), (), (8, 3600.0)),
    ],
)
def test_up_passes_the_response_stores_flags_to_its_router(tmp_path, flags, router, store):
    """--responses-store-size and --responses-store-ttl-s reach the router as it parses them,
    unless --router-args sets them itself."""
    from pdserve.cli.up import _plan, store_router_args

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    args = build_parser().parse_args(["up", "--model", str(tmp_path), "--log-dir", str(tmp_path), *flags])
    assert store_router_args(args) == router
    router_cmd = ["router", "--model", "m", "--decode", "tcp://127.0.0.1:1", *_plan(args).router_args]
    parsed = build_parser().parse_args(router_cmd)
    assert (parsed.responses_store_size, parsed.responses_store_ttl_s) == store


def test_up_passes_the_traces_endpoint_to_its_router_and_every_node(tmp_path):
    """--otlp-traces-endpoint, vLLM's flag, reaches the router and the nodes as they parse it."""
    from pdserve.cli.up import _plan

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    url = "http://collector:4317"
    args = build_parser().parse_args(
        ["up", "--model", str(tmp_path), "--log-dir", str(tmp_path), "--otlp-traces-endpoint", url]
    )
    plan = _plan(args)
    router = build_parser().parse_args(["router", "--model", "m", "--decode", "tcp://x:1", *plan.router_args])
    node = build_parser().parse_args(["decode", "--model", "m", *plan.node_args])
    assert router.otlp_traces_endpoint == url == node.otlp_traces_endpoint
    plain = _plan(build_parser().parse_args(["up", "--model", str(tmp_path), "--log-dir", str(tmp_path)]))
    assert "--otlp-traces-endpoint" not in (*plain.router_args, *plain.node_args)
