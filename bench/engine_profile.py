"""Where an offline run's time goes, pdserve and vLLM's CPU build side by side, by the same rules.

Each engine runs the same token-id workload twice in one process: a warm-up pass (first-touch
faults, oneDNN's primitive creation and vLLM's torch.compile happen there), then a pass under the
torch profiler (CPU activity). vLLM runs in its own venv with its engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the profiler sees its ops. Each op's self time (wall time on
the thread that called it, without its children's) goes into a category by its name (``CATEGORIES``);
"Python, scheduling, the rest" is the pass's wall time less every op's self time. The profiler's own
overhead lands mostly there and in the many small ops, so read the shares, not the absolute times.

    .venv/bin/python bench/engine_profile.py --vllm-python /work/vllm-venv/bin/python --dtype bfloat16
    .venv/bin/python bench/engine_profile.py --vllm-python /work/vllm-venv/bin/python --dtype float32
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (category, name pattern) in order: the first match wins
CATEGORIES = [
    ("linear layers (matmul)", r"linear|addmm|\bmm\b|aten::mm|matmul|gemm|onednn|mkldnn|bmm"),
    (
        "KV cache write",
        r"reshape_and_cache|kv_cache_update|kv_write|cache_write|index_copy|index_put|scatter",
    ),
    ("attention", r"attention|attn|sdpa|scaled_dot"),
    # vLLM's torch.compile'd graph: inductor's fused norms, rotary, activations and residual adds
    (
        "norms, rotary, activations",
        r"rms|norm|rotary|rope|silu|gelu|act_and_mul|fused_add|CompiledFxGraph|Pregraph",
    ),
    ("sampling and logits", r"argmax|softmax|topk|top_k|sort|multinomial|sampl|logit|exponential|cumsum"),
]
OTHER_OPS = "other torch ops (copies, indexing, elementwise)"
PYTHON = "Python, scheduling, the rest"

CHILD = r"""
import json, os, sys, time
spec = json.load(open(sys.argv[1]))
engine = spec["engine"]
if engine == "pdserve":
    from pdserve.engine import LLM, SamplingParams  # first: the engine's OpenMP default applies
    llm = LLM(spec["model"], dtype=spec["dtype"], num_threads=spec["threads"], max_num_seqs=spec["max_num_seqs"],
              enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in spec["reqs"]]
    def run(reqs_params):
        return llm.generate([p for p, _ in spec["reqs"]], params)
else:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, gpu_memory_utilization=0.5, dtype=spec["dtype"],
              max_num_seqs=spec["max_num_seqs"], max_model_len=1024, seed=0, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in spec["reqs"]]
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in spec["reqs"]]
    def run(_):
        return llm.generate(prompts, params, use_tqdm=False)
import torch
start = time.perf_counter()
run(None)  # warm-up: the same prompts (prefix caching is off in both: no hits on the profiled pass)
warm_s = time.perf_counter() - start
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    start = time.perf_counter()
    outs = run(None)
    wall = time.perf_counter() - start
ops = {}
for e in prof.key_averages():
    ops[e.key] = ops.get(e.key, 0.0) + e.self_cpu_time_total / 1e6
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print("RESULT " + json.dumps({"wall": wall, "warm_up_s": warm_s, "tokens": tokens, "ops": ops}), flush=True)
"""


def categorize(ops: dict[str, float], wall: float) -> dict[str, float]:
    out = {name: 0.0 for name, _ in CATEGORIES} | {OTHER_OPS: 0.0}
    for key, seconds in ops.items():
        if key.startswith("ProfilerStep"):
            continue
        name = next((n for n, pattern in CATEGORIES if re.search(pattern, key, re.IGNORECASE)), OTHER_OPS)
        out[name] += seconds
    out[PYTHON] = max(0.0, wall - sum(out.values()))
    return out


PEAK_SHAPE = "2048x2048x2048"


def linear_flops(model: pathlib.Path, reqs) -> float:
    """The pass's linear-layer FLOPs: every prompt and output token through each layer's
    projections, and the vocabulary projection for each output token (a prompt's other rows
    compute no logits)."""
    c = json.loads((model / "config.json").read_text())
    h, inter, layers, vocab = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
    )
    head = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    per_token = layers * (h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h)
    prompt, out = sum(len(p) for p, _ in reqs), sum(o for _, o in reqs)
    return 2.0 * (per_token * (prompt + out - len(reqs)) + h * vocab * out)


def matmul_peak(dtype: str, threads: int) -> float:
    """FLOP/s of a large square matmul on oneDNN's packed path (kernels/cpu_linear.py), best of 5:
    what this CPU's arithmetic reaches where nothing else limits it."""
    import time

    import torch

    from pdserve.kernels.cpu_linear import pack_weight, packed_matmul

    torch.set_num_threads(threads)
    n = 2048
    t = getattr(torch, dtype)
    x, packed = torch.randn(n, n).to(t), pack_weight(torch.randn(n, n).to(t))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        packed_matmul(x, packed, None)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def run_child(python: str, spec: dict, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp, "spec.json")
        path.write_text(json.dumps(spec))
        out = subprocess.run(
            [python, "-c", CHILD, str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
            cwd="/tmp",
        )
    from bench.serve_crosscheck import child_result

    return child_result(out, spec["engine"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--workload", default="mix32")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--top", type=int, default=0, help="also print each engine's N largest ops")
    ap.add_argument("--save", type=pathlib.Path, help="write each engine's ops and times here (JSON)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.offline_throughput import workload
    from pdserve.engine.model_fetch import fetch_default_model

    model = fetch_default_model(progress=False)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    reqs = workload(args.workload, args.num_prompts, vocab)
    base = {
        "model": str(model),
        "reqs": reqs,
        "dtype": args.dtype,
        "threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
    }
    common = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(pathlib.Path.home()),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(args.threads),
    }
    results = {
        "pdserve": run_child(
            sys.executable, {**base, "engine": "pdserve"}, {**common, "PYTHONPATH": str(ROOT)}
        ),
        "vLLM": run_child(
            args.vllm_python,
            {**base, "engine": "vllm"},
            {
                **common,
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            },
        ),
    }
    if args.save:
        args.save.write_text(json.dumps(results))
    table = {name: categorize(r["ops"], r["wall"]) for name, r in results.items()}
    flops = linear_flops(model, reqs)
    peak = matmul_peak(args.dtype, args.threads)
    print(
        f"{args.workload} x {args.num_prompts}, {args.dtype}, {args.threads} threads; profiled pass after a warm-up"
    )
    print("| part | " + " | ".join(f"{n} s (share)" for n in results) + " |")
    print("|---|" + "---|" * len(results))
    for part in table["pdserve"]:
        cells = [f"{table[n][part]:.2f} ({table[n][part] / results[n]['wall']:.0%})" for n in results]
        print(f"| {part} | " + " | ".join(cells) + " |")
    walls = [f"{r['wall']:.2f} ({r['tokens'] / r['wall']:.0f} tok/s)" for r in results.values()]
    print("| **wall, profiled** | " + " | ".join(walls) + " |")
    print(
        "| warm-up pass (unprofiled) | "
        + " | ".join(f"{r['warm_up_s']:.2f}" for r in results.values())
        + " |"
    )
    matmul = [table[n]["linear layers (matmul)"] for n in results]
    print(
        f"\nlinear layers: {flops / 1e9:.0f} GFLOP in the pass; "
        + ", ".join(f"{n} {flops / m / 1e9:.0f} GFLOP/s" for n, m in zip(results, matmul, strict=True))
        + f"; a {PEAK_SHAPE} {args.dtype} matmul through the same oneDNN path here: {peak / 1e9:.0f} GFLOP/s"
    )
    for name, r in results.items():
        if args.top:
            print(f"\n{name}: largest ops by self time")
            for key, s in sorted(r["ops"].items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"  {s:8.3f} s  {key}")


if __name__ == "__main__":
    main()
