"""Multi-LoRA: PEFT adapters read and checked (adapter.py), which adapter each slot holds
(slots.py), every slot's weights on the model's linears (layers.py, model.py), the batched
per-row sum (compute.py; the Triton kernels in kernels/lora_triton.py), and the engine's served
adapters, with the requests that pin or wait for their slots (registry.py, imported from there:
it needs the engine's executor)."""

from pdserve.engine.lora.adapter import LoRAAdapter, LoRALimits, load_adapter
from pdserve.engine.lora.compute import LoRABatch, token_slots_of
from pdserve.engine.lora.model import LORA_ARCHITECTURES, LoRAModel
from pdserve.engine.lora.slots import AllSlotsPinned, SlotAssignment, SlotTable

__all__ = [
    "LORA_ARCHITECTURES",
    "AllSlotsPinned",
    "LoRAAdapter",
    "LoRABatch",
    "LoRALimits",
    "LoRAModel",
    "SlotAssignment",
    "SlotTable",
    "load_adapter",
    "token_slots_of",
]
