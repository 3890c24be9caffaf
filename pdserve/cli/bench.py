"""`pdserve bench serve`: load any OpenAI-compatible server and measure it (see bench_serve/)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported in the handler only, so that `pdserve --help` stays fast
    from pdserve.bench_serve.client import Endpoint
    from pdserve.bench_serve.spec import WorkloadSpec
    from pdserve.bench_serve.sweep import SweepSpec


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks", description="Benchmarks.")
    commands = parser.add_subparsers(title="benchmarks", metavar="BENCH", required=True)
    serve = commands.add_parser(
        "serve",
        help="drive an OpenAI-compatible server with streamed requests and measure it",
        description="Send a seeded synthetic workload (or a JSONL trace) to /v1/completions or "
        "/v1/chat/completions, streamed, at a rate or a fixed concurrency; report throughput, "
        "TTFT/TPOT/ITL/end-to-end percentiles, goodput and errors; write every request's record as JSON.",
    )
    _add_target(serve)
    add_workload_args(serve)
    _add_load(serve)
    _add_output(serve)
    serve.set_defaults(run=run_bench_serve)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--model", default=None, help="model id to request (default: the first in /v1/models)")
    p.add_argument(
        "--api",
        choices=("completions", "chat"),
        default="completions",
        help="endpoint (default: %(default)s)",
    )
    p.add_argument(
        "--text-prompts",
        action="store_true",
        help="completions: text prompts instead of token ids (ids give exact prompt lengths)",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the requested tokens (default: on)",
    )
    p.add_argument(
        "--no-logprobs",
        action="store_true",
        help="count one token per text event instead of asking for logprobs (servers without them)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds without a byte before a request fails"
    )


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags (`pdserve plan simulate` takes the same ones)."""
    p.add_argument(
        "--workload", choices=("fixed", "mix", "shared-prefix", "multi-turn", "file"), default="fixed"
    )
    p.add_argument("--workload-file", type=pathlib.Path, default=None, help="JSONL trace for --workload file")
    p.add_argument(
        "--save-workload", type=pathlib.Path, default=None, help="write the first run's workload as JSONL"
    )
    p.add_argument(
        "--num-requests", type=int, default=24, help="requests per run, at most (default: %(default)s)"
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens (mix: median; shared-prefix: "
        "question; multi-turn: each user turn) (default: %(default)s)",
    )
    p.add_argument(
        "--output-len", type=int, default=64, help="output tokens (mix: median) (default: %(default)s)"
    )
    p.add_argument("--min-input-len", type=int, default=16)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=8)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument(
        "--length-sigma", type=float, default=0.8, help="mix: spread of log(length) (default: %(default)s)"
    )
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: system prompts")
    p.add_argument(
        "--questions-per-group", type=int, default=8, help="shared-prefix: questions per system prompt"
    )
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: system prompt tokens")
    p.add_argument("--num-conversations", type=int, default=4, help="multi-turn: conversations")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument(
        "--token-id-range",
        default="100,10000",
        metavar="LOW,HIGH",
        help="random prompt ids are drawn from [LOW, HIGH) (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="run k of a sweep uses seed + k")


def _add_load(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--request-rate",
        default="inf",
        metavar="R[,R...]",
        help="mean requests per second; a list sweeps, one run each; inf: all at once (default)",
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1: Poisson (default)"
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most; with rate inf this is a fixed-concurrency closed loop",
    )
    p.add_argument(
        "--duration", type=float, default=math.inf, help="seconds per run after which nothing is sent"
    )
    p.add_argument(
        "--drain", type=float, default=120.0, help="seconds after --duration before requests are cut off"
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="requests of the workload (other prompts) sent all at once before the runs, not counted: "
        "a fresh server pays its first-touch costs there (default: none)",
    )
    p.add_argument(
        "--ttft-slo-ms", type=float, default=3000.0, help="goodput's TTFT target (default: %(default)s)"
    )
    p.add_argument(
        "--tpot-slo-ms", type=float, default=300.0, help="goodput's TPOT target (default: %(default)s)"
    )


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--result-json",
        type=pathlib.Path,
        default=pathlib.Path("bench-serve.json"),
        help="config, summaries and every request's record (default: %(default)s)",
    )
    p.add_argument(
        "--plot-dir", type=pathlib.Path, default=None, help="write PNG plots here (needs matplotlib)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _specs(args: argparse.Namespace) -> tuple[WorkloadSpec, SweepSpec, Endpoint]:
    from pdserve.bench_serve.client import Api, Endpoint, served_model
    from pdserve.bench_serve.metrics import Slo
    from pdserve.bench_serve.runner import Limits
    from pdserve.bench_serve.spec import parse_rates, style_for
    from pdserve.bench_serve.sweep import SweepSpec

    api = Api(args.api)
    workload = workload_spec(args, style_for(api, args.text_prompts))
    limits = Limits(args.max_concurrency, args.duration, args.drain)
    sweep = SweepSpec(
        parse_rates(args.request_rate),
        args.burstiness,
        limits,
        Slo(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3),
        args.seed,
        args.warmup_requests,
    )
    model = args.model or served_model(args.base_url, args.api_key)
    endpoint = Endpoint(
        args.base_url, api, model, args.ignore_eos, not args.no_logprobs, args.request_timeout, args.api_key
    )
    return workload, sweep, endpoint


def workload_spec(args: argparse.Namespace, style) -> WorkloadSpec:
    """The workload flags of ``add_workload_args`` as a WorkloadSpec of prompts in ``style``."""
    from pdserve.bench_serve.spec import WorkloadKind, WorkloadSpec
    from pdserve.bench_serve.workload import TokenSpace

    low, high = (int(x) for x in args.token_id_range.split(","))
    return WorkloadSpec(
        WorkloadKind(args.workload),
        style,
        args.num_requests,
        args.input_len,
        args.output_len,
        args.min_input_len,
        args.max_input_len,
        args.min_output_len,
        args.max_output_len,
        args.length_sigma,
        args.num_groups,
        args.questions_per_group,
        args.prefix_len,
        args.num_conversations,
        args.num_turns,
        TokenSpace(low, high),
        args.workload_file,
    )


def run_bench_serve(args: argparse.Namespace) -> int:
    try:
        import httpx
    except ImportError:
        print("pdserve bench serve needs httpx: pip install 'pdserve[bench]'", file=sys.stderr)
        return 1
    from pdserve.bench_serve import report, trace
    from pdserve.bench_serve.sweep import sweep

    try:
        workload, spec, endpoint = _specs(args)
        if args.save_workload:
            trace.write(args.save_workload, workload.build(spec.seed))
        print(
            f"bench serve: {endpoint.url}, model {endpoint.model}, {workload.kind.value} workload", flush=True
        )
        runs = sweep(workload, spec, endpoint, progress=not args.no_progress)
    except (ValueError, OSError, httpx.HTTPError) as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 1
    report.write_json(args.result_json, _config(args, endpoint.model), runs)
    print(f"records: {args.result_json}")
    if args.plot_dir:
        from pdserve.bench_serve.plots import write_plots

        for path in write_plots(args.plot_dir, runs):
            print(f"plot: {path}")
    return 0


def _config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The flags as given, JSON-safe, with the model actually requested."""
    config = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items() if k != "run"}
    config["model"] = model
    config["duration"] = None if math.isinf(args.duration) else args.duration
    json.dumps(config)  # fails here, not halfway through writing the file
    return config
