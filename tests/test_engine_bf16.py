"""bfloat16 on the CPU, against the fp32 oracle: no worse than Hugging Face's own bfloat16.

bf16 cannot equal fp32 HF bit for bit, so the bound is what HF itself loses in bf16: the same
weights through HF in bf16 set how far from the fp32 logits a bf16 engine may land.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.engine_helpers import hf_logits, paged_logits
from tests.tiny_models import CONFIGS, make_tiny_model


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_bf16_chunked_logits_are_as_close_to_fp32_hf_as_hf_bf16(kind):
    # chunks mid-block, then single-token decodes (the register-held decode kernel in bf16)
    path = str(make_tiny_model(kind))
    tokens = _prompt(2, 40)
    truth = hf_logits(path, tokens)
    hf_error = (hf_logits(path, tokens, torch.bfloat16) - truth).abs().max().item()
    ours = paged_logits(path, tokens, chunks=[7, 13, 1, 15, 1, 1, 1, 1], dtype="bfloat16")
    assert (ours - truth).abs().max().item() <= 1.5 * hf_error


def test_bf16_engine_batch_tracks_fp32_hf_logprobs():
    # A concurrent batch of mixed lengths, so decode steps run many rows at once (whole-sequence
    # kernel items). Each chosen token must be near-greedy under fp32 HF, teacher-forced on the
    # sequence the engine produced, and each reported logprob close to HF's for that token.
    path = str(make_tiny_model("llama"))
    prompts = [_prompt(20 + i, n) for i, n in enumerate((1, 5, 17, 33, 48, 9, 64, 2))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = LLM(path, dtype="bfloat16", num_kv_blocks=128, block_size=8).generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        produced = out.outputs[0].token_ids
        assert len(produced) == 12
        logprobs = torch.log_softmax(hf_logits(path, prompt + produced)[len(prompt) - 1 : -1], dim=-1)
        for step, (token, reported) in enumerate(zip(produced, out.outputs[0].logprobs, strict=True)):
            assert reported.token_id == token
            assert logprobs[step].max().item() - logprobs[step, token].item() < 0.1, (prompt, step)
            assert abs(reported.logprob - logprobs[step, token].item()) < 0.1, (prompt, step)
