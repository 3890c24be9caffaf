"""`pdserve up`: a whole cluster on this machine (registry, N prefill + M decode nodes or C colocated ones, router).

The launcher logic lives in the torch-free `launcher` package; this module maps flags onto a
ClusterPlan, prints what it does, and turns Ctrl-C / SIGTERM / SIGHUP into one orderly stop.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import signal
import sys
import tempfile

from pdserve.cli.up_slo import (
    SPLIT_MIN_CORES,
    add_slo_flags,
    apply_slo_defaults,
    autoscale_options,
    node_budget,
    slo_node_args,
    slo_router_args,
    small_cpu_machine,
    start_shape,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start a local cluster: router + prefill and decode nodes",
        description="Start a router and N prefill + M decode node processes on this machine, with a "
        "private redis-server as their registry when one is installed (else static addresses). "
        "Ctrl-C stops everything.",
    )
    parser.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: fetch the default model)"
    )
    parser.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="N",
        help="prefill node processes (default: 1, or 0 with --colocated, with --autoscale alone, or on a "
        "CPU machine of fewer than 4 cores, which starts one colocated node)",
    )
    parser.add_argument(
        "--decode",
        type=int,
        default=None,
        metavar="M",
        help="decode node processes (default: 1, or 0 with --colocated, with --autoscale alone, or on a "
        "CPU machine of fewer than 4 cores, which starts one colocated node)",
    )
    parser.add_argument(
        "--colocated",
        type=int,
        default=0,
        metavar="C",
        help="node processes that prefill and decode themselves, no KV transfer (default: 0; 1 on a CPU "
        "machine of fewer than 4 cores and no other shape flag; 2 with --autoscale and no --prefill or "
        "--decode: the controller splits them when the load says so)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="router's HTTP bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=8000, help="router's HTTP port (default: 8000)")
    registry = parser.add_mutually_exclusive_group()
    registry.add_argument(
        "--redis",
        default=os.environ.get("PDSERVE_REDIS"),
        metavar="URL",
        help="use this Redis as the registry instead of a private redis-server",
    )
    registry.add_argument("--no-redis", action="store_true", help="static node addresses, no registry")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per node (default: this machine's cores / number of nodes)",
    )
    parser.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks of each prefill node (default: 1); a node of N ranks is N "
        "processes, one or more threads each",
    )
    parser.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        metavar="M",
        help="tensor-parallel ranks of each decode or colocated node (default: 1)",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="start a node with more tensor-parallel ranks than this machine has cores (its "
        "collectives then wait for ranks the OS has descheduled: slow, for trying layouts)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="LoRA adapters (PEFT folders) clients may name in 'model': the router lists them and "
        "every node reads one when a request first brings it (implies --enable-lora)",
    )
    parser.add_argument("--enable-lora", action="store_true", help="nodes serve LoRA adapters")
    parser.add_argument("--max-loras", type=int, default=None, help="adapter slots per node (default: 1)")
    parser.add_argument(
        "--max-lora-rank", type=int, default=None, help="largest adapter rank the nodes hold (default: 16)"
    )
    parser.add_argument(
        "--kv-offload-dir",
        default=None,
        metavar="DIR",
        help="keep full KV blocks on disk beyond each node's pool, in DIR/<node name> (prefill-0, "
        "decode-0...: a restarted cluster finds its blocks again); evicted, preempted and "
        "pre-restart prefixes are loaded rather than recomputed",
    )
    parser.add_argument(
        "--kv-offload-disk-mb",
        type=int,
        default=None,
        metavar="MB",
        help="with --kv-offload-dir: each node's folder budget in MiB (default: the nodes' 8192)",
    )
    parser.add_argument(
        "--quantization",
        choices=("int8",),
        default=None,
        help="int8: every node runs W8A8 linear layers, its weights quantized as they load, no "
        "calibration (CPU only; accuracy and speed in bench/README.md); nodes of another "
        "quantization never pair with these",
    )
    parser.add_argument(
        "--node-args",
        default="",
        metavar="FLAGS",
        help='extra flags for every node, e.g. "--dtype bfloat16 --kv-cache-memory-mb 2048"',
    )
    parser.add_argument(
        "--router-args",
        default="",
        metavar="FLAGS",
        help='extra flags for the router, e.g. "--disagg-threshold 128 --no-prefix-routing"',
    )
    parser.add_argument(
        "--responses-store-size",
        type=int,
        default=None,
        metavar="N",
        help="the router's Responses API store: responses kept for GET /v1/responses/{id} and "
        "previous_response_id; 0: none (default: the router's, 1024)",
    )
    parser.add_argument(
        "--responses-store-ttl-s",
        type=float,
        default=None,
        metavar="S",
        help="seconds a stored response is kept after it was last stored or used (default: the router's, 3600)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="the router and every node export OpenTelemetry traces there, as vLLM's flag (OTEL_* "
        "variables are passed on to them too: docs/operations.md, Traces)",
    )
    parser.add_argument(
        "--log-dir", default=None, help="children's logs and ready files (default: a temp dir)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=120.0, help="seconds each start-up stage may take"
    )
    parser.add_argument("--stop-timeout", type=float, default=20.0, help="seconds to drain before SIGKILL")
    add_slo_flags(parser)
    parser.set_defaults(run=run_up)


class _Stop(Exception):
    """A stop signal arrived."""


def _raise_stop(signum: int, _frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def run_up(args: argparse.Namespace) -> int:
    from pdserve.launcher.cluster import LaunchError, LocalCluster

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    cluster = None
    try:
        plan = _plan(args)
        options = autoscale_options(args, plan)
        profile = None
        if options is not None:
            from pdserve.launcher.autoscale import calibrate

            profile = options.profile or calibrate(plan, plan.log_dir / "profile.json", _say)
        cluster = LocalCluster(plan, say=_say)
        cluster.start()
        _banner(cluster)
        if options is None:
            return cluster.watch()
        from pdserve.launcher.autoscale import make_autoscaler

        autoscaler = make_autoscaler(cluster, options, profile, _say)
        _say(f"autoscale: on, every {options.interval_s:g} s; decisions in {autoscaler.log_path}")
        return cluster.watch(tick=autoscaler.tick)
    except (ValueError, LaunchError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, _Stop):
        _say("stopping the cluster ...")
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the stop below has its own deadlines
        if cluster is not None:
            cluster.stop()
            _say("stopped")


def _say(text: str) -> None:
    print(text, flush=True)


def _plan(args: argparse.Namespace):
    from pdserve.launcher.plan import (
        LOCAL_KV_SHARE,
        ClusterPlan,
        gpu_share_per_node,
        kv_fraction_per_node,
        node_device,
        threads_per_node,
        usable_cores,
    )

    apply_slo_defaults(args)
    cores = usable_cores()
    small_cpu = small_cpu_machine(args, cores, _nodes_on_cpu(args))
    num_prefill, num_decode, num_colocated = start_shape(args, small_cpu)
    if small_cpu:
        _say(
            f"shape: 1 colocated node, the default on a CPU machine of fewer than {SPLIT_MIN_CORES} cores "
            f"({cores} here): split, each phase would compute on one core; --prefill 1 --decode 1 splits anyway"
        )
    num_nodes = node_budget(args, num_prefill + num_decode + num_colocated, cores)
    model = args.model or _fetch_default_model()
    if not (pathlib.Path(model) / "config.json").is_file():
        raise ValueError(f"--model {model}: not a Hugging Face model folder (no config.json)")
    ranks = _check_layout(args, cores, num_prefill, num_decode + num_colocated)
    _check_model_splits(model, args.prefill_tp, args.decode_tp)
    threads = args.threads or threads_per_node(cores, max(num_nodes, ranks))
    how = (
        "set by --threads"
        if args.threads
        else f"{cores} cores / {num_nodes} nodes; fewer while other processes load a node's CPUs"
        if threads > 1
        else f"{cores} cores / {num_nodes} nodes"
    )
    if ranks > num_nodes:
        how = "set by --threads" if args.threads else f"{cores} cores / {ranks} ranks"
        _say(
            f"layout: {args.prefill_tp} rank(s) per prefill node, {args.decode_tp} per decode or "
            f"colocated node: {ranks} ranks in all, each a process of {threads} torch thread(s) ({how})"
        )
    else:
        _say(f"threads: {threads} torch thread(s) per node ({how})")
    share = kv_fraction_per_node(num_nodes)
    if share is not None:
        _say(
            f"KV pools: {share:.1%} of available memory per node ({num_nodes} nodes share {LOCAL_KV_SHARE:.0%})"
        )
    node_lora, router_lora = lora_args(args)
    traces = tracing_args(args)
    quantization = ("--quantization", args.quantization) if args.quantization else ()
    node_args = (*node_lora, *quantization, *shlex.split(args.node_args), *slo_node_args(args), *traces)
    _say(f"dtype: {_node_dtype(model, node_args)}")
    if args.quantization:
        _say(
            f"quantization: {args.quantization} linear layers (W8A8) on every node; LM head and attention in the dtype"
        )
    layout = _gpu_layout(args, node_args, num_prefill, num_decode + num_colocated, num_nodes)
    if layout is not None:
        _say(layout.describe())
        gpu_share = gpu_share_per_node(node_args, layout.nodes_per_gpu)
        if gpu_share is not None:
            _say(
                f"GPU memory: {gpu_share:.1%} of a GPU per node (up to {layout.nodes_per_gpu} nodes share one)"
            )
    if node_device(node_args).startswith("cuda"):
        _say(
            "note: the CUDA path is built and tested on the CPU but has not yet run on a GPU "
            "(bench/gpu_oneshot.sh checks it; bench/README.md, GPU)"
        )
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return ClusterPlan(
        model=str(model),
        num_prefill=num_prefill,
        num_decode=num_decode,
        host=args.host,
        port=args.port,
        redis_url=args.redis,
        use_redis=not args.no_redis,
        threads_per_node=threads,
        fixed_threads=bool(args.threads),
        log_dir=log_dir,
        node_args=node_args,
        start_timeout_s=args.start_timeout,
        stop_timeout_s=args.stop_timeout,
        num_colocated=num_colocated,
        router_args=(
            *router_lora,
            *shlex.split(args.router_args),
            *slo_router_args(args),
            *store_router_args(args),
            *traces,
        ),
        max_nodes=num_nodes if args.autoscale else 0,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        kv_offload_dir=None if args.kv_offload_dir is None else pathlib.Path(args.kv_offload_dir).resolve(),
        kv_offload_disk_mb=args.kv_offload_disk_mb,
        gpu_layout=layout,
    )


def _nodes_on_cpu(args: argparse.Namespace) -> bool:
    """The nodes compute on the CPU: --device cpu in --node-args, or auto on a host whose CUDA
    sees no GPU (counted without torch: launcher/gpus.py)."""
    from pdserve.launcher.gpus import visible_gpu_count
    from pdserve.launcher.plan import node_device

    device = node_device(shlex.split(args.node_args))
    return device == "cpu" or (device == "auto" and visible_gpu_count() == 0)


def _gpu_layout(
    args: argparse.Namespace, node_args: tuple[str, ...], num_prefill: int, num_decoding: int, num_nodes: int
):
    """Each node's GPUs where the nodes compute on CUDA (launcher/gpus.py), from the GPUs this host
    has; None off CUDA. ValueError for a layout that needs more GPUs than it has."""
    from pdserve.launcher.gpus import plan_gpus, visible_gpu_count
    from pdserve.launcher.plan import node_device

    device = node_device(node_args)
    if not device.startswith("cuda"):
        return None
    first = int(device.split(":")[1]) if ":" in device else 0
    tps = [args.prefill_tp] * num_prefill + [args.decode_tp] * num_decoding
    tps += [1] * (num_nodes - len(tps))  # the autoscaler's room to grow (it runs at one rank)
    return plan_gpus(tps, first, visible_gpu_count())


def store_router_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The Responses API store's flags for the router (router/config.py), unless --router-args
    sets them itself; none given: the router's defaults."""
    given = shlex.split(args.router_args)
    out: list[str] = []
    for flag, value in (
        ("--responses-store-size", args.responses_store_size),
        ("--responses-store-ttl-s", args.responses_store_ttl_s),
    ):
        if value is not None and not any(a == flag or a.startswith(flag + "=") for a in given):
            out += [flag, str(value)]
    return tuple(out)


def tracing_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--otlp-traces-endpoint for the router and the nodes (protocol/tracing.py), when given."""
    endpoint = args.otlp_traces_endpoint
    return () if endpoint is None else ("--otlp-traces-endpoint", endpoint)


def lora_args(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The nodes' and the router's LoRA flags from ``pdserve up``'s (none when LoRA is off)."""
    modules = tuple(args.lora_modules)
    if not (args.enable_lora or modules or args.max_loras or args.max_lora_rank):
        return (), ()
    for module in modules:
        if "=" not in module:
            raise ValueError(f"--lora-modules takes NAME=PEFT_FOLDER, got {module!r}")
    nodes: tuple[str, ...] = ("--enable-lora",)
    if modules:
        nodes += ("--lora-modules", *modules)
    for flag, value in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank)):
        if value is not None:
            nodes += (flag, str(value))
    return nodes, (("--lora-modules", *modules) if modules else ())


def _check_model_splits(model: str, *sizes: int) -> None:
    """ValueError, before any node starts, where the model's heads do not split over a size
    (each rank holds whole query heads and whole KV heads, or a replica of one)."""
    from pdserve.protocol.kv_layout import query_heads_of

    config = json.loads((pathlib.Path(model) / "config.json").read_text())
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv_heads = config.get("num_key_value_heads") or heads
    for tp in sorted(set(sizes) - {1}):
        if heads is not None:
            query_heads_of(heads, kv_heads, tp, 0)  # every rank's, rank 0's checks


def _check_layout(args: argparse.Namespace, cores: int, num_prefill: int, num_decoding: int) -> int:
    """Every node's ranks together; ValueError for a layout this machine cannot run as asked."""
    for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if tp < 1:
            raise ValueError(f"{flag} must be >= 1, got {tp}")
        if tp > cores and not args.oversubscribe:
            raise ValueError(
                f"{flag} {tp}: a node of {tp} ranks on {cores} core(s) leaves ranks without a core, "
                f"and every collective waits for the slowest; --oversubscribe starts it anyway"
            )
    if args.autoscale and max(args.prefill_tp, args.decode_tp) > 1:
        raise ValueError(
            "--autoscale switches nodes between roles, which keep their layout: it runs with "
            "--prefill-tp 1 --decode-tp 1 only"
        )
    return num_prefill * args.prefill_tp + num_decoding * args.decode_tp


def _node_dtype(model: str, node_args: tuple[str, ...]) -> str:
    """The dtype the nodes will compute in and why (engine/machine/device.py explain_dtype), torch-free:
    --dtype from the node flags, the checkpoint's from its config.json."""
    from pdserve.engine.config import checkpoint_dtype_of
    from pdserve.engine.machine.device import explain_dtype
    from pdserve.launcher.plan import node_device, node_flag

    checkpoint = checkpoint_dtype_of(json.loads((pathlib.Path(model) / "config.json").read_text()))
    device = node_device(node_args)
    # auto: CUDA where an NVIDIA driver is loaded (the nodes ask torch; each node's log says)
    cuda = device.startswith("cuda") or (
        device == "auto" and pathlib.Path("/proc/driver/nvidia/version").exists()
    )
    dtype, why = explain_dtype(node_flag(node_args, "--dtype"), "cuda" if cuda else "cpu", checkpoint)
    return f"{dtype} on every node ({why})"


def _fetch_default_model() -> str:
    from pdserve.engine.model_fetch import fetch_default_model

    _say("model: the default model (SmolLM2-135M-Instruct), converted once into the cache")
    return str(fetch_default_model(progress=True))


def _banner(cluster) -> None:
    plan = cluster.plan
    status_key = f" --cluster-key-file {cluster.key_file}" if cluster.key_file else ""
    registry = (
        f"{cluster.redis_url}   (pdserve status --redis {cluster.redis_url}{status_key})"
        if cluster.redis_url
        else "none: static node addresses"
    )
    body = json.dumps(
        {
            "model": pathlib.Path(plan.model).name,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
    )
    _say(
        "\n".join(
            [
                f"pdserve is up: {plan.describe()} node(s), model {plan.model}",
                f"  router:   {plan.url}   (OpenAI API under {plan.url}/v1)",
                f"  registry: {registry}",
                *(
                    [f"  key:      {cluster.key_file}   (a node joins this cluster with --cluster-key-file)"]
                    if cluster.key_file
                    else []
                ),
                f"  logs:     {plan.log_dir}",
                "Try it:",
                f"  curl -s {plan.url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
                "Ctrl-C stops the cluster.",
            ]
        )
    )
