"""Model registry keyed by config.json's ``architectures``."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.gemma import GemmaForCausalLM
from pdserve.engine.models.gemma2 import Gemma2ForCausalLM
from pdserve.engine.models.gpt2 import GPT2LMHeadModel
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.mixtral import MixtralForCausalLM
from pdserve.engine.models.olmo2 import Olmo2ForCausalLM
from pdserve.engine.models.phi3 import Phi3ForCausalLM
from pdserve.engine.models.qwen2_moe import Qwen2MoeForCausalLM
from pdserve.engine.models.qwen3 import Qwen3ForCausalLM
from pdserve.engine.models.stablelm import StableLmForCausalLM

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
