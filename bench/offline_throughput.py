"""Offline throughput: pdserve ``LLM.generate`` against Hugging Face ``generate`` in one run.

Workloads (greedy, fp32, fixed-length outputs via ignore_eos):
  fixed: N prompts x 128 tokens in, 128 out
  mix:   N prompts of 16-512 tokens, outputs of 8-256 tokens (seeded)
HF runs static batches (padded left; each batch runs until its longest output), at every
batch size in --hf-batch-sizes; the best is the baseline. Prints tok/s and the ratio.

    python bench/offline_throughput.py --model tiny --workload both
    python bench/offline_throughput.py --model default --workload mix --num-prompts 32
    python bench/offline_throughput.py --model default --workload mix16 --engine-defaults --busy-neighbours 1

--engine-defaults runs pdserve as a new user would, ``LLM(model)`` with no options, in a child
process of its own that imports the engine before torch (so the engine's OpenMP default applies;
HF runs here with libgomp's). --busy-neighbours N keeps N ``while True: pass`` processes running
through both sides, as another CPU-bound program would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from pdserve.engine import LLM, SamplingParams  # noqa: E402


def tiny_bench_model() -> pathlib.Path:
    """The BASELINES.md tiny Llama: hidden 256, 4 layers, vocab 49152, seeded random weights."""
    path = pathlib.Path(tempfile.gettempdir()) / "pdserve-bench-tiny-llama"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=49152,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


# prompt and output length ranges: mix (this bench's), mix16 (a new user's: 16-256 in, 16-128 out),
# mix32 (engine-speed issue's against vLLM: 32-512 in, 16-160 out)
MIXES = {"mix": (16, 512, 8, 256), "mix16": (16, 256, 16, 128), "mix32": (32, 512, 16, 160)}


def workload(kind: str, n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    if kind == "fixed":
        return [(torch.randint(10, vocab, (128,), generator=g).tolist(), 128) for _ in range(n)]
    lo_in, hi_in, lo_out, hi_out = MIXES[kind]
    lens = torch.randint(lo_in, hi_in + 1, (n,), generator=g).tolist()
    outs = torch.randint(lo_out, hi_out + 1, (n,), generator=g).tolist()
    return [
        (torch.randint(10, vocab, (k,), generator=g).tolist(), o) for k, o in zip(lens, outs, strict=True)
    ]


CHILD = """
import json, sys, time
from pdserve.engine import LLM, SamplingParams  # first: the engine's OpenMP default applies
spec = json.load(open(sys.argv[1]))
llm = LLM(spec["model"])
llm.generate([[11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=4))
params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in spec["reqs"]]
start = time.perf_counter()
outs = llm.generate([p for p, _ in spec["reqs"]], params)
elapsed = time.perf_counter() - start
print(json.dumps([elapsed, sum(len(o.outputs[0].token_ids) for o in outs)]))
"""


def run_pdserve_defaults(path: pathlib.Path, reqs) -> tuple[float, int]:
    """``LLM(model)`` with no options, in a fresh process with no OpenMP variables set."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"model": str(path), "reqs": reqs}, f)
        f.flush()
        out = subprocess.run(
            [sys.executable, "-c", CHILD, f.name],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=pathlib.Path(__file__).resolve().parent.parent,
        )
    print(out.stderr.strip().splitlines()[-1], flush=True)  # the engine's start-up line
    elapsed, useful = json.loads(out.stdout.strip().splitlines()[-1])
    assert useful == sum(o for _, o in reqs)
    return elapsed, useful


@contextlib.contextmanager
def busy_neighbours(n: int):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_pdserve(path: pathlib.Path, reqs, max_num_seqs: int) -> tuple[float, int]:
    llm = LLM(str(path), max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, kv_cache_memory_mb=2048)
    llm.generate([[11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    assert useful == sum(o for _, o in reqs)
    return elapsed, useful


@torch.inference_mode()
def run_hf(path: pathlib.Path, reqs, batch: int) -> tuple[float, int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        model.generate(
            ids, attention_mask=mask, max_new_tokens=max(o for _, o in chunk), do_sample=False, pad_token_id=0
        )
    elapsed = time.perf_counter() - start
    return elapsed, sum(o for _, o in reqs)  # useful tokens: padding past a request's own length is waste


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="'tiny', 'default' or a model folder")
    ap.add_argument("--workload", choices=["fixed", *MIXES, "both"], default="both")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="8,32,64")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine-defaults", action="store_true", help="pdserve with no options (see above)")
    ap.add_argument("--busy-neighbours", type=int, default=0)
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating pdserve/HF rounds; the median ratio counts"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        path = tiny_bench_model()
    elif args.model == "default":
        from pdserve.engine.model_fetch import fetch_default_model

        path = fetch_default_model(progress=False)
    else:
        path = pathlib.Path(args.model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    results = {}
    for kind in ["fixed", "mix"] if args.workload == "both" else [args.workload]:
        reqs = workload(kind, args.num_prompts, vocab)
        rounds = []
        for r in range(args.rounds):  # alternate, so both sides see the same (noisy) machine
            with busy_neighbours(args.busy_neighbours):
                if args.engine_defaults:
                    t, n = run_pdserve_defaults(path, reqs)
                else:
                    t, n = run_pdserve(path, reqs, args.max_num_seqs)
                ours = n / t
                hf = {}
                for b in (int(x) for x in args.hf_batch_sizes.split(",")):
                    t_hf, n_hf = run_hf(path, reqs, b)
                    hf[b] = n_hf / t_hf
            best = max(hf.values())
            print(
                f"[{kind}] round {r}: pdserve {ours:.1f} tok/s; HF "
                + ", ".join(f"batch {b}: {v:.1f}" for b, v in hf.items())
                + f"; ratio {ours / best:.2f}x",
                flush=True,
            )
            rounds.append(
                {
                    "pdserve_tok_s": round(ours, 1),
                    "hf_tok_s": {str(k): round(v, 1) for k, v in hf.items()},
                    "ratio_vs_best_hf": round(ours / best, 2),
                }
            )
        median = statistics.median(x["ratio_vs_best_hf"] for x in rounds)
        print(f"[{kind}] median ratio over {len(rounds)} rounds: {median:.2f}x", flush=True)
        results[kind] = {"rounds": rounds, "median_ratio_vs_best_hf": median}
    summary = {"model": str(args.model), "num_prompts": args.num_prompts, "results": results}
    summary |= {"engine_defaults": args.engine_defaults, "busy_neighbours": args.busy_neighbours}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
