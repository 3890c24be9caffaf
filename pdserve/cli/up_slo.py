"""`pdserve up`'s targets and --autoscale: their flags, the shape the cluster starts in, the node
budget threads and memory are split by, the targets each child is given, and the controller's
options (launcher/autoscale.py runs it)."""

from __future__ import annotations

import argparse
import pathlib
import shlex

# `pdserve up`'s decode-step target where no TPOT target is given: the nodes keep the steps that
# carry running decodes beside prompt chunks to about this long, so that a colocated node's
# decodes keep their pace while it prefills (a PD decode node with requests running prefills
# nothing without a TPOT target: router/policy.py). bench/notes/serving.md, "PD past capacity".
DEFAULT_DECODE_STEP_S = 0.2
AUTOSCALE_TTFT_SLO_S = 4.0  # --autoscale's targets when none is given
AUTOSCALE_TPOT_SLO_S = 0.25


def add_slo_flags(parser: argparse.ArgumentParser) -> None:
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
        help=f"time-to-first-token target (default: none; {AUTOSCALE_TTFT_SLO_S:g} with --autoscale)",
    )
    slo.add_argument(
        "--tpot-slo-s",
        type=float,
        default=None,
        help=f"time-per-output-token target (default: none; {AUTOSCALE_TPOT_SLO_S:g} with --autoscale): "
        "the nodes keep the steps that carry decodes beside prompt chunks within it (without one: "
        f"{DEFAULT_DECODE_STEP_S:g} s), and a decode node with requests running prefills a prompt "
        "itself only within it (without one: never)",
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


AUTOSCALE_START_NODES = 2  # colocated, without shape flags (or --max-nodes, if fewer)
# Below this many usable cores a CPU machine's default start is one colocated node: split 1P+1D,
# each phase computes on one core, and the prefill node alone caps the cluster near 1 req/s of
# 512-token prompts (bench/README.md, "The served gap": 0.31x vLLM's goodput at 2 req/s against
# colocated's 0.68-0.80x on 2 cores).
SPLIT_MIN_CORES = 4


def small_cpu_machine(args: argparse.Namespace, cores: int, on_cpu: bool) -> bool:
    """No shape flag, one rank a node, nodes on the CPU and fewer than SPLIT_MIN_CORES cores:
    `pdserve up` starts one colocated node rather than 1P+1D."""
    shape_given = args.prefill is not None or args.decode is not None or args.colocated or args.autoscale
    tp_given = args.prefill_tp > 1 or args.decode_tp > 1
    return on_cpu and cores < SPLIT_MIN_CORES and not shape_given and not tp_given


def start_shape(args: argparse.Namespace, small_cpu: bool = False) -> tuple[int, int, int]:
    """The prefill, decode and colocated nodes it starts: as the shape flags say, else 1P+1D (0
    of each with --colocated), or one colocated node on a small CPU machine (``small_cpu``: what
    small_cpu_machine says);
    with --autoscale and no shape flag, colocated nodes. Before the
    controller has measured a load, a colocated node serves any mix of prompt and output lengths
    without a KV transfer or a second hop, and the controller disaggregates when the measured
    windows say a split pays (on this project's 2-core machines 2 colocated was at or above 1P+1D
    at most rates and phases, bench/notes/autoscaling.md)."""
    if args.autoscale and args.prefill is None and args.decode is None and not args.colocated:
        return 0, 0, min(AUTOSCALE_START_NODES, args.max_nodes or AUTOSCALE_START_NODES)
    if small_cpu:
        return 0, 0, 1
    default = 0 if args.colocated else 1
    num_prefill = default if args.prefill is None else args.prefill
    num_decode = default if args.decode is None else args.decode
    return num_prefill, num_decode, args.colocated


def node_budget(args: argparse.Namespace, num_started: int, cores: int) -> int:
    """The nodes threads and memory are split by: those started, or --autoscale's budget."""
    given = [f"--{name.replace('_', '-')}" for name in AUTOSCALE_ONLY if getattr(args, name) is not None]
    if not args.autoscale:
        if given:
            raise ValueError(f"{', '.join(given)}: only with --autoscale")
        return num_started
    budget = args.max_nodes or num_started
    if budget < num_started:
        raise ValueError(f"--max-nodes {budget}: fewer than the {num_started} nodes it starts with")
    threads = args.threads or 1
    if budget * threads > cores:
        # each node of the budget has cores of its own, so that a node the controller starts
        # finds them free (without --autoscale, nodes may share cores)
        asked = (
            f"--max-nodes {budget}" if args.max_nodes else f"--autoscale with {num_started} nodes to start"
        )
        raise ValueError(
            f"{asked} at {threads} thread(s) each needs {budget * threads} cores; {cores} are usable "
            "here: start fewer nodes (an autoscaled node has cores of its own)"
        )
    return budget


def apply_slo_defaults(args: argparse.Namespace) -> None:
    """--autoscale's targets where none were given: it sizes the pools for them."""
    for flag, value in (("--ttft-slo-s", args.ttft_slo_s), ("--tpot-slo-s", args.tpot_slo_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value:g} (leave it out for none)")
    if args.autoscale:
        args.ttft_slo_s = AUTOSCALE_TTFT_SLO_S if args.ttft_slo_s is None else args.ttft_slo_s
        args.tpot_slo_s = AUTOSCALE_TPOT_SLO_S if args.tpot_slo_s is None else args.tpot_slo_s


def slo_router_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--ttft-slo-s / --tpot-slo-s for the router, unless --router-args sets them itself."""
    given = shlex.split(args.router_args)
    out: list[str] = []
    for flag, value in (("--ttft-slo-s", args.ttft_slo_s), ("--tpot-slo-s", args.tpot_slo_s)):
        if value is not None and not any(a == flag or a.startswith(flag + "=") for a in given):
            out += [flag, f"{value:g}"]
    return tuple(out)


def slo_node_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Every node's target for the steps that carry decodes beside prompt chunks (engine.step_budget),
    unless --node-args sets it itself: within the TPOT target, or DEFAULT_DECODE_STEP_S without
    one (any node may decode, after a role switch if not at start)."""
    from pdserve.engine.core.step_budget import TPOT_SLO_STEP_SHARE

    flag = "--max-decode-step-seconds"
    if any(a == flag or a.startswith(flag + "=") for a in shlex.split(args.node_args)):
        return ()
    target = DEFAULT_DECODE_STEP_S if args.tpot_slo_s is None else TPOT_SLO_STEP_SHARE * args.tpot_slo_s
    return (flag, f"{target:g}")


def autoscale_options(args: argparse.Namespace, plan):
    """--autoscale's options, checked; None without --autoscale."""
    from pdserve.bench_serve.metrics import Slo
    from pdserve.launcher.autoscale import AutoscaleOptions

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
