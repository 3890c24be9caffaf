"""Multi-turn chats whose history outgrows the KV pool: time to first token and throughput with and
without the disk offload tier, and across a restart of the whole cluster (issue 63, item 7).

Each shape is a fresh `pdserve up --colocated 1` on the default model with a small KV pool
(``--pool-blocks``, default 384 blocks of 16 tokens: about 6k tokens). ``--conversations``
chats share one long system prompt; each turn sends the whole history so far plus a new user
message (token ids, so nothing depends on the tokenizer's chat template) and streams the answer,
whose tokens join the history. Turns go round robin, ``--concurrency`` at a time, so the pool
holds only a few chats' histories at once: without a tier, a chat's next turn recomputes what
was evicted since its last one; with ``--kv-offload-dir`` it loads it. Then the cluster stops and
starts again (the same folder with the tier): the next round of turns shows what a restart
costs each shape. A last pass sends unique prompts (no reuse at all), where the tier only costs.

    .venv/bin/python bench/kv_offload.py
    .venv/bin/python bench/kv_offload.py --conversations 12 --turns 4 --pool-blocks 384
    .venv/bin/python bench/kv_offload.py --preemption     # the engine alone: preemption, long contexts

Prints a table (median and p90 TTFT of the turns after the first, output tokens per second) per
shape and phase, and the offload counters the node reported.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from pd_defaults import start  # noqa: E402

MODEL = "smollm2-135m-instruct"
OFFLOAD = re.compile(r"^pdserve_node_kv_offload_(\w+?)(?:_total)?\{[^}]*\} (\S+)", re.M)


def stream_turn(port: int, prompt: list[int], max_tokens: int) -> tuple[float, list[int], float]:
    """(TTFT s, output token ids, total s) of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start_t, first, tokens = time.perf_counter(), None, []
    with urllib.request.urlopen(request, timeout=600) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            choice = (json.loads(line[6:])["choices"] or [{}])[0]
            new = (choice.get("logprobs") or {}).get("tokens", [])
            if new and first is None:
                first = time.perf_counter() - start_t
            tokens += [int(t.removeprefix("token_id:")) for t in new]
    return first or 0.0, tokens, time.perf_counter() - start_t


class Chats:
    """The conversations' histories (token ids), grown a turn at a time."""

    def __init__(self, num: int, system_tokens: int, user_tokens: int, seed: int) -> None:
        self.rng = random.Random(seed)
        system = self._tokens(system_tokens)
        self.user_tokens = user_tokens
        self.histories = [[*system, *self._tokens(user_tokens)] for _ in range(num)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 40000) for _ in range(n)]

    def round(self, port: int, max_tokens: int, concurrency: int) -> list[tuple[float, int, float]]:
        """One turn of every chat, ``concurrency`` at a time: (TTFT, output tokens, seconds) each."""

        def turn(i: int) -> tuple[float, int, float]:
            ttft, out, seconds = stream_turn(port, self.histories[i], max_tokens)
            self.histories[i] += [*out, *self._tokens(self.user_tokens)]
            return ttft, len(out), seconds

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(turn, range(len(self.histories))))


def offload_counts(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in OFFLOAD.findall(text)}


def summary(turns: list[tuple[float, int, float]], seconds: float) -> dict[str, float]:
    ttfts = sorted(t for t, _, _ in turns)
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "output_tok_per_s": sum(n for _, n, _ in turns) / seconds,
    }


def run_shape(args, label: str, flags: str, tmp: pathlib.Path) -> list[dict]:
    chats = Chats(args.conversations, args.system_tokens, args.user_tokens, args.seed)
    rows = []
    up = f"--colocated 1 --node-args '--num-kv-blocks {args.pool_blocks}' {flags}"
    proc = start(up, args.port, tmp / f"{label}-up.log")
    try:
        chats.round(args.port, args.max_tokens, args.concurrency)  # every chat's first turn
        t0 = time.perf_counter()
        turns = [
            r for _ in range(args.turns) for r in chats.round(args.port, args.max_tokens, args.concurrency)
        ]
        rows.append({"shape": label, "phase": "later turns", **summary(turns, time.perf_counter() - t0)})
        rows[-1]["offload"] = offload_counts(args.port)
    finally:
        stop(proc)
    proc = start(up, args.port, tmp / f"{label}-restart.log")  # the whole cluster again, same folder
    try:
        t0 = time.perf_counter()
        turns = chats.round(args.port, args.max_tokens, args.concurrency)
        rows.append({"shape": label, "phase": "after a restart", **summary(turns, time.perf_counter() - t0)})
        unique = Chats(args.conversations, args.system_tokens + args.user_tokens, 0, args.seed + 1)
        t0 = time.perf_counter()
        turns = unique.round(args.port, args.max_tokens, args.concurrency)  # no reuse: the tier's cost
        rows.append({"shape": label, "phase": "unique prompts", **summary(turns, time.perf_counter() - t0)})
        rows[-1]["offload"] = offload_counts(args.port)
    finally:
        stop(proc)
    return rows


def stop(proc) -> None:
    import os
    import signal

    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except Exception:  # noqa: BLE001 - a stuck cluster is killed
        os.killpg(proc.pid, signal.SIGKILL)


def preemption(args) -> None:
    """Long contexts decoding in a pool too small for all of them, in one engine (the default
    model, float32): the scheduler preempts; without a tier a resumed sequence recomputes its
    context, with one it loads what was evicted since. Same greedy output either way."""
    from pdserve.engine import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_fetch import fetch_default_model

    model = str(fetch_default_model())
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.preempt_context)] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=args.preempt_output, ignore_eos=True)
    results = {}
    for label, extra in (("no tier", {}), ("disk tier", {"kv_offload_dir": tempfile.mkdtemp()})):
        engine = LLMEngine(
            EngineConfig(model=model, dtype="float32", num_kv_blocks=args.preempt_pool_blocks, **extra)
        )
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        seqs = [engine.requests[str(i)].seqs[0] for i in range(len(prompts))]
        start, outputs, prompt_tokens = time.perf_counter(), {}, 0
        while engine.has_work():
            for out in engine.step().outputs:
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
        seconds = time.perf_counter() - start
        prompt_tokens = sum(c.prompt_tokens for c in engine.step_stats.by_kind.values())
        results[label] = (
            seconds,
            prompt_tokens,
            sum(s.num_preemptions for s in seqs),
            outputs,
            engine.stats().offload,
        )
        engine.close()
    print("\n| shape | seconds | prompt tokens computed | preemptions | offload |\n|---|---|---|---|---|")
    for label, (seconds, computed, preempted, _, offload) in results.items():
        loaded = (offload or {}).get("loaded_blocks", 0)
        print(f"| {label} | {seconds:.1f} | {computed} | {preempted} | {loaded} blocks loaded |")
    same = results["no tier"][3] == results["disk tier"][3]
    print(f"greedy outputs equal: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3, help="turns timed after each chat's first")
    ap.add_argument("--system-tokens", type=int, default=400, help="the shared system prompt")
    ap.add_argument("--user-tokens", type=int, default=120, help="each new user message")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--pool-blocks", type=int, default=384)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--preemption", action="store_true", help="the engine-alone preemption case instead")
    ap.add_argument("--preempt-context", type=int, default=1500)
    ap.add_argument("--preempt-output", type=int, default=200)
    ap.add_argument("--preempt-pool-blocks", type=int, default=320)
    args = ap.parse_args()
    if args.preemption:
        return preemption(args)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kv-offload-bench-"))
    rows = run_shape(args, "no tier", "", tmp)
    rows += run_shape(args, "disk tier", f"--kv-offload-dir {tmp / 'tier'}", tmp)
    print("\n| shape | phase | TTFT p50 ms | TTFT p90 ms | output tok/s |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['phase']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
            f"{r['output_tok_per_s']:.1f} |"
        )
    for r in rows:
        if r.get("offload"):
            print(r["shape"], r["phase"], {k: int(v) for k, v in r["offload"].items()})


if __name__ == "__main__":
    main()
