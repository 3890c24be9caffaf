"""What a PEFT LoRA adapter's adapter_config.json may say for pdserve to serve it: plain LoRA
(``y = x W^T + scale * (x A^T) B^T``) on the seven projections of a llama-style layer. Torch-free:
the router checks an adapter it is told of (router/lora.py), the engine every adapter it reads
(engine/lora/adapter.py); both refuse with a ValueError naming the adapter and the field."""

from __future__ import annotations

import math
from typing import Any

# The projections an adapter may target, by PEFT's module name, grouped by the layer they sit in.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_TARGETS + MLP_TARGETS

# Config fields whose any truthy value changes PEFT's forward beyond the formula above.
REFUSED_WHEN_SET = (
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
    "velora_config",
    "monteclora_config",
    "kasa_config",
)


def check_config(name: str, config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    """(r, scale) of an adapter_config.json, or ValueError naming the field that cannot be served."""

    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"LoRA adapter {name!r}: {field} {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"is {config.get('peft_type')!r}; only 'LORA' is served")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise refuse("r", f"must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise refuse("r", f"= {rank} exceeds --max-lora-rank {max_lora_rank}")
    if not isinstance(alpha, int | float):
        raise refuse("lora_alpha", f"must be a number, got {alpha!r}")
    if config.get("bias", "none") != "none":
        raise refuse("bias", f"= {config['bias']!r} is not served (only 'none')")
    for field in REFUSED_WHEN_SET:
        if config.get(field):
            raise refuse(field, f"= {config[field]!r} is not served")
    _check_targets(name, config.get("target_modules"))
    # fan_in_fan_out concerns Conv1D base layers (GPT-2); on nn.Linear PEFT turns it off itself,
    # so lora_A and lora_B are stored [r, in] and [out, r] either way.
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _check_targets(name: str, targets: Any) -> None:
    # A list of module names (or paths ending in one), "all-linear", or a regular expression
    # matched against module paths: the weights themselves say which layers were adapted.
    if targets == "all-linear" or isinstance(targets, str):
        return
    if not targets:
        raise ValueError(f"LoRA adapter {name!r}: target_modules is empty")
    for target in targets:
        module = str(target).rsplit(".", 1)[-1]
        if module not in TARGET_MODULES:
            raise ValueError(
                f"LoRA adapter {name!r}: target_modules names {target!r}, which is not served "
                f"(served: {', '.join(TARGET_MODULES)})"
            )
