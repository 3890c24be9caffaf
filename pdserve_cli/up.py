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
        help="prefill node processes (default: 1, or 0 with --colocated or with --autoscale alone)",
    )
    parser.add_argument(
        "--decode",
        type=int,
        default=None,
        metavar="M",
        help="decode node processes (default: 1, or 0 with --colocated or with --autoscale alone)",
    )
    parser.add_argument(
        "--colocated",
        type=int,
        default=0,
        metavar="C",
        help="node processes that prefill and decode themselves, no KV transfer (default: 0; 2 with "
        "--autoscale and no --prefill or --decode: the controller splits them when the load says so)",
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
        "--log-dir", default=None, help="children's logs and ready files (default: a temp dir)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=120.0, help="seconds each start-up stage may take"
    )
    parser.add_argument("--stop-timeout", type=float, default=20.0, help="seconds to drain before SIGKILL")
    _add_slo_flags(parser)
    parser.set_defaults(run=run_up)


def _add_slo_flags(parser: argparse.ArgumentParser) -> None:
    slo = parser.add_argument_group(
        "targets and autoscaling",
        "The cluster's SLO targets: the router sheds by them and guards decode nodes' local "
        "prefills by them; with --autoscale a controller in this launcher resizes the pools for "
        "them (launcher/autoscale.py).",
    )
    slo.add_argument(
        "--ttft-slo-s",
        type=float,
        default=None,
        help="time-to-first-token target (default: none; 4 with --autoscale)",
    )
    slo.add_argument(
        "--tpot-slo-s",
        type=float,
        default=None,
        help="time-per-output-token target (default: none; 0.25 with --autoscale); the nodes keep "
        "the steps that carry decodes beside prompt chunks within it",
    )
    slo.add_argument(
        "--autoscale",
        action="store_true",
        help="switch node roles, and start and drain nodes, from the router's measured load "
        "(needs the Redis registry)",
    )
    slo.add_argument(
        "--autoscale-profile",
        type=pathlib.Path,
        default=None,
        metavar="FILE",
        help="the planner's engine profile (`pdserve plan calibrate`; default: calibrate at launch, about a minute)",
    )
    slo.add_argument(
        "--max-nodes",
        type=int,
        default=None,
        help="node budget (default: the nodes it starts with); threads and memory are split by it",
    )
    slo.add_argument(
        "--min-nodes",
        type=int,
        default=None,
        help="never fewer nodes (default: the nodes it starts with: the nodes' threads split this "
        "machine's cores at start, so a node stopped leaves its cores to other work, not to the "
        "nodes left); fewer lets the controller stop nodes in a lull",
    )
    slo.add_argument(
        "--autoscale-interval", type=float, default=None, help="seconds of metrics per decision (default: 5)"
    )
    slo.add_argument(
        "--autoscale-cooldown", type=float, default=None, help="seconds between two changes (default: 30)"
    )
    slo.add_argument(
        "--autoscale-trust-profile",
        action="store_true",
        default=None,  # None: not given (AUTOSCALE_ONLY)
        help="decide on the profile as calibrated; by default its prefill times are corrected, per "
        "shape family, by the TTFT the cluster measures (measured and reported either way)",
    )
    slo.add_argument(
        "--min-slo-fraction",
        type=float,
        default=None,
        help="a shape meets the targets when this share of requests does (default: 0.9)",
    )


AUTOSCALE_ONLY = (
    "autoscale_profile", "max_nodes", "min_nodes", "autoscale_interval", "autoscale_cooldown", "min_slo_fraction",
    "autoscale_trust_profile",
)  # fmt: skip


class _Stop(Exception):
    """A stop signal arrived."""


def _raise_stop(signum: int, _frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def run_up(args: argparse.Namespace) -> int:
    from launcher.cluster import LaunchError, LocalCluster

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    cluster = None
    try:
        plan = _plan(args)
        options = _autoscale_options(args, plan)
        profile = None
        if options is not None:
            from launcher.autoscale import calibrate

            profile = options.profile or calibrate(plan, plan.log_dir / "profile.json", _say)
        cluster = LocalCluster(plan, say=_say)
        cluster.start()
        _banner(cluster)
        if options is None:
            return cluster.watch()
        from launcher.autoscale import make_autoscaler

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
    from launcher.plan import (
        LOCAL_KV_SHARE,
        ClusterPlan,
        gpu_share_per_node,
        kv_fraction_per_node,
        node_device,
        threads_per_node,
        usable_cores,
    )

    if args.autoscale:  # the targets it sizes the pools for, and the router sheds by
        args.ttft_slo_s = 4.0 if args.ttft_slo_s is None else args.ttft_slo_s
        args.tpot_slo_s = 0.25 if args.tpot_slo_s is None else args.tpot_slo_s
    num_prefill, num_decode, num_colocated = start_shape(args)
    cores = usable_cores()
    num_nodes = _node_budget(args, num_prefill + num_decode + num_colocated, cores)
    model = args.model or _fetch_default_model()
    if not (pathlib.Path(model) / "config.json").is_file():
        raise ValueError(f"--model {model}: not a Hugging Face model folder (no config.json)")
    threads = args.threads or threads_per_node(cores, num_nodes)
    how = (
        "set by --threads"
        if args.threads
        else f"{cores} cores / {num_nodes} nodes; fewer while other processes load a node's CPUs"
        if threads > 1
        else f"{cores} cores / {num_nodes} nodes"
    )
    _say(f"threads: {threads} torch thread(s) per node ({how})")
    share = kv_fraction_per_node(num_nodes)
    if share is not None:
        _say(
            f"KV pools: {share:.1%} of available memory per node ({num_nodes} nodes share {LOCAL_KV_SHARE:.0%})"
        )
    node_args = (*shlex.split(args.node_args), *_slo_node_args(args))
    gpu_share = gpu_share_per_node(node_args, num_nodes)
    if gpu_share is not None:
        _say(f"GPU memory: {gpu_share:.1%} of {node_device(node_args)} per node ({num_nodes} nodes share it)")
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
        router_args=(*shlex.split(args.router_args), *_slo_router_args(args)),
        max_nodes=num_nodes if args.autoscale else 0,
    )


AUTOSCALE_START_NODES = 2  # colocated, without shape flags (or --max-nodes, if fewer)


def start_shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """The prefill, decode and colocated nodes it starts: as the shape flags say, else 1P+1D (0
    of each with --colocated); with --autoscale and no shape flag, colocated nodes. Before the
    controller has measured a load, a colocated node serves any mix of prompt and output lengths
    without a KV transfer or a second hop, and the controller disaggregates when the measured
    windows say a split pays (on this project's 2-core machines 2 colocated was at or above 1P+1D
    at most rates and phases, bench/notes/autoscaling.md)."""
    if args.autoscale and args.prefill is None and args.decode is None and not args.colocated:
        return 0, 0, min(AUTOSCALE_START_NODES, args.max_nodes or AUTOSCALE_START_NODES)
    default = 0 if args.colocated else 1
    num_prefill = default if args.prefill is None else args.prefill
    num_decode = default if args.decode is None else args.decode
    return num_prefill, num_decode, args.colocated


def _node_budget(args: argparse.Namespace, num_started: int, cores: int) -> int:
    """The nodes threads and memory are split by: those started, or --autoscale's budget."""
    given = [f"--{name.replace('_', '-')}" for name in AUTOSCALE_ONLY if getattr(args, name) is not None]
    if not args.autoscale:
        if given:
            raise ValueError(f"{', '.join(given)}: only with --autoscale")
        return num_started
    budget = args.max_nodes or num_started
    if budget < num_started:
        raise ValueError(f"--max-nodes {budget}: fewer than the {num_started} nodes it starts with")
    if budget * (args.threads or 1) > cores:
        raise ValueError(
            f"--max-nodes {budget} at {args.threads or 1} thread(s) each needs {budget * (args.threads or 1)} "
            f"cores; {cores} are usable here"
        )
    return budget


def _slo_router_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--ttft-slo-s / --tpot-slo-s for the router, unless --router-args sets them itself."""
    given = shlex.split(args.router_args)
    out: list[str] = []
    for flag, value in (("--ttft-slo-s", args.ttft_slo_s), ("--tpot-slo-s", args.tpot_slo_s)):
        if value is not None and not any(a == flag or a.startswith(flag + "=") for a in given):
            out += [flag, f"{value:g}"]
    return tuple(out)


def _slo_node_args(args: argparse.Namespace) -> tuple[str, ...]:
    """With a TPOT SLO, every node's steps that carry decodes beside prompt chunks keep within it
    (engine.step_budget), unless --node-args sets their target itself: any node may decode, after
    a role switch if not at start."""
    from engine.step_budget import TPOT_SLO_STEP_SHARE

    flag = "--max-decode-step-seconds"
    if args.tpot_slo_s is None or any(
        a == flag or a.startswith(flag + "=") for a in shlex.split(args.node_args)
    ):
        return ()
    return (flag, f"{TPOT_SLO_STEP_SHARE * args.tpot_slo_s:g}")


def _autoscale_options(args: argparse.Namespace, plan):
    """--autoscale's options, checked; None without --autoscale."""
    from bench_serve.metrics import Slo
    from launcher.autoscale import AutoscaleOptions

    if not args.autoscale:
        return None
    if not plan.use_redis:
        raise ValueError("--autoscale switches roles through the Redis registry: drop --no-redis")
    if args.autoscale_profile is not None and not args.autoscale_profile.is_file():
        raise ValueError(f"--autoscale-profile {args.autoscale_profile}: no such file")
    min_nodes = plan.num_nodes if args.min_nodes is None else args.min_nodes
    if not 1 <= min_nodes <= plan.node_budget:
        raise ValueError(f"need 1 <= --min-nodes ({min_nodes}) <= --max-nodes ({plan.node_budget})")
    interval = 5.0 if args.autoscale_interval is None else args.autoscale_interval
    cooldown = 30.0 if args.autoscale_cooldown is None else args.autoscale_cooldown
    fraction = 0.9 if args.min_slo_fraction is None else args.min_slo_fraction
    if min(interval, args.ttft_slo_s, args.tpot_slo_s) <= 0 or cooldown < 0 or not 0 < fraction <= 1:
        raise ValueError(
            "SLO targets and --autoscale-interval must be > 0, --autoscale-cooldown >= 0, "
            "--min-slo-fraction in (0, 1]"
        )
    return AutoscaleOptions(
        slo=Slo(args.ttft_slo_s, args.tpot_slo_s),
        profile=args.autoscale_profile,
        max_nodes=plan.node_budget,
        min_nodes=min_nodes,
        interval_s=interval,
        cooldown_s=cooldown,
        min_slo_fraction=fraction,
        correct_prefill=not args.autoscale_trust_profile,
    )


def _fetch_default_model() -> str:
    from engine.model_fetch import fetch_default_model

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
