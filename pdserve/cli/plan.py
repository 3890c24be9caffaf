"""`pdserve plan calibrate | simulate | recommend`: size a cluster from offline measurements (see planner/)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

from pdserve.cli.bench import add_workload_args, workload_spec
from pdserve.router.config import LOCAL_PREFILL_MARGIN_S  # a plain dataclass module: cheap to import


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="predict a cluster's latencies from a calibration profile",
        description="Measure the engine offline, then simulate clusters without running them.",
    )
    commands = parser.add_subparsers(title="steps", metavar="STEP", required=True)
    cal = commands.add_parser(
        "calibrate",
        help="measure prefill, decode steps and KV transfer into a profile",
        description="Time prefill by prompt length, decode steps by batch and context, "
        "and a same-host KV transfer, with the engine in this process (about a minute).",
    )
    cal.add_argument("--model", default=None, help="Hugging Face model folder (default: the default model)")
    cal.add_argument("--out", type=pathlib.Path, default=pathlib.Path("profile.json"))
    cal.add_argument(
        "--threads", type=int, default=1, help="torch threads: a node's share of the cores (default: 1)"
    )
    cal.add_argument("--prefill-lens", default="16,64,128,256,512", metavar="N,...")
    cal.add_argument("--decode-batches", default="1,4,16", metavar="B,...")
    cal.add_argument("--decode-contexts", default="64,512", metavar="C,...")
    cal.add_argument("--repeats", type=int, default=2, help="prefill timings per length, the best counts")
    cal.add_argument("--max-num-batched-tokens", type=int, default=2048, help="as the nodes' engine flag")
    cal.add_argument("--max-num-seqs", type=int, default=64, help="as the nodes' engine flag")
    cal.add_argument(
        "--no-transfer", action="store_true", help="skip the transfer probe (a zero-cost transfer)"
    )
    cal.add_argument(
        "--busy-neighbours",
        type=int,
        default=0,
        metavar="N",
        help="keep N other processes busy with matmuls meanwhile, as a cluster's other nodes on "
        "the same host would (default: 0, the engine alone)",
    )
    cal.set_defaults(run=run_calibrate)
    for name, help_text in (
        ("simulate", "predict TTFT, TPOT and goodput of one cluster shape"),
        ("recommend", "search node counts for the smallest cluster that meets the SLOs"),
    ):
        p = commands.add_parser(
            name,
            help=help_text,
            description=help_text + " (token-id completions workloads, "
            "the same flags and seeds as `pdserve bench serve`).",
        )
        p.add_argument("--profile", type=pathlib.Path, required=True)
        add_workload_args(p)
        p.add_argument(
            "--request-rate", default="1", metavar="R[,R...]", help="mean requests per second (Poisson)"
        )
        p.add_argument("--burstiness", type=float, default=1.0)
        p.add_argument("--ttft-slo-ms", type=float, default=3000.0)
        p.add_argument("--tpot-slo-ms", type=float, default=300.0)
        p.add_argument("--disagg-threshold", type=int, default=64, help="as the router's flag")
        p.add_argument(
            "--local-prefill-margin-s",
            type=float,
            default=LOCAL_PREFILL_MARGIN_S,
            help="as the router's flag",
        )
        p.add_argument(
            "--without-slo-flags",
            action="store_true",
            help="model a cluster started without --ttft-slo-s/--tpot-slo-s (default: with the SLO "
            "targets above as its flags: the router sheds by them and the nodes keep steps that "
            "carry decodes within the TPOT target)",
        )
        p.add_argument("--json", type=pathlib.Path, default=None, help="write the predictions here")
        if name == "simulate":
            p.add_argument("--prefill", type=int, default=1, metavar="N")
            p.add_argument("--decode", type=int, default=1, metavar="M")
            p.add_argument("--colocated", type=int, default=0, metavar="C")
            p.set_defaults(run=run_simulate)
        else:
            p.add_argument("--max-nodes", type=int, default=4)
            p.add_argument(
                "--min-slo-fraction",
                type=float,
                default=0.9,
                help="share of requests that must meet both targets (default: %(default)s)",
            )
            p.add_argument("--no-colocated", action="store_true", help="search P+D splits only")
            p.set_defaults(run=run_recommend)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def run_calibrate(args: argparse.Namespace) -> int:
    import time

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.planner.calibrate import Grid, measure_engine
    from pdserve.planner.contention import neighbours
    from pdserve.planner.profile import Profile, TransferModel

    started = time.monotonic()
    grid = Grid(
        _ints(args.prefill_lens), _ints(args.decode_batches), _ints(args.decode_contexts), args.repeats
    )
    if args.model is None:
        from pdserve.engine.model_fetch import fetch_default_model

        args.model = str(fetch_default_model())
    num_tokens = max(grid.decode_batches) * (max(grid.decode_contexts) + 64) + max(grid.prefill_lens)
    config = EngineConfig(
        model=args.model,
        num_kv_blocks=num_tokens // 16 + 64,
        enable_prefix_caching=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_threads=args.threads,
    )
    engine = LLMEngine(config)
    fitted = grid.within(engine.max_model_len)
    if fitted != grid:
        print(
            f"the model's context is {engine.max_model_len} tokens: prompts {list(fitted.prefill_lens)}, "
            f"decode contexts {list(fitted.decode_contexts)}"
        )
    grid = fitted
    with neighbours(args.busy_neighbours):
        timings = measure_engine(engine, grid)
    spec = engine.kv_spec
    kv_bytes_per_token = spec.bytes_per_block // spec.block_size
    transfer, transfer_samples = TransferModel(0.0, 0.0), []
    if not args.no_transfer:
        from pdserve.planner.transfer_probe import measure_transfer

        transfer_samples = measure_transfer(spec)
        transfer = TransferModel.through(transfer_samples[0], transfer_samples[-1])
        for num_bytes, seconds in transfer_samples:
            print(
                f"transfer {num_bytes / 1e6:7.1f} MB: {seconds * 1e3:8.2f} ms ({num_bytes / seconds / 1e9:.2f} GB/s)"
            )
    profile = Profile(
        model=pathlib.Path(args.model).name,
        threads=args.threads,
        kv_bytes_per_token=kv_bytes_per_token,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        prefill=timings.prefill,
        decode=timings.decode,
        transfer=transfer,
        measured={
            "busy_neighbours": args.busy_neighbours,
            "prefill": timings.prefill_samples,
            "decode": timings.decode_samples,
            "transfer": transfer_samples,
            "seconds": round(time.monotonic() - started, 1),
        },
    )
    profile.save(args.out)
    print(f"transfer model: {transfer.base_s * 1e3:.2f} ms + {transfer.per_byte_s * 1e12:.1f} ps/byte")
    print(f"profile: {args.out} ({profile.measured['seconds']} s)")
    return 0


def _inputs(args: argparse.Namespace):
    from pdserve.bench_serve.metrics import Slo
    from pdserve.bench_serve.spec import parse_rates
    from pdserve.bench_serve.workload import PromptStyle
    from pdserve.planner.profile import Profile

    profile = Profile.load(args.profile)
    workload = workload_spec(args, PromptStyle.TOKEN_IDS)
    return (
        profile,
        workload,
        parse_rates(args.request_rate),
        Slo(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3),
    )


def run_simulate(args: argparse.Namespace) -> int:
    from pdserve.planner.predict import predict, sim_requests, table
    from pdserve.planner.simulate import Cluster

    try:
        profile, workload, rates, slo = _inputs(args)
        cluster = Cluster(
            args.prefill,
            args.decode,
            args.colocated,
            args.disagg_threshold,
            local_prefill_margin_s=args.local_prefill_margin_s,
        )
        results = []
        for k, rate in enumerate(rates):  # run k: seed + k, as `pdserve bench serve` sweeps
            requests = sim_requests(workload.build(args.seed + k), rate, args.burstiness, args.seed + k)
            summary = predict(profile, cluster, requests, slo, not args.without_slo_flags)
            print(table(f"{cluster.label}, {rate:g} req/s (predicted)", summary))
            results.append(
                {
                    "cluster": cluster.label,
                    "request_rate": None if math.isinf(rate) else rate,
                    "summary": dataclasses.asdict(summary),
                }
            )
    except ValueError as exc:
        print(f"pdserve plan simulate: {exc}", file=sys.stderr)
        return 1
    _write(args.json, results)
    return 0


def run_recommend(args: argparse.Namespace) -> int:
    from pdserve.planner.predict import sim_requests
    from pdserve.planner.recommend import rank, shapes

    try:
        profile, workload, rates, slo = _inputs(args)
        if len(rates) != 1:
            raise ValueError("recommend takes one --request-rate")
        requests = sim_requests(workload.build(args.seed), rates[0], args.burstiness, args.seed)
        ranked = rank(
            profile,
            requests,
            slo,
            shapes(args.max_nodes, args.disagg_threshold, not args.no_colocated, args.local_prefill_margin_s),
            args.min_slo_fraction,
            not args.without_slo_flags,
        )
    except ValueError as exc:
        print(f"pdserve plan recommend: {exc}", file=sys.stderr)
        return 1
    print(
        f"{'cluster':14}{'nodes':>6}{'met SLO':>9}{'goodput':>9}{'tok/s':>8}{'TTFT p50':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
    )
    for c in ranked:
        s = c.summary
        ms = lambda stats, q: f"{getattr(stats, q) * 1e3:>8.0f}ms" if stats else f"{'-':>10}"  # noqa: E731
        print(
            f"{c.cluster.label:14}{c.cluster.num_nodes:>6}{100 * c.slo_fraction:>8.0f}%{s.goodput:>9.3f}"
            f"{s.output_throughput:>8.1f} {ms(s.ttft, 'p50')}{ms(s.tpot, 'p50')}{ms(s.tpot, 'p99')}"
        )
    best = ranked[0]
    if best.meets(args.min_slo_fraction):
        print(
            f"recommended: {best.cluster.label} ({best.cluster.num_nodes} node(s) of {profile.threads} thread(s) each)"
        )
    else:
        print(
            f"no shape of at most {args.max_nodes} nodes meets the SLOs for {args.min_slo_fraction:.0%} of requests"
        )
    _write(
        args.json,
        [
            {
                "cluster": c.cluster.label,
                "slo_fraction": c.slo_fraction,
                "summary": dataclasses.asdict(c.summary),
            }
            for c in ranked
        ],
    )
    return 0


def _write(path: pathlib.Path | None, results: list) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"predictions: {path}")
