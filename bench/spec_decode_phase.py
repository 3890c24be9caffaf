"""Speculative decoding's effect on the decode phase alone: the engine's steps after the last
prompt chunk, without and with ``--speculative ngram``, on the same prompts, one after the other.

    .venv/bin/python bench/spec_decode_phase.py --threads 1 --num-prompts 8 --workload rep
    .venv/bin/python bench/spec_decode_phase.py --threads 1 --num-prompts 8 --workload rep --draft-layers 6,10

Prints each engine's decode-phase seconds and steps, and for the speculative one its row-cost
fit (W seconds, c seconds a row), its per-token acceptance and its draft counts.
``--draft-layers N,...`` also runs ``--speculative-model`` with draft models cut from the default
model itself: its first N layers, the final norm and the (tied) head, no training (a layer-skip
draft, the only draft with its tokenizer that these machines have).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import pdserve.engine.llm  # noqa: E402,F401 - before torch: the engine's OpenMP default applies

# isort: split
from bench import text_workloads  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.model_fetch import fetch_default_model  # noqa: E402


def decode_phase(model: str, reqs, threads: int, logprobs: int | None = None, **engine_args) -> dict:
    llm = LLM(model, max_num_seqs=64, num_threads=threads, **engine_args)
    llm.generate([[11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=4))
    eng = llm.engine
    for i, (prompt, n) in enumerate(reqs):
        eng.add_request(
            str(i), prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
        )
    sched = eng.scheduler
    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        eng.step()
    start, steps = time.perf_counter(), 0
    while eng.has_work():
        eng.step()
        steps += 1
    result = {"seconds": round(time.perf_counter() - start, 2), "steps": steps}
    if eng.speculator is not None:
        fit = eng.speculator.row_cost.fit()
        result |= {
            "fit_w_s_c_s": fit and [round(x, 4) for x in fit],
            "acceptance": round(eng.speculator.acceptance, 2),
            **eng.speculator.stats.to_dict(),
        }
        if eng.speculator.draft is not None:  # the draft engine's share of the time
            result["draft_seconds"] = round(eng.speculator.draft.stats.seconds, 2)
    return result


def truncated_draft(model: str, num_layers: int, out: pathlib.Path) -> str:
    """``model`` cut to its first ``num_layers`` decoder layers, saved in ``out``."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in pathlib.Path(model).iterdir():
        if name.name not in ("model.safetensors", "config.json"):
            shutil.copy(name, out / name.name)
    config = json.loads((pathlib.Path(model) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
    weights = load_file(pathlib.Path(model) / "model.safetensors")
    kept = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
    }
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--workload", choices=text_workloads.WORKLOADS, default="rep")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument(
        "--logprobs", type=int, default=None, help="each request asks for this many (as bench serve does)"
    )
    ap.add_argument("--draft-layers", default="", help="N,...: also draft with the model's first N layers")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = str(fetch_default_model(progress=False))
    reqs = text_workloads.workload(args.workload, args.num_prompts, AutoTokenizer.from_pretrained(model))
    plain = decode_phase(model, reqs, args.threads, args.logprobs)
    print("without speculation:", plain, flush=True)
    spec = decode_phase(
        model,
        reqs,
        args.threads,
        args.logprobs,
        speculative="ngram",
        num_speculative_tokens=args.num_speculative_tokens,
    )
    print("with --speculative ngram:", spec, flush=True)
    print(f"decode phase: {plain['seconds'] / spec['seconds']:.2f}x")
    for layers in [int(n) for n in args.draft_layers.split(",") if n]:
        with tempfile.TemporaryDirectory() as tmp:
            draft = truncated_draft(model, layers, pathlib.Path(tmp))
            spec = decode_phase(
                model,
                reqs,
                args.threads,
                args.logprobs,
                speculative_model=draft,
                num_speculative_tokens=args.num_speculative_tokens,
            )
        print(f"with a {layers}-layer draft model:", spec, flush=True)
        print(f"decode phase: {plain['seconds'] / spec['seconds']:.2f}x")


if __name__ == "__main__":
    main()
