"""The oracle: our paged models against Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.engine_helpers import hf_greedy, hf_logits, paged_logits
from tests.tiny_models import CONFIGS, make_tiny_model

KINDS = sorted(CONFIGS)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_forced_logits_match_hf_at_every_position(kind):
    path = str(make_tiny_model(kind))
    tokens = _prompt(1, 45)
    ours = paged_logits(path, tokens, chunks=[45])
    ref = hf_logits(path, tokens)
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_teacher_forcing_matches_hf(kind):
    # chunks that start and end mid-block, then single-token decodes over the paged prefix
    path = str(make_tiny_model(kind))
    tokens = _prompt(2, 40)
    ours = paged_logits(path, tokens, chunks=[7, 13, 1, 15, 1, 1, 1, 1], block_size=4)
    assert (ours - hf_logits(path, tokens)).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_matches_hf(kind):
    path = str(make_tiny_model(kind))
    prompts = [_prompt(10 + i, n) for i, n in enumerate((1, 9, 33))]
    outs = LLM(path, num_kv_blocks=64, block_size=8).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 24)
        assert out.outputs[0].finish_reason == "length"


def test_sliding_window_changes_logits_past_the_window(tmp_path):
    # The tiny mistral has a 24-token window; the same weights without it must differ after it,
    # so the HF match above really covers the window.
    import json
    import shutil

    path = make_tiny_model("mistral")
    unwindowed = tmp_path / "no-window"
    shutil.copytree(path, unwindowed)
    cfg = json.loads((unwindowed / "config.json").read_text())
    cfg["sliding_window"] = None
    (unwindowed / "config.json").write_text(json.dumps(cfg))
    tokens = _prompt(3, 45)
    windowed = paged_logits(str(path), tokens, chunks=[20, 25])
    full = paged_logits(str(unwindowed), tokens, chunks=[45])
    assert torch.allclose(windowed[:24], full[:24], atol=1e-5)
    assert (windowed[30:] - full[30:]).abs().max().item() > 1e-3


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import json
    import shutil

    src = make_tiny_model("llama")
    dst = tmp_path / "bloomish"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["BloomForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    supported = (
        "GPT2LMHeadModel, Gemma2ForCausalLM, GemmaForCausalLM, LlamaForCausalLM, MistralForCausalLM, "
        "MixtralForCausalLM, Olmo2ForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, StableLmForCausalLM"
    )
    with pytest.raises(ValueError, match=f"'BloomForCausalLM' is not supported; supported: {supported}$"):
        LLM(str(dst))
