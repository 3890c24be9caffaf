"""Load Hugging Face safetensors checkpoints (single file or sharded index) into our models."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from pdserve.engine.models import Model

# Hugging Face parameter -> (our fused parameter, shard index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# our fused parameter's name -> how many checkpoint tensors make it (per expert, for stacked experts)
_NUM_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2, "down_proj": 1}
# '...experts.<e>.<name>.weight' -> (our [num_experts, out, in] parameter, shard index within it)
_EXPERT_FUSED = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),  # Mixtral's names
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


def iter_tensors(model_dir: str | pathlib.Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, read straight onto ``device`` (no host copy of a GPU's weights)."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: Model, model_dir: str | pathlib.Path) -> None:
    """Copy checkpoint tensors into ``model``, fusing q/k/v, gate/up and per-expert matrices;
    every parameter must be set. ``model.checkpoint_name(name)`` (when the model has it) renames
    a checkpoint tensor to its parameter, or returns None for tensors to skip (buffers).

    A fused parameter is filled as soon as its last part is read, so at most one parameter's
    parts are held besides the model: holding them all to the end held most of the checkpoint
    a second time."""
    params = dict(model.named_parameters())
    rename = getattr(model, "checkpoint_name", lambda name: name)
    pending: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # fused parameter -> (expert, shard) -> part
    stacked: set[str] = set()  # fused parameters stacked over experts
    loaded: set[str] = set()
    device = next(model.parameters()).device
    for raw_name, tensor in iter_tensors(model_dir, "cpu" if device.type == "cpu" else str(device)):
        name = rename(raw_name)
        if name is None or "rotary_emb" in name:
            continue
        target, expert, shard = _fused_target(name)
        if target is not None:
            parts = pending.setdefault(target, {})
            parts[(expert or 0, shard)] = tensor
            if expert is not None:
                stacked.add(target)
            if target in params and len(parts) == _num_parts(params[target], target, target in stacked):
                _copy(params[target], _assemble(pending.pop(target), target in stacked), target)
                loaded.add(target)
            continue
        if name not in params:
            if name == "lm_head.weight" and model.config.tie_word_embeddings:  # tied, stored anyway
                continue
            raise ValueError(f"checkpoint tensor {raw_name!r} has no place in the model")
        _copy(params[name], tensor, name)
        loaded.add(name)
    for target, parts in pending.items():
        if target not in params:
            raise ValueError(f"checkpoint tensors for {target!r} have no place in the model")
        _copy(params[target], _assemble(parts, target in stacked), target)
        loaded.add(target)
    missing = set(params) - loaded
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks parameters: {sorted(missing)[:5]}")


def _num_parts(param: torch.nn.Parameter, target: str, over_experts: bool) -> int:
    """How many checkpoint tensors fill the fused parameter ``target``: one per shard (and expert)."""
    kind = next(part for part in reversed(target.split(".")) if part in _NUM_SHARDS)
    return _NUM_SHARDS[kind] * (param.shape[0] if over_experts else 1)


def _fused_target(name: str) -> tuple[str | None, int | None, int]:
    """'...mlp.experts.3.up_proj.weight' -> ('...mlp.experts.gate_up_proj', 3, 1);
    '...self_attn.k_proj.bias' -> ('...self_attn.qkv_proj.bias', None, 1); else (None, None, 0)."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-2] in _EXPERT_FUSED:
        target, shard = _EXPERT_FUSED[parts[-2]]
        return ".".join(parts[:-3] + [target]), int(parts[-3]), shard
    fused = _FUSED.get(parts[-2]) if len(parts) >= 2 else None
    if fused is None:
        return None, None, 0
    return ".".join(parts[:-2] + [fused[0], parts[-1]]), None, fused[1]


def _assemble(parts: dict[tuple[int, int], torch.Tensor], over_experts: bool) -> torch.Tensor:
    if not over_experts:
        return torch.cat([parts[k] for k in sorted(parts)])
    experts = sorted({e for e, _ in parts})
    return torch.stack([torch.cat([parts[k] for k in sorted(parts) if k[0] == e]) for e in experts])


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
