"""Offline batch generation, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Sequence as Seq

from pdserve.engine.cpu_env import apply_openmp_defaults

apply_openmp_defaults()  # offline use's entry point: before the engine below loads torch

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.outputs import RequestOutput  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402

Prompt = str | list[int]


def load_tokenizer(model_dir: str):
    """The model folder's tokenizer, or None when it ships none (bare test checkpoints)."""
    if (
        not (pathlib.Path(model_dir) / "tokenizer_config.json").is_file()
        and not (pathlib.Path(model_dir) / "tokenizer.json").is_file()
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class LLM:
    def __init__(self, model: str, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_options), load_tokenizer(str(model)))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        token_lists = [self._encode(p) for p in prompts]
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        finished: dict[str, RequestOutput] = {}
        try:
            for request_id, tokens, p in zip(ids, token_lists, params, strict=True):
                self.engine.add_request(request_id, tokens, p)  # all or nothing: a refusal aborts the rest
            while len(finished) < len(ids):
                for out in self.engine.step().outputs:
                    if out.finished:
                        finished[out.request_id] = out
        finally:
            for request_id in ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
        return [finished[i] for i in ids]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            tokenizer = self.get_tokenizer()
            if tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer in the model folder; pass token ids")
            return tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    for p in prompts:
        if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise ValueError("prompt: each prompt must be a string or a list of token ids")
    return prompts
