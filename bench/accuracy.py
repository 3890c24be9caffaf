"""What bfloat16 and int8 weights cost in accuracy on the default model, against Hugging Face on
the same weights.

    .venv/bin/python bench/accuracy.py [--num-prompts 8] [--max-tokens 32]
    .venv/bin/python bench/accuracy.py --engines bfloat16,int8:bfloat16,int8:float32,float32

Chat prompts from bench/text_workloads.py ("rep": copy the given text, 60-900 tokens) and HF
fp32's greedy continuation of each are run teacher-forced through HF in fp32 (the reference),
HF in bf16, and pdserve's engine in each of ``--engines``: a dtype, or ``int8:DTYPE`` for
``quantization="int8"`` computing in that dtype (default: bf16, as ``--dtype auto`` gives on a
CPU with bf16 arithmetic, and fp32, the control). At every position:

- top-1 agreement on confident positions: where HF fp32 gives its top token at least
  ``--confident`` probability, the share of positions whose top token is the same;
- logprob error: |log p(next token) - HF fp32's|, largest and mean over all positions.

Then greedy generation: prompts whose whole output equals HF fp32 ``generate``'s, and the share of
output tokens before the first divergence.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # text_workloads

import torch  # noqa: E402
import transformers  # noqa: E402
from kv_int8_accuracy import hf_greedy  # noqa: E402  (bench/: the same greedy reference)

import pdserve.engine.llm  # noqa: E402,F401  (first: the engine's OpenMP default)
from pdserve.engine.llm import LLM  # noqa: E402
from pdserve.engine.model_fetch import fetch_default_model  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402


def hf_rows(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(top token, log p(next token)) at each position i >= 1, computed in the model's dtype."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, :-1].float(), dim=-1)
    return logp.argmax(-1), logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--confident", type=float, default=0.5)
    ap.add_argument("--engines", default="bfloat16,float32", help="comma-separated DTYPE or int8:DTYPE")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = fetch_default_model(progress=False)
    from text_workloads import workload

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [ids for ids, _ in workload("rep", args.num_prompts, tokenizer)]
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf32.generation_config.eos_token_id = None
    reference = [hf_greedy(hf32, p, args.max_tokens) for p in prompts]
    teacher = [p + r for p, r in zip(prompts, reference, strict=True)]
    ref = [hf_rows(hf32, t) for t in teacher]
    with torch.no_grad():
        ref_p = [torch.softmax(hf32(torch.tensor([t])).logits[0, :-1], -1).max(-1).values for t in teacher]
    confident = torch.cat(ref_p) >= args.confident
    ref_top, ref_lp = torch.cat([r[0] for r in ref]), torch.cat([r[1] for r in ref])
    del hf32

    rows = {}
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    got = [hf_rows(hf16, t) for t in teacher]
    rows["HF bfloat16"] = (torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got]), None)
    del hf16
    for engine in args.engines.split(","):
        quantization, _, dtype = engine.rpartition(":")
        llm = LLM(str(path), dtype=dtype, num_kv_blocks=4096, quantization=quantization or None)
        forced = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        tops, lps = [], []
        for res in llm.generate(teacher, forced):
            tops.append(torch.tensor([lp.top[0][0] for lp in res.prompt_logprobs]))
            lps.append(torch.tensor([lp.logprob for lp in res.prompt_logprobs]))
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        outs = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]
        name = f"pdserve {quantization} ({dtype})" if quantization else f"pdserve {dtype}"
        rows[name] = (torch.cat(tops), torch.cat(lps), outs)
        del llm

    print(
        f"default model, {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens) "
        f"+ {args.max_tokens} tokens of HF fp32's greedy continuation: {len(ref_lp)} positions, "
        f"{int(confident.sum())} confident (HF fp32 top-1 p >= {args.confident})"
    )
    print(
        "| against HF fp32 | top-1 agreement, confident positions | top-1 agreement, all | largest "
        "logprob error | mean logprob error | greedy outputs equal | tokens before the first divergence |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (top, lp, outs) in rows.items():
        err = (lp - ref_lp).abs()
        agree = (top == ref_top).float()
        if outs is None:
            greedy_cells = "| - | - |"
        else:
            same = sum(o == r for o, r in zip(outs, reference, strict=True))
            prefix = sum(
                next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
                for o, r in zip(outs, reference, strict=True)
            )
            greedy_cells = f"| {same}/{len(prompts)} | {prefix / (len(prompts) * args.max_tokens):.0%} |"
        print(
            f"| {name} | {agree[confident].mean():.2%} | {agree.mean():.2%} | {err.max():.3f} | "
            f"{err.mean():.4f} " + greedy_cells
        )


if __name__ == "__main__":
    main()
