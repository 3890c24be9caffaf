"""pdserve's one-process LLM core: models, paged KV cache, block manager, scheduler, sampler."""

from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
