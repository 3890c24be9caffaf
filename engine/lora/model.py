"""A model's adapter slots: hooks on its decoder layers' linears, which adapter each slot holds,
and the with-block that hands a step's rows to the hooks.

The model runner owns one LoRAModel and, per step:

    batch = lora.batch(token_slots)          # [T] host array: each row's slot, num_slots for base
    with lora.step(batch):                   # None (no adapter rows): the hooks add nothing
        hidden = model(input_ids, positions, kv_caches, meta)

No forward signature changes and nothing global: the hooks read this object's ActiveBatch, set
for the length of the block only.

Rank 0 decides which slot an adapter takes (``load``, ``pin``, ``unpin``, ``unload``: the slot
table and the weights); a tensor-parallel worker rank only copies its shard of the adapter into
the slot rank 0 names (``fill``, ``clear``), and builds the same batch from the step's plan.

CUDA graphs: a graph captured outside a ``step`` block has no LoRA in it, and the torch path's
groups change shape with the batch; a step with adapter rows runs eagerly.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.lora.adapter import LoRAAdapter, LoRALimits, load_adapter
from pdserve.engine.lora.compute import LoRABatch
from pdserve.engine.lora.layers import ActiveBatch, LoRALinear, lora_targets
from pdserve.engine.lora.slots import SlotAssignment, SlotTable

# Families whose decoder layers are SelfAttention + GatedMLP under HF's llama names, tested
# against PEFT (tests/test_lora_model.py).
LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def check_lora_family(model_config: ModelConfig) -> None:
    """ValueError naming the flag unless ``model_config``'s family is served with adapters."""
    if model_config.architecture not in LORA_ARCHITECTURES:
        raise ValueError(
            f"--enable-lora: {model_config.architecture} is not served with LoRA adapters "
            f"(served: {', '.join(LORA_ARCHITECTURES)})"
        )


class LoRAModel:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        limits: LoRALimits,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Hooks every target linear of ``model`` (already built and loaded, this rank's shard) and
        allocates ``limits.max_loras`` zeroed slots in ``dtype`` on ``device``."""
        check_lora_family(model_config)
        self.limits, self.dtype, self.device, self.num_layers = limits, dtype, device, model_config.num_layers
        self.active = ActiveBatch()
        self.slots = SlotTable(limits.max_loras)
        # per decoder layer: PEFT module name (q_proj, ...) -> the hook of the linear computing it
        self.hooks: list[dict[str, LoRALinear]] = []
        layers = getattr(getattr(model, "model", None), "layers", None)  # HF's model.layers
        assert isinstance(layers, nn.ModuleList) and len(layers) == self.num_layers, type(model)
        for layer in layers:
            by_module = {}
            for linear, parts in lora_targets(layer).values():
                hook = LoRALinear(
                    linear, parts, self.active, limits.max_loras, limits.max_lora_rank, dtype, device
                )
                linear.lora = hook
                by_module.update(dict.fromkeys(parts, hook))
            self.hooks.append(by_module)

    @property
    def num_slots(self) -> int:
        return self.limits.max_loras

    def read(self, name: str, path: str | pathlib.Path) -> LoRAAdapter:
        """The PEFT folder ``path`` as adapter ``name``, checked against the limits and this model
        (ValueError naming the adapter and the field), not yet in a slot."""
        adapter = load_adapter(name, path, self.limits.max_lora_rank, self.num_layers, self.dtype)
        self._check_served(adapter)
        return adapter

    def can_load(self, name: str) -> bool:
        return self.slots.can_assign(name)

    def load(self, adapter: LoRAAdapter) -> SlotAssignment:
        """Put ``adapter`` in a slot (the one it holds already, a free one, or the least recently
        used unpinned adapter's); AllSlotsPinned when every slot is pinned."""
        self._check_served(adapter)
        assignment = self.slots.assign(adapter.name)
        if assignment.is_new:
            try:
                self.fill(assignment.slot, adapter)
            except ValueError:
                self.unload(adapter.name)
                raise
        return assignment

    def unload(self, name: str) -> None:
        """Free ``name``'s slot (ValueError while a running request pins it, or if not loaded)."""
        self.clear(self.slots.remove(name))

    def fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Slot ``slot``'s weights := this rank's shard of ``adapter`` (scale folded into B, ranks
        zero-padded); ValueError naming the adapter, layer and module where a shape does not fit."""
        self._check_served(adapter)
        for layer, by_module in enumerate(self.hooks):
            for hook in dict.fromkeys(by_module.values()):
                weights = {m: adapter.weights[layer, m] for m in hook.parts if (layer, m) in adapter.weights}
                try:
                    hook.fill(slot, weights, adapter.scale)
                except ValueError as e:
                    raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} {e}") from None

    def clear(self, slot: int) -> None:
        """Slot ``slot``'s weights := zeros."""
        for hook in self._distinct_hooks():
            hook.clear(slot)

    def pin(self, name: str) -> int:
        """A running request uses ``name`` (loaded): its slot, never evicted until ``unpin``."""
        return self.slots.pin(name)

    def unpin(self, name: str) -> None:
        self.slots.unpin(name)

    def slot_of(self, name: str) -> int | None:
        return self.slots.slot_of(name)

    def batch(self, token_slots: np.ndarray, backend: str | None = None) -> LoRABatch | None:
        """The step's LoRABatch from its [T] slot per row (``num_slots`` for a base-model row)."""
        return LoRABatch.build(token_slots, self.num_slots, self.device, backend)

    @contextlib.contextmanager
    def step(self, batch: LoRABatch | None) -> Iterator[None]:
        """The model's forward passes inside the block apply ``batch``'s adapters."""
        assert self.active.batch is None, "LoRA steps do not nest"
        assert batch is None or batch.num_slots == self.num_slots, (batch.num_slots, self.num_slots)
        self.active.batch = batch
        try:
            yield
        finally:
            self.active.batch = None

    def _check_served(self, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.limits.max_lora_rank:
            raise ValueError(
                f"LoRA adapter {adapter.name!r}: r = {adapter.rank} exceeds --max-lora-rank {self.limits.max_lora_rank}"
            )
        for layer, module in adapter.weights:
            if layer >= self.num_layers or module not in self.hooks[layer]:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r}: target module {module} of layer {layer} is not served by this model"
                )

    def _distinct_hooks(self) -> Iterator[LoRALinear]:
        for by_module in self.hooks:
            yield from dict.fromkeys(by_module.values())
