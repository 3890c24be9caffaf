"""The serving studies' points: each study's clusters, workloads and rates (bench/serve_studies.py
runs them). A point is one `pdserve up` shape (or vLLM's server) under one workload at some rates.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from pdserve.planner.simulate import Cluster

MIX = {
    "kind": "mix",
    "num_requests": 16,
    "input_len": 128,
    "output_len": 48,
    "max_input_len": 512,
    "max_output_len": 128,
}
MIX_48 = {**MIX, "num_requests": 48}
# issue 32's overload workload: prompts of 256-768 tokens (long-tailed around 384), 64 out
LONG_MIX = {
    "kind": "mix",
    "num_requests": 32,
    "input_len": 384,
    "output_len": 64,
    "max_input_len": 768,
    "max_output_len": 64,
}
OVERLOAD_RATES = (0.5, 1.0, 2.0)
AUTOSCALE_RATES = (0.25, 0.5, 1.0, 2.0)  # issue 32: 0.25x to 2x of about 1 req/s (2026-12-05 profile)
SLO_ROUTER_ARGS = "--ttft-slo-s 4 --tpot-slo-s 0.25"  # the study's SLO: run it with the same in bench
LOAD_RATES = (2.0, 4.0, 8.0)
INT8_RATES = (1.0, 2.0, 4.0)
PREFILL_HEAVY = {"kind": "fixed", "num_requests": 16, "input_len": 512, "output_len": 16}
SHARED_PREFIX = {
    "kind": "shared-prefix",
    "num_requests": 16,
    "num_groups": 4,
    "questions_per_group": 4,
    "prefix_len": 384,
    "input_len": 32,
    "output_len": 16,
}


# bench/text_workloads.py's rep prompts (chat-templated ids), written once by rep_trace()
REP_TRACE_PATH = pathlib.Path("/tmp/pdserve-rep-trace-24.jsonl")
REP_TRACE = {"kind": "file", "workload_file": str(REP_TRACE_PATH)}
REP_RATES = (0.5, 1.0, 2.0, 4.0)  # issue 33's serving goal is at 1-2 req/s; 4: past both servers' capacity
# the rep study's servers on 2 cores: (--node-args, or vLLM's server's own; SLO flags; vLLM)
REP_SERVERS = (
    ("", False, False),
    ("--speculative ngram", False, False),
    ("--kv-cache-dtype int8 --speculative ngram", False, False),
    ("--kv-cache-dtype int8 --speculative ngram", True, False),
    ("", False, True),
    ("--kv-cache-dtype fp8", False, True),
)


def rep_label(args: str, slo: bool, vllm: bool) -> str:
    """'pdserve 1 colocated, ARGS, SLO flags, rep' or 'vLLM server (2 cores), ARGS, rep'."""
    parts = [
        p
        for p in ("vLLM server (2 cores)" if vllm else "pdserve 1 colocated", args, slo and "SLO flags")
        if p
    ]
    return ", ".join(parts) + (", rep" if len(parts) > 1 else " rep")


def rep_trace() -> None:
    """The rep workload as a trace for `pdserve bench serve --workload file` (no arrival times)."""
    if REP_TRACE_PATH.is_file():
        return
    from transformers import AutoTokenizer

    from bench.text_workloads import workload
    from pdserve.engine.model_fetch import fetch_default_model

    reqs = workload("rep", 24, AutoTokenizer.from_pretrained(fetch_default_model(progress=False)))
    lines = [json.dumps({"prompt": ids, "output_len": out}) for ids, out in reqs]
    REP_TRACE_PATH.write_text("\n".join(lines) + "\n")


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    label: str  # the row's name
    cluster: Cluster  # node counts (and the router's threshold)
    workload: dict  # WorkloadSpec fields; "kind" is the --workload name
    rates: tuple[float, ...]
    node_args: str = ""  # --node-args of pdserve up (vLLM's server's own arguments, for vLLM)
    router_args: str = ""  # --router-args of pdserve up
    vllm: bool = False  # vLLM's OpenAI server on every core instead of pdserve up (cluster ignored)
    threads: int | None = None  # torch threads per node; None: pdserve up's even split of the cores
    autoscale: bool = False  # pdserve up --autoscale from the cluster's shape, the --profile-1t profile
    # pdserve up --ttft-slo-s --tpot-slo-s with the study's SLO (always, with autoscale): the router
    # sheds by them and the nodes keep the steps that carry decodes within the TPOT target
    slo_flags: bool = False
    flags: tuple[str, ...] = ()  # more pdserve up flags (--min-nodes 2)


def studies() -> dict[str, list[Point]]:
    pd, colocated = Cluster(1, 1), Cluster(0, 0, 1)
    two_colocated = Cluster(0, 0, 2)
    return {
        "check": [Point("1P+1D mix", pd, MIX, (0.5, 1.0))],
        "colocated": [
            Point(f"{c.label} {name}", c, w, (0.5, 1.0))
            for name, w in (("mix", MIX), ("prefill-heavy", PREFILL_HEAVY))
            for c in (pd, colocated)
        ],
        "overload": [  # run with --ttft-slo-ms 4000 --tpot-slo-ms 250
            Point("1P+1D", pd, LONG_MIX, OVERLOAD_RATES),
            Point("1P+1D, SLO flags", pd, LONG_MIX, OVERLOAD_RATES, router_args=SLO_ROUTER_ARGS),
            Point("1 colocated", colocated, LONG_MIX, OVERLOAD_RATES),
            Point("1 colocated, SLO flags", colocated, LONG_MIX, OVERLOAD_RATES, router_args=SLO_ROUTER_ARGS),
        ],
        "autoscale": [  # run with --ttft-slo-ms 4000 --tpot-slo-ms 250 --profile-1t FILE
            Point("1P+1D", pd, LONG_MIX, AUTOSCALE_RATES, slo_flags=True),
            Point("2 colocated", two_colocated, LONG_MIX, AUTOSCALE_RATES, slo_flags=True),
            Point("1 colocated, 2 threads", colocated, LONG_MIX, AUTOSCALE_RATES, slo_flags=True),
            Point(  # stops a node in a lull
                "autoscaled, starts 1P+1D",
                pd,
                LONG_MIX,
                AUTOSCALE_RATES,
                autoscale=True,
                flags=("--min-nodes", "1"),
            ),
            Point(  # pdserve up --autoscale's defaults: its own start, both cores always in use
                "autoscaled, starts 2 colocated, --min-nodes 2",
                two_colocated,
                LONG_MIX,
                AUTOSCALE_RATES,
                autoscale=True,
                flags=("--min-nodes", "2"),
            ),
            Point(  # each node may take both cores while the other leaves them idle (engine.cpu_share)
                "autoscaled, starts 1P+1D, --max-threads 2",
                pd,
                LONG_MIX,
                AUTOSCALE_RATES,
                autoscale=True,
                node_args="--max-threads 2",
                flags=("--min-nodes", "1"),
            ),
        ],
        "ratio": [
            Point(f"{c.label} mix", c, MIX, (0.5, 1.0)) for c in (Cluster(1, 1), Cluster(1, 2), Cluster(2, 1))
        ],
        "prefix": [
            Point("2 colocated, cache on, prefix routing on", two_colocated, SHARED_PREFIX, (1.0,)),
            Point(
                "2 colocated, cache on, prefix routing off",
                two_colocated,
                SHARED_PREFIX,
                (1.0,),
                router_args="--no-prefix-routing",
            ),
            Point(
                "2 colocated, cache off",
                two_colocated,
                SHARED_PREFIX,
                (1.0,),
                node_args="--no-prefix-caching",
            ),
        ],
        "colocated-threads": [
            Point("1 colocated, 2 threads, mix", colocated, MIX, (0.5,)),
            Point("1 colocated, 1 thread, mix", colocated, MIX, (0.5,), threads=1),
        ],
        "load": [  # the vllm study's servers, 48 requests a rate, at rates that load them
            Point("pdserve 1P+1D mix", pd, MIX_48, LOAD_RATES),
            Point(
                "pdserve 1P+1D, no local prefill, mix",
                pd,
                MIX_48,
                LOAD_RATES,
                router_args="--local-prefill-margin-s=-1",
            ),
            Point("pdserve 1 colocated (2 threads) mix", colocated, MIX_48, LOAD_RATES),
            Point(
                "pdserve 1 colocated (2 threads), --speculative ngram, mix",
                colocated,
                MIX_48,
                LOAD_RATES,
                node_args="--speculative ngram",
            ),
            Point(  # the router sheds what would miss the study's SLO (run with its default SLO)
                "pdserve 1 colocated (2 threads), --speculative ngram, SLO flags, mix",
                colocated,
                MIX_48,
                LOAD_RATES,
                node_args="--speculative ngram",
                slo_flags=True,
            ),
            Point("vLLM server (2 cores) mix", colocated, MIX_48, LOAD_RATES, vllm=True),
        ],
        "int8": [  # issue 60: int8 weights served, beside bf16 (auto on a bf16 CPU) and vLLM in bf16
            Point("pdserve 1P+1D mix", pd, MIX_48, INT8_RATES),
            Point(
                "pdserve 1P+1D, --quantization int8, mix",
                pd,
                MIX_48,
                INT8_RATES,
                flags=("--quantization", "int8"),
            ),
            Point("pdserve 1 colocated mix", colocated, MIX_48, INT8_RATES),
            Point(
                "pdserve 1 colocated, --quantization int8, mix",
                colocated,
                MIX_48,
                INT8_RATES,
                flags=("--quantization", "int8"),
            ),
            Point(
                "vLLM server (2 cores), bf16, mix",
                colocated,
                MIX_48,
                INT8_RATES,
                node_args="--dtype bfloat16",
                vllm=True,
            ),
        ],
        "commit": [  # the load study's servers, by how the KV pool is committed, beside vLLM
            Point("pdserve 1 colocated, idle KV commit (default) mix", colocated, MIX_48, LOAD_RATES),
            Point(
                "pdserve 1 colocated, --kv-commit lazy, mix",
                colocated,
                MIX_48,
                LOAD_RATES,
                node_args="--kv-commit lazy",
            ),
            Point("pdserve 1P+1D, idle KV commit (default) mix", pd, MIX_48, LOAD_RATES),
            Point("vLLM server (2 cores) mix", colocated, MIX_48, LOAD_RATES, vllm=True),
        ],
        "speculative": [
            Point("pdserve 1P+1D rep", pd, REP_TRACE, (0.5,)),
            Point(
                "pdserve 1P+1D, --speculative ngram, rep",
                pd,
                REP_TRACE,
                (0.5,),
                node_args="--speculative ngram",
            ),
            Point(
                "pdserve 1P+1D, --kv-cache-dtype int8 --speculative ngram, rep",
                pd,
                REP_TRACE,
                (0.5,),
                node_args="--kv-cache-dtype int8 --speculative ngram",
            ),
            # a fresh server for each rate, the servers in turn: the trace's prompts are the same at every rate, and a
            # server that kept them in its prefix cache would skip their prefill at the next one
            *(
                Point(
                    rep_label(args, slo, vllm), colocated, REP_TRACE, (rate,), args, slo_flags=slo, vllm=vllm
                )
                for rate in REP_RATES
                for args, slo, vllm in REP_SERVERS
            ),
        ],
        "vllm": [
            Point("pdserve 1P+1D mix", pd, MIX, (0.5, 1.0, 2.0, 4.0)),
            Point("pdserve 1 colocated (2 threads) mix", colocated, MIX, (0.5, 1.0, 2.0, 4.0)),
            Point("vLLM server (2 cores) mix", colocated, MIX, (0.5, 1.0, 2.0, 4.0), vllm=True),
        ],
    }
