"""Model registry keyed by config.json's ``architectures``."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 2/3, SmolLM2
    "MistralForCausalLM": LlamaForCausalLM,  # + sliding window
    "Qwen2ForCausalLM": LlamaForCausalLM,  # + qkv bias
}


def model_class(cfg: ModelConfig) -> type:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"model architecture {cfg.architecture!r} is not supported; supported: {supported}") from None
