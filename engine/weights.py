"""Load Hugging Face safetensors checkpoints (single file or sharded index) into our models."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import torch
from safetensors import safe_open

# Hugging Face parameter -> (our fused parameter, shard index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def checkpoint_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    root = pathlib.Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / s for s in shards]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"model: no model.safetensors or model.safetensors.index.json in {root}")


def iter_tensors(model_dir: str | pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: torch.nn.Module, model_dir: str | pathlib.Path) -> None:
    """Copy checkpoint tensors into ``model``, fusing q/k/v and gate/up; every parameter must be set."""
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for name, tensor in iter_tensors(model_dir):
        if "rotary_emb" in name:
            continue
        parts = name.split(".")
        fused = _FUSED.get(parts[-2]) if len(parts) >= 2 else None
        if fused is not None:
            target = ".".join(parts[:-2] + [fused[0], parts[-1]])
            pending.setdefault(target, {})[fused[1]] = tensor
            continue
        if name not in params:
            if name == "lm_head.weight":  # tied checkpoints sometimes store it anyway
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        _copy(params[name], tensor, name)
        loaded.add(name)
    for target, shards in pending.items():
        _copy(params[target], torch.cat([shards[i] for i in sorted(shards)]), target)
        loaded.add(target)
    missing = set(params) - loaded
    if getattr(model.config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks parameters: {sorted(missing)[:5]}")


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, model expects "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
