"""What LoRA adapters cost a step, and what reading one costs, on this machine.

    python -m bench.lora_steps [--threads 2] [--rounds 3] [--steps 16]

The default model (SmolLM2-135M-Instruct, float32) with eight seeded PEFT adapters of rank 16 on
all seven projections (q, k, v, o, gate, up, down), made with PEFT's own LoraConfig. For each
batch of B running sequences (1, 8, 32) and A distinct adapters among them (1, 4, 8; at most B),
one engine with ``--max-loras 8`` times decode steps of the B sequences (32-token prompts, every
row an adapter's, the adapters round robin) and, in the same round, the same batch on the base
model: the ratio is what the adapters add to a decode step. Rounds alternate the two.
Then the load: ``load_adapter`` (the folder read and checked, the weights copied into a slot) of
a fresh adapter, and the first step that uses one against a step that does not.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_fetch import default_model_dir
from pdserve.protocol.sampling_params import SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: str, root: pathlib.Path, count: int, rank: int = 16) -> dict[str, str]:
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = {}
    for i in range(count):
        torch.manual_seed(100 + i)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        model = peft.get_peft_model(base, config)
        path = root / f"adapter-{i}"
        model.save_pretrained(path)
        base = model.unload()  # the base weights back, without this adapter
        paths[f"adapter-{i}"] = str(path)
    return paths


def decode_step_s(engine: LLMEngine, batch: int, adapters: list[str | None], steps: int, tag: str) -> float:
    """Median decode-step seconds of ``batch`` running sequences, adapters round robin."""
    for i in range(batch):
        params = SamplingParams(
            temperature=0, max_tokens=steps + 8, ignore_eos=True, adapter=adapters[i % len(adapters)]
        )
        engine.add_request(f"{tag}-{i}", [100 + (i * 7 + j) % 4000 for j in range(32)], params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prompts
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(batch):
        engine.abort_request(f"{tag}-{i}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    model = str(default_model_dir())
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model, pathlib.Path(tmp), 9)
        fresh = paths.pop("adapter-8")
        config = EngineConfig(
            model=model,
            num_threads=args.threads,
            num_kv_blocks=2048,
            enable_lora=True,
            max_loras=8,
            max_lora_rank=16,
            lora_modules=tuple(paths.items()),
        )
        engine = LLMEngine(config)
        names = list(paths)
        print("| batch | adapters | base step (ms) | LoRA step (ms) | ratio |")
        print("|---|---|---|---|---|")
        for batch in (1, 8, 32):
            for num in (1, 4, 8):
                if num > batch:
                    continue
                base, lora = [], []
                for r in range(args.rounds):
                    base.append(decode_step_s(engine, batch, [None], args.steps, f"b{batch}-{num}-{r}"))
                    lora.append(decode_step_s(engine, batch, names[:num], args.steps, f"l{batch}-{num}-{r}"))
                b, lo = statistics.median(base), statistics.median(lora)
                print(f"| {batch} | {num} | {b * 1e3:.1f} | {lo * 1e3:.1f} | {lo / b:.2f}x |")
        loads, fills, warm = [], [], []
        prompt = list(range(100, 132))
        for r in range(args.rounds):
            start = time.perf_counter()
            engine.load_adapter(f"fresh-{r}", fresh)  # read and checked; every slot is taken
            loads.append(time.perf_counter() - start)
            for tag, into in ((f"cold-{r}", fills), (f"warm-{r}", warm)):  # cold: evicts one, fills it
                params = SamplingParams(temperature=0, max_tokens=1, adapter=f"fresh-{r}")
                start = time.perf_counter()
                engine.add_request(tag, prompt, params)
                into.append(time.perf_counter() - start)
                while engine.has_work():
                    engine.step()
        print(
            f"\nload_adapter (folder read and checked; every slot taken), median of {args.rounds}: "
            f"{statistics.median(loads) * 1e3:.1f} ms; admitting a request whose adapter is read into "
            f"a slot (an LRU eviction): {statistics.median(fills) * 1e3:.1f} ms, against "
            f"{statistics.median(warm) * 1e3:.2f} ms once it holds one"
        )


if __name__ == "__main__":
    main()
