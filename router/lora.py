"""The LoRA adapters clients may name in ``model``: the router's table of them, from
``--lora-modules`` and ``POST /v1/load_lora_adapter``, as vLLM's server keeps its own.

A request that names an adapter runs with it on every node it touches: the router puts the
adapter's name and folder in its SamplingParams (``adapter``, ``adapter_path``), a node that has
not read it yet reads it from there, and the nodes' prefix caches and the router's prefix index
key its blocks on the name (protocol.block_hash.cache_root_of). The router reads only the
adapter's config here (its rank, to route it to nodes that can hold it); a node checks the
weights and refuses, naming the field, what it cannot serve.

    POST /v1/load_lora_adapter   {"lora_name": ..., "lora_path": ...}   a new name (400 if taken)
    POST /v1/unload_lora_adapter {"lora_name": ...}                     404 if unknown
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import pydantic

from pdserve.protocol.lora_config import check_config
from pdserve.router.errors import APIError, bad_request


@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    name: str  # what requests put in "model"
    path: str  # its PEFT folder, as the nodes reach it
    rank: int  # its r: only nodes whose --max-lora-rank covers it serve it
    created: int  # when the router learnt of it (the /v1/models card's "created")


class LoadBody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name


class UnloadBody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names suffice here


def read_adapter(name: str, path: str) -> Adapter:
    """``path``'s adapter under ``name``; a 400 naming the field when it is no PEFT LoRA folder."""
    if not name:
        raise bad_request(f"lora_name must be a non-empty name, got {name!r}", "lora_name")
    config_file = pathlib.Path(path) / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise bad_request(
            f"lora_path: no readable adapter_config.json in {path!r} ({exc})", "lora_path"
        ) from None
    if not isinstance(config, dict):
        raise bad_request(f"lora_path: {path!r}'s adapter_config.json is not an object", "lora_path")
    try:  # the nodes' own check of the config; the rank against each node's limit is routing's
        rank, _ = check_config(name, config, max_lora_rank=1 << 30)
    except ValueError as exc:
        raise bad_request(f"lora_path: {exc}", "lora_path") from None
    return Adapter(name, str(path), rank, int(time.time()))


class AdapterTable:
    """Adapter name -> Adapter. The base model's names are never adapters."""

    def __init__(self, base_names: tuple[str, ...], modules: tuple[str, ...]) -> None:
        self._base_names = base_names
        self._adapters: dict[str, Adapter] = {}
        for module in modules:  # --lora-modules NAME=DIR ...
            name, sep, path = module.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules takes NAME=PEFT_FOLDER, got {module!r}")
            self.add(name, path)

    def __iter__(self):
        return iter(self._adapters.values())

    def get(self, model: str | None) -> Adapter | None:
        """The adapter a request's ``model`` names; None for the base model (or no name)."""
        if model is None or model in self._base_names:
            return None
        adapter = self._adapters.get(model)
        if adapter is None:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return adapter

    def add(self, name: str, path: str, replace: bool = False) -> Adapter:
        if name in self._base_names:
            raise bad_request(f"lora_name {name!r} is the base model's name", "lora_name")
        if name in self._adapters and not replace:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        adapter = self._adapters[name] = read_adapter(name, path)
        return adapter

    def remove(self, name: str) -> Adapter:
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        return adapter

    def cards(self, base_name: str, max_model_len: int) -> list[dict]:
        """/v1/models entries, one an adapter, each with its base model as ``parent``."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": a.created,
                "owned_by": "pdserve",
                "root": a.path,
                "parent": base_name,
                "max_model_len": max_model_len,
            }
            for a in self._adapters.values()
        ]
