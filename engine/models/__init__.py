"""Model registry keyed by config.json's ``architectures``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.models.decoder import CausalLM, single_rank_only
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
from pdserve.protocol.kv_layout import query_heads_of

# What the engine runs: a step's tokens to hidden states (forward), rows of them to logits
# (compute_logits); GPT-2 has its own skeleton, every other family decoder.CausalLM's.
Model = CausalLM | GPT2LMHeadModel

# each family's class, built from its config, the positions its rotary table must cover and the
# tensor-parallel rank it is built for
ModelClass = Callable[[ModelConfig, int, ParallelState], Model]

MODEL_REGISTRY: dict[str, ModelClass] = {
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


def model_class(cfg: ModelConfig) -> ModelClass:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"model architecture {cfg.architecture!r} is not supported; supported: {supported}"
        ) from None


# families whose layers do not split over tensor-parallel ranks, and why
SINGLE_RANK = {
    "Qwen2MoeForCausalLM": "its experts are not sharded",
    "MixtralForCausalLM": "its experts are not sharded",
}


def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError, naming the flag, where ``cfg`` cannot be split over ``tp_size`` ranks: before any
    worker starts or any weight loads (the layers check their own shapes again as they are built)."""
    if cfg.architecture in SINGLE_RANK:
        single_rank_only(cfg, tp_size, SINGLE_RANK[cfg.architecture])
    for rank in range(tp_size):
        query_heads_of(cfg.num_heads, cfg.num_kv_heads, tp_size, rank)


def build_model(
    cfg: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelState = SINGLE,
) -> Model:
    """The model of ``cfg`` with its parameters made on ``device`` in ``dtype`` (not yet loaded):
    where they compute, in the dtype they compute in. Built in fp32 and then cast, a bf16 model
    held about 3x its weights for a moment. On ``meta`` nothing is allocated (sizes only). The
    rotary tables stay fp32 whatever the dtype (engine/layers/rotary.py). ``parallel``: the rank's
    share of every split layer (engine/layers/linear.py)."""
    with torch.device(device), _default_dtype(dtype):
        return model_class(cfg)(cfg, max_positions, parallel).eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
