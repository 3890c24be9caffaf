"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), read and checked
against what this engine serves: plain LoRA on the seven projections of a llama-style layer.

PEFT computes, for each targeted linear layer ``W`` (our [out, in] orientation),

    y = x W^T + scale * (x A^T) B^T      A: [r, in]  (lora_A)    B: [out, r]  (lora_B)
    scale = lora_alpha / r,  or lora_alpha / sqrt(r) with use_rslora

Anything that changes that formula (DoRA and PEFT's other variants, a LoRA bias, per-module ranks
or alphas, extra trained modules) is refused with a ValueError naming the adapter and the field,
never served approximately.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import torch
from safetensors import safe_open

from pdserve.protocol.lora_config import ATTENTION_TARGETS, TARGET_MODULES, check_config

# base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclasses.dataclass(frozen=True, slots=True)
class LoRALimits:
    """What the engine's adapter slots hold: vLLM's --max-loras and --max-lora-rank."""

    max_loras: int  # adapter slots in memory
    max_lora_rank: int  # the largest r an adapter may have; every slot is padded to it

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")


@dataclasses.dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter's weights, whole (not yet split over tensor-parallel ranks)."""

    name: str  # what requests call it (vLLM's --lora-modules name=DIR)
    path: str  # its PEFT folder
    rank: int  # r
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # (layer, module) -> (A [r, in], B [out, r]) in the model's dtype, module one of TARGET_MODULES
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.weights)


def load_adapter(
    name: str,
    path: str | pathlib.Path,
    max_lora_rank: int,
    num_layers: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """The adapter in ``path``, checked; its weights in ``dtype`` on the CPU. ValueError, naming
    ``name`` and the field, for anything this engine cannot serve exactly."""
    folder = pathlib.Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for file in (config_file, weights_file):
        if not file.is_file():
            raise ValueError(f"LoRA adapter {name!r}: no {file.name} in {folder}")
    config = json.loads(config_file.read_text())
    rank, scale = check_config(name, config, max_lora_rank)
    weights = _read_weights(name, weights_file, rank, num_layers, dtype)
    return LoRAAdapter(name=name, path=str(folder), rank=rank, scale=scale, weights=weights)


def _read_weights(
    name: str, file: pathlib.Path, rank: int, num_layers: int, dtype: torch.dtype
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            match = _KEY.fullmatch(key)
            if match is None:
                raise ValueError(f"LoRA adapter {name!r}: weight {key!r} is not a served target module")
            layer, block, module, half = int(match[1]), match[2], match[3], match[4]
            expected_block = "self_attn" if module in ATTENTION_TARGETS else "mlp"
            if module not in TARGET_MODULES or block != expected_block:
                raise ValueError(f"LoRA adapter {name!r}: weight {key!r} is not a served target module")
            if layer >= num_layers:
                raise ValueError(
                    f"LoRA adapter {name!r}: weight {key!r} is past the model's {num_layers} layers"
                )
            halves[layer, module, half] = f.get_tensor(key).to(dtype)
    weights = {}
    for layer, module, half in sorted(halves):
        if half == "B":
            continue
        a, b = halves[layer, module, "A"], halves.get((layer, module, "B"))
        if b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            shapes = (tuple(a.shape), None if b is None else tuple(b.shape))
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} {module}: lora_A / lora_B shapes {shapes} "
                f"do not match r = {rank}"
            )
        weights[layer, module] = (a, b)
    if len(weights) * 2 != len(halves):
        raise ValueError(f"LoRA adapter {name!r}: a lora_B weight has no lora_A")
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weight")
    return weights
