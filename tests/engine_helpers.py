"""Shared helpers for engine tests: HF oracles and teacher-forced logits through the paged path."""

from __future__ import annotations

import functools

import torch
import transformers

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.executor.model_runner import ModelRunner
from pdserve.engine.executor.platform import resolve_platform
from pdserve.protocol.kv_layout import KVCacheSpec
from pdserve.protocol.sampling_params import SamplingParams


@functools.cache
def hf_model(path: str, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    # Soft-capped attention (Gemma 2) exists only in HF's eager path.
    config = transformers.AutoConfig.from_pretrained(path)
    eager = getattr(config, "attn_logit_softcapping", None) is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager" if eager else None
    ).eval()
    model.generation_config.eos_token_id = None  # fixed-length runs: like ignore_eos, EOS may be emitted
    return model


def greedy_with_logprobs(model, prompt, max_tokens: int) -> tuple[list[int], list[float]]:
    """``model``'s greedy tokens after ``prompt``, EOS ignored, and each one's logprob: one full
    forward per token (no KV cache: the plainest reading of the model)."""
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            row = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            tokens.append(int(row.argmax()))
            logprobs.append(float(row[tokens[-1]]))
    return tokens[len(prompt) :], logprobs


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face generate, greedy, EOS ignored (fixed length)."""
    model = hf_model(str(path))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    assert out.shape[1] == len(prompt) + max_new_tokens
    return out[0, len(prompt) :].tolist()


@functools.cache
def hf_eos_model(path: str) -> transformers.PreTrainedModel:
    """The HF model as saved (its generation config's EOS kept), for beam search."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_beams(path, prompt: list[int], params: SamplingParams, eos: int | list[int] | None) -> list[list[int]]:
    """Hugging Face's ``generate(num_beams=n)``: the n best beams' output tokens (through the EOS
    that ended one), best first."""
    assert params.beam_search is not None
    with torch.no_grad():
        out = hf_eos_model(str(path)).generate(
            torch.tensor([prompt]),
            num_beams=params.n,
            num_return_sequences=params.n,
            max_new_tokens=params.max_tokens,
            length_penalty=params.beam_search.length_penalty,
            early_stopping=params.beam_search.early_stopping,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    stops = set([eos] if isinstance(eos, int) else eos or [])
    results = []
    for row in out[:, len(prompt) :].tolist():
        ends = [i for i, t in enumerate(row) if t in stops]
        results.append(row[: ends[0] + 1] if ends else row)
    return results


def hf_logits(path: str, tokens: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(str(path), dtype)(torch.tensor([tokens])).logits[0].float()  # [T, vocab]


def paged_logits(
    path: str, tokens: list[int], chunks: list[int], block_size: int = 4, dtype: str = "float32"
) -> torch.Tensor:
    """Logits at every position, computing ``tokens`` in consecutive chunks through the paged cache."""
    assert sum(chunks) == len(tokens)
    cfg = ModelConfig.from_path(path)
    num_blocks = 2 * (len(tokens) // block_size + 2)
    spec = KVCacheSpec(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    # resolve_platform: PDSERVE_TEST_PLATFORM=split runs it on the split-and-poison platform
    config = EngineConfig(model=str(path), dtype=dtype, block_size=block_size)
    runner = ModelRunner(cfg, config, spec, platform=resolve_platform("cpu"))
    bm = BlockManager(num_blocks, block_size)
    bm.free_block_ids.move_to_end(0)  # a non-identity layout: block ids out of order
    seq = Sequence("teacher", list(tokens), len(tokens), SamplingParams())
    rows = []
    for n in chunks:
        bm.append(seq, n)
        inp = runner.prepare(SchedulerOutput([ScheduledSeq(seq, n)], [], []))
        with torch.inference_mode():
            hidden = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
            rows.append(runner.model.compute_logits(hidden))
        seq.num_computed_tokens += n
    return torch.cat(rows).float()


def grant_remote(engine, request_id: str, prompt: list[int], params: SamplingParams):
    """A decode engine's side of a reservation: queue it, and step until the scheduler grants its
    blocks (what a decode node's loop does). Returns the grant and the steps' outputs."""
    engine.kv_connector.reserve(request_id, prompt, params)
    outputs = []
    for _ in range(64):
        step = engine.step()
        outputs += step.outputs
        if step.kv.granted:
            (grant,) = step.kv.granted
            assert grant.request_id == request_id
            return grant, outputs
    raise AssertionError(f"{request_id} was never granted blocks")
