"""The default model (SmolLM2-135M-Instruct, converted from its GGUF) against Hugging Face."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.engine_helpers import hf_logits, hf_model, paged_logits


@pytest.fixture(scope="module")
def chat_prompt(default_model_dir) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_default_model_teacher_forced_logits_match_hf(default_model_dir, chat_prompt):
    path = str(default_model_dir)
    ours = paged_logits(path, chat_prompt, chunks=[20, len(chat_prompt) - 20], block_size=16)
    hf32 = hf_logits(path, chat_prompt)
    with torch.no_grad():
        exact = hf_model(path).double()(torch.tensor([chat_prompt])).logits[0]  # fp64: the truth
    # Within fp32 rounding: no further from the fp64 logits than three times HF's own fp32 run is.
    # HF's error is itself one draw of summation order: 9e-5 on logits up to ~38 on the CPU this
    # was written on, 6e-5 on another (where ours is 1.5e-4 through the packed oneDNN matmuls,
    # 1.0e-4 through F.linear: 30 layers of matmuls summed in another order differ so).
    hf_error = (hf32.double() - exact).abs().max().item()
    assert (ours.double() - exact).abs().max().item() < 3 * hf_error + 2e-5
    assert (ours - hf32).abs().max().item() < 3e-4


def test_default_model_chat_greedy_matches_hf_and_stops_at_eos(default_model_dir, chat_prompt):
    path = str(default_model_dir)
    llm = LLM(path, kv_cache_memory_mb=64)
    out = llm.generate([chat_prompt], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    model = hf_model(path)
    with torch.no_grad():
        ref = model.generate(torch.tensor([chat_prompt]), max_new_tokens=32, do_sample=False, eos_token_id=2)[
            0, len(chat_prompt) :
        ].tolist()
    assert out.token_ids == ref
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert "Paris" in out.text


def test_default_model_stop_string_cuts_text_and_ends_early(default_model_dir, chat_prompt):
    llm = LLM(str(default_model_dir), kv_cache_memory_mb=64)
    out = llm.generate([chat_prompt], SamplingParams(temperature=0.0, max_tokens=32, stop=[" is"]))[
        0
    ].outputs[0]
    assert out.text == "The capital of France"
    assert out.finish_reason == "stop" and out.stop_reason == " is"


def test_default_model_stop_string_waits_for_min_tokens_and_cuts_at_the_earliest(
    default_model_dir, chat_prompt
):
    llm = LLM(str(default_model_dir), kv_cache_memory_mb=64)
    early, late = llm.generate(
        [chat_prompt, chat_prompt],
        [
            SamplingParams(temperature=0.0, max_tokens=32, stop=[" of", "capital"]),
            SamplingParams(temperature=0.0, max_tokens=32, stop=["capital"], min_tokens=4),
        ],
    )
    assert early.outputs[0].text == "The " and early.outputs[0].stop_reason == "capital"
    assert len(early.outputs[0].token_ids) == 2  # "The", " capital": matched at the token that completes it
    # Seen at token 2, honoured once min_tokens (4) were generated; the text is still cut at it.
    assert late.outputs[0].text == "The " and len(late.outputs[0].token_ids) == 4
