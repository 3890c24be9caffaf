"""What the int8 KV cache costs in accuracy, against Hugging Face fp32 on the same weights.

    .venv/bin/python bench/kv_int8_accuracy.py [--models default,llama,qwen3,...] [--max-tokens 32]

For each model, a fixed set of prompts of mixed lengths (the default model: chat prompts from
bench/text_workloads.py, 60-900 tokens; the tiny family configs of tests/: seeded random ids,
8-200 tokens) runs through pdserve's engine twice, with ``--kv-cache-dtype auto`` (fp32, the
control) and ``int8``, all prompts at once, greedy, fixed length:

- greedy agreement: prompts whose whole output equals HF ``generate``'s, and the share of output
  tokens before the first divergence;
- logprob error: every prompt and HF's greedy continuation go through the engine teacher-forced
  (``prompt_logprobs``); the largest |logprob - HF's| of the token at each position, over all
  positions of all prompts (the cache holds every earlier token, so each row reads int8 K/V),
  and the mean over those positions.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models
sys.path.insert(0, str(ROOT / "bench"))  # text_workloads

import torch  # noqa: E402
import transformers  # noqa: E402

import pdserve.engine.llm  # noqa: E402,F401  (first: the engine's OpenMP default)
from pdserve.engine.llm import LLM  # noqa: E402
from pdserve.engine.model_fetch import default_model_dir  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402

TINY_KINDS = [
    "llama",
    "smollm2",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "phi3",
    "gpt2",
    "olmo2",
    "mixtral",
]


def prompts_for(model: str, path: pathlib.Path) -> list[list[int]]:
    if model == "default":
        from text_workloads import workload

        return [ids for ids, _ in workload("rep", 8, transformers.AutoTokenizer.from_pretrained(path))]
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (8, 17, 40, 64, 100, 150, 200)]


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def hf_token_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1, fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)


def measure(model_name: str, path: pathlib.Path, max_tokens: int) -> list[str]:
    prompts = prompts_for(model_name, path)
    config = transformers.AutoConfig.from_pretrained(path)
    eager = getattr(config, "attn_logit_softcapping", None) is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager" if eager else None
    ).eval()
    hf.generation_config.eos_token_id = None
    reference = [hf_greedy(hf, p, max_tokens) for p in prompts]
    hf_logprobs = [hf_token_logprobs(hf, p + r) for p, r in zip(prompts, reference, strict=True)]
    rows = []
    for kv in ("auto", "int8"):
        llm = LLM(str(path), kv_cache_dtype=kv, num_kv_blocks=2048, dtype="float32")
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]
        same = sum(o == r for o, r in zip(outs, reference, strict=True))
        prefix = 0
        for o, r in zip(outs, reference, strict=True):
            prefix += next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
        forced = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        teacher = [p + r for p, r in zip(prompts, reference, strict=True)]
        errors = []
        for res, ref in zip(llm.generate(teacher, forced), hf_logprobs, strict=True):
            errors.append((torch.tensor([lp.logprob for lp in res.prompt_logprobs]) - ref).abs())
        errors = torch.cat(errors)
        name = "fp32 (control)" if kv == "auto" else "int8"
        total = len(prompts) * max_tokens
        rows.append(
            f"| {model_name} | {name} | {same}/{len(prompts)} | {prefix / total:.0%} | "
            f"{errors.max().item():.2e} | {errors.mean().item():.1e} |"
        )
        print(rows[-1], flush=True)
        del llm
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(["default", *TINY_KINDS]))
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(
        "| model | KV cache | whole outputs equal to HF | tokens before the first divergence "
        "| largest logprob error | mean logprob error |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        if name == "default":
            path = default_model_dir()
        else:
            from tiny_models import make_tiny_model

            path = make_tiny_model(name)
        measure(name, path, args.max_tokens)


if __name__ == "__main__":
    main()
