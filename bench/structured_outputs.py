"""Guided decoding's cost: output tokens/s of a constrained batch against an unconstrained one, and
of the unconstrained rows of a mixed batch, side by side in one process on one engine.

Every batch has the same size and fixed-length outputs (ignore_eos for plain rows; constraints
that cannot end before max_tokens for guided rows), so each step computes the same number of
rows and the ratios are the grammar's cost alone. Runs are interleaved round-robin, and each
figure is the median over --repeats. Also times the sampler alone on a batch of plain rows (the
code path every unconstrained batch takes) against a bare argmax.

    python bench/structured_outputs.py --model tiny
    python bench/structured_outputs.py --model default --num-seqs 16 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.offline_throughput import tiny_bench_model  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.core.sequence import Sequence  # noqa: E402
from pdserve.engine.model_fetch import fetch_default_model  # noqa: E402
from pdserve.engine.sampling.sampler import Sampler, SamplerInput  # noqa: E402
from pdserve.protocol.sampling_params import GuidedDecoding  # noqa: E402

# Neither can end within any max_tokens used here: each guided row runs as long as a plain one.
ROWS = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "pet": {"enum": ["cat", "dog", "fish"]},
                },
                "required": ["name", "age", "pet"],
                "additionalProperties": False,
            },
            "minItems": 500,
        }
    },
    "required": ["rows"],
    "additionalProperties": False,
}
GUIDED = {
    "json": GuidedDecoding.json_schema(ROWS),
    "regex": GuidedDecoding.regex(r"([a-z]{1,8}[0-9]{0,3} ){500,}"),
}


def model_dir(name: str) -> pathlib.Path:
    if name == "default":
        return fetch_default_model(progress=False)
    # the tiny bench model with the default model's tokenizer: guided decoding needs a vocabulary
    source = tiny_bench_model()
    path = source.with_name(source.name + "-tokenizer")
    if not (path / "tokenizer.json").is_file():
        shutil.copytree(source, path, dirs_exist_ok=True)
        shutil.copy(fetch_default_model(progress=False) / "tokenizer.json", path / "tokenizer.json")
    return path


def batches(num_seqs: int, max_tokens: int) -> dict[str, list[SamplingParams]]:
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def guided(spec: GuidedDecoding) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, guided_decoding=spec)

    half = num_seqs // 2
    return {
        "plain": [plain] * num_seqs,
        "json": [guided(GUIDED["json"])] * num_seqs,
        "regex": [guided(GUIDED["regex"])] * num_seqs,
        "mixed (half json)": [plain] * half + [guided(GUIDED["json"])] * (num_seqs - half),
    }


class SamplerClock:
    """Wraps the engine's Sampler.sample (rules and masks included) to time it per step."""

    def __init__(self, sampler: Sampler) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._sample = sampler.sample
        sampler.sample = self

    def __call__(self, logits, inputs):
        start = time.perf_counter()
        try:
            return self._sample(logits, inputs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run(llm: LLM, clock: SamplerClock, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """One batch: all rows' and plain rows' output tok/s, sampler ms per step and share of the wall."""
    seconds, calls = clock.seconds, clock.calls
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    counts = [len(o.outputs[0].token_ids) for o in outs]
    assert all(c == params[0].max_tokens for c in counts), f"an output ended early: {counts}"
    plain = sum(c for c, p in zip(counts, params, strict=True) if p.guided_decoding is None)
    sampler_s = clock.seconds - seconds
    return {
        "tok_s": sum(counts) / wall,
        "plain_tok_s": plain / wall,
        "sampler_ms_per_step": sampler_s / (clock.calls - calls) * 1e3,
        "sampler_share": sampler_s / wall,
    }


def sampler_overhead(vocab: int, num_seqs: int, repeats: int = 200) -> tuple[float, float]:
    """(µs per Sampler.sample on plain greedy rows, µs per bare argmax) on [num_seqs, vocab]."""
    logits = torch.randn(num_seqs, vocab)
    params = SamplingParams(temperature=0.0)
    inputs = [SamplerInput(Sequence(f"r{i}", [1, 2], 1, params), ()) for i in range(num_seqs)]
    sampler = Sampler()

    def timed(fn) -> float:
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            samples.append((time.perf_counter() - start) / repeats * 1e6)
        return statistics.median(samples)

    return timed(lambda: sampler.sample(logits, inputs)), timed(lambda: logits.max(dim=-1).indices.tolist())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(str(model_dir(args.model)), kv_cache_memory_mb=512)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_seqs)
    ]
    configs = batches(args.num_seqs, args.max_tokens)
    clock = SamplerClock(llm.engine.sampler)
    run(llm, clock, prompts, configs["json"])  # warm-up: compiles the grammars (cached from here on)
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, params in configs.items():
            results[name].append(run(llm, clock, prompts, params))
    print(f"model {args.model}, {args.num_seqs} seqs x {args.max_tokens} tokens, {args.threads} threads")
    print(
        f"{'batch':<20}{'tok/s':>9}{'vs plain':>10}{'plain rows tok/s/row':>22}{'sampler ms/step':>17}{'share':>7}"
    )
    table = {}
    for name, rows in results.items():
        row = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        num_plain = sum(p.guided_decoding is None for p in configs[name])
        plain_tok_s = row.pop("plain_tok_s")
        row["plain_row_tok_s"] = plain_tok_s / num_plain if num_plain else None
        table[name] = row
    base = table["plain"]["tok_s"]
    for name, row in table.items():
        row["ratio"] = row["tok_s"] / base
        per_row = f"{row['plain_row_tok_s']:>22.2f}" if row["plain_row_tok_s"] is not None else f"{'-':>22}"
        print(
            f"{name:<20}{row['tok_s']:>9.1f}{row['ratio']:>10.3f}{per_row}"
            f"{row['sampler_ms_per_step']:>17.2f}{row['sampler_share']:>7.1%}"
        )
    sampled, argmax = sampler_overhead(vocab, args.num_seqs)
    print(
        f"sampler on {args.num_seqs} plain greedy rows: {sampled:.1f} us per step, bare argmax {argmax:.1f} us"
    )
    table["sampler_us"] = {"plain_rows": sampled, "bare_argmax": argmax}
    print(json.dumps(table))


if __name__ == "__main__":
    main()
