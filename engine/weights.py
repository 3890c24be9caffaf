"""Load Hugging Face safetensors checkpoints (single file or sharded index) into our models, each
tensor-parallel rank reading only its pieces."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from pdserve.engine.layers.linear import CheckpointTensor

if TYPE_CHECKING:
    from pdserve.engine.models import Model

# Hugging Face parameter -> (our fused parameter, the part it is: the parameter loader's shard id)
_FUSED: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# stacked experts' parameter -> how many checkpoint tensors make it per expert
_NUM_SHARDS = {"gate_up_proj": 2, "down_proj": 1}
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


# a compressed-tensors W8A8 checkpoint's companions of an int8 weight, read with it (ScaledInt8)
_SCALE_SUFFIXES = (".weight_scale", ".weight_zero_point")


class ScaledInt8:
    """A compressed-tensors int8 weight [out, in] with its per-output-channel scale ([out, 1] or
    [out]), read as float32 ``q * scale`` in the rows and columns a loader indexes. The engine's
    int8 layers quantize it again per channel, which gives back the same int8 values (each
    row's largest |q| is 127, as the W8A8 scheme's min-max scales make it)."""

    def __init__(self, q: Any, scale: Any) -> None:
        self.q, self.scale = q, scale

    def get_shape(self) -> list[int]:
        return list(self.q.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows = index[0] if isinstance(index, tuple) else index
        return self.q[index].float() * self.scale[rows].float().reshape(-1, 1)


def iter_slices(model_dir: str | pathlib.Path, device: str = "cpu") -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors as safetensors slices: bytes are read (straight onto ``device``,
    no host copy of a GPU's weights) only for the rows and columns a loader indexes. An int8
    weight of a compressed-tensors checkpoint comes with its scale, as one ScaledInt8."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device=device) as f:
            names = set(f.keys())
            for name in f.keys():
                if name.endswith(_SCALE_SUFFIXES):
                    continue
                data = f.get_slice(name)
                if data.get_dtype() == "I8":
                    scale = name.removesuffix("weight") + "weight_scale"
                    if not name.endswith(".weight") or scale not in names:
                        raise ValueError(f"checkpoint tensor {name!r} is int8 without a {scale} in its file")
                    data = ScaledInt8(data, f.get_slice(scale))
                yield name, data


def load_weights(model: Model, model_dir: str | pathlib.Path) -> None:
    """Copy checkpoint tensors into ``model``; every parameter must be set.

    A parameter with a ``weight_loader`` (engine/layers/linear.py) takes the checkpoint tensor
    lazily and reads only its rank's piece: q/k/v and gate/up go into their fused parameter as
    the parts the loader places, and a tensor the checkpoint stores fused (Phi-3's qkv_proj,
    GPT-2's c_attn) is split into those parts first. Others are read whole. Experts' matrices
    are stacked into one [num_experts, out, in] parameter, each filled as soon as its last part
    is read (holding every part to the end held most of the checkpoint a second time).

    ``model.checkpoint_name(name)`` (where the model has it) renames a checkpoint tensor to its
    parameter, or returns None for tensors to skip (buffers); ``model.checkpoint_transposed(name)``
    says a matrix is stored [in, out]."""
    params = dict(model.named_parameters())
    fused_parts = {  # parameter -> its parts' (shard id, rows in the checkpoint)
        f"{module_name}.{name}": module.fused_parts
        for module_name, module in model.named_modules()
        if hasattr(module, "fused_parts")
        for name, _ in module.named_parameters(recurse=False)
    }
    rename = getattr(model, "checkpoint_name", lambda name: name)
    transposed = getattr(model, "checkpoint_transposed", lambda name: False)
    experts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # parameter -> (expert, shard) -> part
    parts_done: dict[str, set[str | int]] = {}
    loaded: set[str] = set()
    device = next(model.parameters()).device
    for raw_name, data in iter_slices(model_dir, "cpu" if device.type == "cpu" else str(device)):
        name = rename(raw_name)
        if name is None or "rotary_emb" in name:
            continue
        source = CheckpointTensor(data, transposed(name))
        target, expert, shard = _fused_target(name)
        if target is not None and target not in params:
            raise ValueError(f"checkpoint tensor {raw_name!r} has no place in the model ({target})")
        if target is not None and expert is not None:
            parts = experts.setdefault(target, {})
            parts[(expert, int(shard))] = source.read()
            if len(parts) == _NUM_SHARDS[target.rsplit(".", 1)[-1]] * params[target].shape[0]:
                _copy(params[target], _stack_experts(experts.pop(target)), target)
                loaded.add(target)
        elif target is not None:
            _load(params[target], source, shard, raw_name)
            done = parts_done.setdefault(target, set())
            done.add(shard)
            if len(done) == len(fused_parts[target]):
                loaded.add(target)
        elif name in params:
            _load_whole(params[name], source, fused_parts.get(name), raw_name)
            loaded.add(name)
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):  # tied, stored anyway
            raise ValueError(f"checkpoint tensor {raw_name!r} has no place in the model")
    if experts:
        raise ValueError(f"checkpoint lacks experts' matrices for {sorted(experts)[:3]}")
    missing = set(params) - loaded
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks parameters: {sorted(missing)[:5]}")


def _load(param: torch.nn.Parameter, source: CheckpointTensor, shard: str | int | None, name: str) -> None:
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        _copy(param, source.read(), name)
        return
    try:
        loader(param, source, shard)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def _load_whole(param: torch.nn.Parameter, source: CheckpointTensor, parts: list | None, name: str) -> None:
    """A tensor of its own, or one the checkpoint stores fused: each part as if its own tensor."""
    if parts is None:
        _load(param, source, None, name)
        return
    if sum(rows for _, rows in parts) != source.rows:
        raise ValueError(
            f"checkpoint tensor {name!r} has {source.rows} rows, the model's parts "
            f"{[shard for shard, _ in parts]} take {sum(rows for _, rows in parts)}"
        )
    offset = 0
    for shard, rows in parts:
        _load(param, source.part(offset, rows), shard, name)
        offset += rows


def _fused_target(name: str) -> tuple[str | None, int | None, str | int]:
    """'...mlp.experts.3.up_proj.weight' -> ('...mlp.experts.gate_up_proj', 3, 1);
    '...self_attn.k_proj.bias' -> ('...self_attn.qkv_proj.bias', None, 'k'); else (None, None, 0)."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-2] in _EXPERT_FUSED:
        target, shard = _EXPERT_FUSED[parts[-2]]
        return ".".join(parts[:-3] + [target]), int(parts[-3]), shard
    fused = _FUSED.get(parts[-2]) if len(parts) >= 2 else None
    if fused is None:
        return None, None, 0
    return ".".join(parts[:-2] + [fused[0], parts[-1]]), None, fused[1]


def _stack_experts(parts: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """[num_experts, out, in]: each expert's parts (gate, up) concatenated, in expert order."""
    experts = sorted({e for e, _ in parts})
    return torch.stack([torch.cat([parts[k] for k in sorted(parts) if k[0] == e]) for e in experts])


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
