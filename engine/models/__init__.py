"""Model registry keyed by config.json's ``architectures``."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.gemma import GemmaForCausalLM
from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.olmo2 import Olmo2ForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.stablelm import StableLmForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 2/3, SmolLM2
    "MistralForCausalLM": LlamaForCausalLM,  # + sliding window
    "Qwen2ForCausalLM": LlamaForCausalLM,  # + qkv bias
    "Qwen3ForCausalLM": Qwen3ForCausalLM,  # + q/k RMSNorm
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "StableLmForCausalLM": StableLmForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class(cfg: ModelConfig) -> type:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"model architecture {cfg.architecture!r} is not supported; supported: {supported}"
        ) from None
