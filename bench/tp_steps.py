"""A tensor-parallel engine's step times against one process, side by side on this machine.

    python -m bench.tp_steps [--threads 2] [--rounds 3]

A SmolLM2-135M-shaped Llama (30 layers, width 576, MLP 1536, vocabulary 49152, seeded random
weights) with 8 query and 2 KV heads (SmolLM2's 9 and 3 do not split over 2 ranks). Each round
times, at tp=1 with ``--threads`` threads and at tp=2 with ``--threads / 2`` per rank:
- a prefill step of 512 prompt tokens (four prompts of 128), the first token sampled;
- a decode step of 32 running sequences of 128 tokens of context.
Then the collectives alone: gloo all-reduces of the activation shapes a step runs (two a layer,
one after the embedding) and the LM head's all-gather, between two processes of one thread:
their time against the tp=2 step is the share the group costs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pathlib
import statistics
import tempfile
import time

import torch
import transformers

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.core.sequence import SequenceStatus
from pdserve.engine.executor.parallel import close_parallel, init_parallel

LAYERS, WIDTH, VOCAB = 30, 576, 49152


def make_model(root: pathlib.Path) -> str:
    config = transformers.LlamaConfig(
        hidden_size=WIDTH,
        intermediate_size=1536,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=72,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root, safe_serialization=True)
    return str(root)


def step_times(path: str, tp: int, threads: int, rounds: int) -> tuple[float, float]:
    """Median seconds of a 512-token prefill step and of a 32-sequence decode step."""
    llm = LLM(
        path, tensor_parallel_size=tp, num_threads=threads, num_kv_blocks=512, max_num_batched_tokens=512
    )
    engine = llm.engine
    prefill, decode = [], []
    try:
        for r in range(rounds + 1):  # the first round warms up
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            for i in range(4):
                engine.add_request(f"p{r}-{i}", [(7 * i + j) % 4000 + 5 for j in range(128)], params)
            start = time.perf_counter()
            engine.step()  # all four prompts in one 512-token step
            prefill.append(time.perf_counter() - start)
            while engine.has_work():
                engine.step()
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            for i in range(32):
                engine.add_request(f"d{r}-{i}", [(11 * i + j) % 4000 + 5 for j in range(127)], params)
            while any(s.status is SequenceStatus.WAITING for s in engine.scheduler.waiting):
                engine.step()  # the prompts, chunked
            while engine.scheduler.waiting or any(
                s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
            ):
                engine.step()
            start = time.perf_counter()
            engine.step()  # 32 decodes
            decode.append(time.perf_counter() - start)
            while engine.has_work():
                engine.step()
    finally:
        engine.close()
    return statistics.median(prefill[1:]), statistics.median(decode[1:])


def _collectives(rank: int, port: int, rounds: int, out) -> None:
    torch.set_num_threads(1)
    state = init_parallel(2, rank, f"tcp://127.0.0.1:{port}", "gloo", 60)
    try:
        times = {}
        for name, rows in (("prefill", 512), ("decode", 32)):
            x = torch.randn(rows, WIDTH)
            logits = torch.randn(4 if name == "prefill" else rows, VOCAB // 2)
            best = []
            for _ in range(rounds + 1):
                state.all_reduce(torch.zeros(1))  # line up
                start = time.perf_counter()
                for _ in range(2 * LAYERS + 1):
                    state.all_reduce(x)
                state.all_gather(logits)
                best.append(time.perf_counter() - start)
            times[name] = statistics.median(best[1:])
        if rank == 0:
            out.put(times)
    finally:
        close_parallel(state)


def collective_times(rounds: int) -> dict[str, float]:
    from pdserve.launcher.ports import free_port

    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_collectives, args=(r, port, rounds, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    times = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(pathlib.Path(tmp) / "model")
        one = step_times(path, 1, args.threads, args.rounds)
        two = step_times(path, 2, args.threads, args.rounds)
    coll = collective_times(args.rounds)
    print(
        f"| step | tp=1, {args.threads} threads | tp=2, {max(1, args.threads // 2)} per rank | ratio | collectives | their share |"
    )
    print("|---|---|---|---|---|---|")
    for i, name in enumerate(("prefill, 512 tokens", "decode, 32 sequences")):
        key = "prefill" if i == 0 else "decode"
        print(
            f"| {name} | {one[i] * 1e3:.1f} ms | {two[i] * 1e3:.1f} ms | {two[i] / one[i]:.2f}x "
            f"| {coll[key] * 1e3:.1f} ms | {coll[key] / two[i]:.0%} |"
        )


if __name__ == "__main__":
    main()
