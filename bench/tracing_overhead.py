"""What OpenTelemetry tracing costs a request: on, off, and absent (the code before tracing).

    .venv/bin/python -m bench.tracing_overhead [--requests 300] [--rounds 3]

**Router, end to end.** The real router (uvicorn, its sockets, its event loop) in a child
process with the test suite's fake nodes (tests/test_router_support.py: a prefill node and a
decode node that answer at once, no model), so what is timed is the router's own work on a
request: validation, tokenizing, admission, routing, the GenerateRequest, relaying 8 tokens, the
answer. Sequential disaggregated completions, each mode in its own child, the modes taking turns
round after round (drift falls on all alike):

- ``absent``: the router as it was before tracing (``git archive`` of the commit before the
  trace context entered the wire, into a temporary folder): no hooks at all;
- ``off``: this checkout, no OTEL_* variable and no flag: the hooks' ``is None`` tests, the
  traceparent lookup, and nothing of the SDK imported (the child checks its sys.modules);
- ``on``: this checkout exporting every span (OTLP/HTTP, the SDK's batch processor) to a
  receiver in this process (tests/otlp_receiver.py), with a client traceparent on every request.

**Node hooks.** One disaggregated request's node spans (prefill queue and prefill, reserve and
send, land, decode queue and decode: node/spans.py) recorded with a real tracer, and the same
hooks with tracing off (``Stream.trace`` None), per request in microseconds, in this process.

It prints the CPU, each mode's median and mean latency per request and the ratios to ``absent``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The child: a router over fake nodes from whichever tree PYTHONPATH names, timed per request.
CHILD = r"""
import asyncio, json, os, sys, time
import httpx
from pdserve.engine.model_fetch import fetch_default_model
from pdserve.router.tokenizer import Tokenizer
from tests.test_router_support import LONG_PROMPT, TEXT, fake_cluster, fake_pair

model = fetch_default_model(progress=False)
tokens = Tokenizer(model).encode(TEXT)
warmup, num = int(sys.argv[1]), int(sys.argv[2])
config = {"otlp_traces_endpoint": os.environ["BENCH_OTLP"]} if os.environ.get("BENCH_OTLP") else {}
headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"} if config else {}

async def go():
    async with fake_cluster(model, fake_pair(tokens), **config) as cluster:
        async with httpx.AsyncClient(base_url=cluster.base_url) as http:
            body = {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
            seconds = []
            for i in range(warmup + num):
                start = time.perf_counter()
                reply = await http.post("/v1/completions", json=body, headers=headers)
                seconds.append(time.perf_counter() - start)
                assert reply.status_code == 200, reply.text
            return seconds[warmup:]

seconds = asyncio.run(go())
sdk = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter")))
print(json.dumps({"seconds": seconds, "sdk_imported": bool(sdk)}))
"""


def absent_tree(rev: str, into: pathlib.Path) -> pathlib.Path:
    """The repository at ``rev`` (files only, no worktree), with the links pdserve/X -> ../X."""
    archive = into / "tree.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), rev], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="tar")
    return into / "tree"


def before_tracing() -> str:
    """The commit before the trace context entered the wire."""
    out = subprocess.run(
        ["git", "log", "--reverse", "--format=%H", "-S", "class TraceContext", "--", "protocol/messages.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    if not out:
        raise SystemExit("no commit adds TraceContext to protocol/messages.py: give --absent-rev")
    return out[0] + "^"


def run_child(tree: pathlib.Path, otlp: str | None, warmup: int, num: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(tree)
    if otlp:
        env["BENCH_OTLP"] = otlp
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(warmup), str(num)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def node_hooks_us(num: int, endpoint: str) -> tuple[float, float, float]:
    """Microseconds per request of the node-side hooks, exporting to ``endpoint``: on (the
    engine loop's time in them), on (the process's CPU time, the export's encoding and sending
    included), off. Run in a process of its own: a receiver's threads beside it would take the
    GIL from it."""
    from pdserve.engine.core.outputs import CompletionOutput, RequestOutput
    from pdserve.kv_transfer.outcomes import ReceivedKV
    from pdserve.kv_transfer.sender_records import TransferStats
    from pdserve.node.options import NodeOptions
    from pdserve.node.spans import NodeSpans
    from pdserve.node.streams import Stream
    from pdserve.prefill_node.shipper import Outcome
    from pdserve.protocol.messages import RequestMeta, TraceContext
    from pdserve.protocol.reasons import FinishReason
    from pdserve.protocol.registry import Role
    from pdserve.protocol.tracing import Tracer, TraceSettings

    tracer = Tracer(TraceSettings(("otlp",), "http/protobuf", endpoint + "/v1/traces"), "bench", "n")
    trace = TraceContext(traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    prefill = NodeSpans(tracer, NodeOptions(role=Role.PREFILL, model_id="m", node_id="p"))
    decode = NodeSpans(tracer, NodeOptions(role=Role.DECODE, model_id="m", node_id="d"))
    stats = TransferStats("r", 0, 4, 1 << 20, 0.01, False, True)
    now = time.time()
    outcome = Outcome("r", stats, None, started_at=now, granted_at=now)
    meta = RequestMeta(reply_addr="tcp://x:1", deadline=now + 60, shipped_at=now, trace=trace)
    received = ReceivedKV("r", 1, 0, 1 << 20, 0, meta)
    out = RequestOutput("r", [1] * 40, [CompletionOutput(0, [1] * 8, "", FinishReason.LENGTH, None)], True, 0)

    def one(context: TraceContext | None) -> None:
        p = Stream("r", "tcp://x:1", 40, 0.0, trace=context)
        t = time.monotonic()
        if p.trace is not None:  # as the servers test: a request nobody traces costs this
            prefill.prefilled(p, t, t)
            prefill.shipped(p, outcome, "tcp://d:1")
        d = Stream("r", "tcp://x:1", 40, 0.0, adopted_at=t, trace=context)
        if d.trace is not None:
            decode.landed(d, meta, received)
            decode.emitted(d, out)

    timings = []
    for context in (trace, None):
        for _ in range(BATCH):
            one(context)
        tracer.flush()
        elapsed, cpu_start = 0.0, time.process_time()
        for _ in range(num // BATCH):  # a batch's spans stay under the size that wakes the exporter
            start = time.perf_counter()
            for _ in range(BATCH):
                one(context)
            elapsed += time.perf_counter() - start
            tracer.flush()  # the export, on the exporter's thread: counted in the CPU time only
        num_timed = num // BATCH * BATCH
        timings += [elapsed / num_timed * 1e6, (time.process_time() - cpu_start) / num_timed * 1e6]
    tracer.close()
    return timings[0], timings[1], timings[2]


BATCH = 60  # requests timed between two exports: 420 spans, under the batch processor's 512


def cpu() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        "unknown CPU",
    )
    return f"{model}, {os.cpu_count()} cores visible, {len(os.sched_getaffinity(0))} usable"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300, help="timed requests per mode and round")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--absent-rev", default=None, help="the commit timed as 'absent' (default: before tracing)"
    )
    parser.add_argument("--node-hooks", metavar="ENDPOINT", help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.node_hooks:
        print(json.dumps(node_hooks_us(10000, args.node_hooks)))
        return
    from tests.otlp_receiver import OTLPReceiver

    print(f"CPU: {cpu()}")
    receiver = OTLPReceiver()
    seconds: dict[str, list[float]] = {"absent": [], "off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        old = absent_tree(args.absent_rev or before_tracing(), pathlib.Path(tmp))
        modes = {"absent": (old, None), "off": (ROOT, None), "on": (ROOT, receiver.http_endpoint)}
        for round_ in range(args.rounds):
            for mode, (tree, otlp) in modes.items():
                result = run_child(tree, otlp, args.warmup, args.requests)
                assert mode == "on" or not result["sdk_imported"], f"{mode}: the SDK was imported"
                seconds[mode] += result["seconds"]
                print(
                    f"round {round_ + 1} {mode:>6}: median {statistics.median(result['seconds']) * 1e3:.3f} ms"
                )
    base = statistics.median(seconds["absent"])
    print(
        f"\nrouter, {args.rounds} x {args.requests} sequential P->D completions per mode (8 tokens, fake nodes):"
    )
    print("| mode | median ms | p10 ms | mean ms | median / absent | p10 / absent |")
    print("|---|---|---|---|---|---|")
    base_p10 = _p10(seconds["absent"])
    for mode, values in seconds.items():
        median, p10 = statistics.median(values), _p10(values)
        print(
            f"| {mode} | {median * 1e3:.3f} | {p10 * 1e3:.3f} | {statistics.fmean(values) * 1e3:.3f} "
            f"| {median / base:.3f} | {p10 / base_p10:.3f} |"
        )
    print(f"spans received from the 'on' router: {len(receiver.spans)}")
    hooks = [sys.executable, "-m", "bench.tracing_overhead", "--node-hooks", receiver.http_endpoint]
    out = subprocess.run(hooks, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    on_us, on_cpu_us, off_us = json.loads(out.stdout.strip().splitlines()[-1])
    receiver.close()
    print(
        "\nnode hooks per P->D request (7 spans; two Streams made either way): "
        f"on {on_us:.1f} us in the engine loop, {on_cpu_us:.1f} us of CPU with the export; off {off_us:.2f} us"
    )


def _p10(values: list[float]) -> float:
    """The 10th percentile: the latency when the machine's other tenants leave it alone."""
    return statistics.quantiles(values, n=10)[0]


if __name__ == "__main__":
    main()
