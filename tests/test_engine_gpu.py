"""The engine on a CUDA device against Hugging Face on the same device and weights (GPU only).

The CUDA twin of tests/test_engine_hf_exact.py and tests/test_engine_bf16.py: fp32 greedy output
equal to HF's token for token (TF32 off on both sides), bf16 top-1 in step with fp32 HF where the
model is sure, CUDA graphs giving the eager tokens, and a full batch at the profiled pool size.
bench/gpu_oneshot.sh runs this module on a lent GPU; it imports nothing that machine lacks
(torch, transformers, the engine, tests/tiny_models.py), and is skipped without CUDA.
"""

from __future__ import annotations

import functools
import gc
import pathlib

import pytest
import torch
import transformers

from pdserve.engine import LLM
from pdserve.protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY_KINDS = ["llama", "mistral", "qwen3", "gemma2"]  # plain, sliding window, q/k norms, soft caps
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SMALL_POOL = dict(num_kv_blocks=64, block_size=8, max_num_seqs=8)  # tests do not profile the pool
CONFIDENT_MARGIN = 0.5  # HF fp32 top-1 minus top-2 logit above which bf16 must pick the same token
LM_HEAD_SCALE = 4.0  # sharpens the random model's logits: about half its positions pass the margin


@pytest.fixture(autouse=True)
def _no_tf32():
    # fp32 matmuls in full precision on both sides: TF32 alone moves logits past 1e-3
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


@functools.cache
def _hf_on_cuda(path: str) -> transformers.PreTrainedModel:
    """HF in fp32 on the GPU; soft-capped attention (Gemma 2) exists only in HF's eager path."""
    config = transformers.AutoConfig.from_pretrained(path)
    eager = getattr(config, "attn_logit_softcapping", None) is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager" if eager else None
    )
    model = model.to("cuda").eval()
    model.generation_config.eos_token_id = None  # fixed-length runs, like ignore_eos
    return model


def _hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = _hf_on_cuda(path).generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _hf_logits(path: str, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_on_cuda(path)(torch.tensor([tokens], device="cuda")).logits[0].float().cpu()  # [T, vocab]


def _free_device_memory() -> None:
    gc.collect()  # engines of earlier tests, so that a profiled pool sees the device free
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", GREEDY_KINDS)
def test_fp32_greedy_generate_equals_hf_on_cuda(kind):
    path = str(make_tiny_model(kind))
    prompts = [_prompt(10 + i, n) for i, n in enumerate((1, 9, 33))]
    outs = LLM(path, device="cuda", dtype="float32", **SMALL_POOL).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(path, prompt, 24), prompt
        assert out.outputs[0].finish_reason == "length"


def _sharpened(kind: str, folder: pathlib.Path) -> str:
    """The tiny model of ``kind`` with its lm_head scaled by LM_HEAD_SCALE (untied heads only)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(make_tiny_model(kind), dtype=torch.float32)
    assert not model.config.tie_word_embeddings  # scaling a tied head would scale the inputs too
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bf16_teacher_forced_top1_agrees_with_fp32_hf_where_it_is_confident(kind, tmp_path):
    # Teacher-forced through prompt_logprobs: the engine's top-1 at every prompt position, in
    # bf16, against HF fp32's argmax there. bf16 cannot match where the top two are near-tied,
    # so only positions with a clear margin count; there must be enough of them to mean something.
    path = _sharpened(kind, tmp_path / "sharp")
    prompts = [_prompt(30 + i, 200) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=128, block_size=16).generate(
        prompts, params
    )
    agree = confident = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _hf_logits(path, prompt)[:-1]  # [T - 1, vocab]: row j predicts prompt[j + 1]
        top2 = ref.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > CONFIDENT_MARGIN
        ours = torch.tensor([entry.top[0][0] for entry in out.prompt_logprobs])
        assert ours.shape == sure.shape
        confident += int(sure.sum())
        agree += int((ours[sure] == ref.argmax(dim=-1)[sure]).sum())
    assert confident >= 200, confident
    assert agree >= 0.99 * confident, (agree, confident)


def test_cuda_graphs_give_the_eager_tokens_on_a_mixed_batch():
    # Mixed prompt lengths and output lengths, so decode batches shrink through every size from
    # 7 to 1 and graphs replay padded batches; fp32 so that the comparison is about graphs alone.
    path = str(make_tiny_model("llama"))
    prompts = [_prompt(50 + i, n) for i, n in enumerate((1, 5, 17, 33, 48, 9, 64))]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(7)]
    runs = {}
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="float32", enforce_eager=eager, **SMALL_POOL)
        runs[eager] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        del llm
        _free_device_memory()
    assert [len(tokens) for tokens in runs[False]] == [p.max_tokens for p in params]
    assert runs[False] == runs[True]


def _wide_vocab_llama(folder: pathlib.Path) -> str:
    """A small Llama with a real vocabulary (32000) and context (2048): logits and KV that weigh."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def test_full_budget_batch_completes_in_the_profiled_pool(tmp_path):
    # max_num_seqs prompts that each fill max_model_len with their outputs: the most the pool is
    # sized for. It must run to the end without running out of memory, and the engine must keep
    # within its share of the device.
    path = _wide_vocab_llama(tmp_path / "wide")
    _free_device_memory()
    torch.cuda.reset_peak_memory_stats()
    utilization, max_num_seqs, max_model_len, max_tokens = 0.5, 64, 2048, 4
    llm = LLM(
        path,
        device="cuda",
        dtype="bfloat16",
        gpu_memory_utilization=utilization,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    prompts = [_prompt(100 + i, max_model_len - max_tokens, vocab=32000) for i in range(max_num_seqs)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    assert [len(out.outputs[0].token_ids) for out in outs] == [max_tokens] * max_num_seqs
    assert all(out.outputs[0].finish_reason == "length" for out in outs)
    total = torch.cuda.get_device_properties(0).total_memory
    assert torch.cuda.max_memory_allocated() <= utilization * total
