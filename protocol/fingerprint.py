"""What must match for one node's KV blocks to mean the same in another node's cache. Nodes
publish it in their registry record (protocol.registry.NodeInfo) and a prefill node sends it with
every reservation (kv_transfer.messages.KVReserve); the router pairs only nodes with equal ones and
a decode node refuses a reservation whose fingerprint differs from its own, naming the field.
Torch-free."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.protocol.kv_layout import row_width


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVFingerprint:
    """What must match for one node's KV blocks to be meaningful in another's cache."""

    model_id: str  # the weights' content digest (protocol.model_digest)
    dtype: str  # cache dtype, e.g. "float32"
    block_size: int  # tokens per block
    layout: str  # protocol.kv_layout.KV_LAYOUT_NAME
    num_layers: int  # transformer layers
    num_kv_heads: int  # key/value heads
    head_dim: int  # channels per head
    block_hash: str = (
        "xxh3_64-chained-u32le-v1"  # protocol.block_hash.BLOCK_HASH_NAME: how prefixes are named
    )
    # the dtype the model computed the KV in (the node's --dtype, resolved): an int8 cache holds
    # the same format from a bfloat16 and a float32 model, but not the same values; "" unknown
    compute_dtype: str = ""
    # the weights' quantization (--quantization: "int8"), "" for none: a quantized model computes
    # other K and V from the same prompt, so its blocks never meet an unquantized model's
    quantization: str = ""

    @classmethod
    def from_spec(
        cls, model_id: str, spec: Any, layout: str, compute_dtype: str = "", quantization: str | None = None
    ) -> KVFingerprint:
        """From an ``protocol.kv_layout.KVCacheSpec`` (num_blocks is local and not part of it)."""
        return cls(
            compute_dtype=compute_dtype,
            quantization=quantization or "",
            model_id=model_id,
            dtype=spec.dtype,
            block_size=spec.block_size,
            layout=layout,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
        )

    @property
    def row_width(self) -> int:
        """Elements of one (token, head) cache row: head_dim, and an int8 row's scale bytes."""
        return row_width(self.head_dim, self.dtype)

    def first_difference(self, other: KVFingerprint) -> str | None:
        """Name of the first field that differs, or None when compatible."""
        for field in dataclasses.fields(self):
            if getattr(self, field.name) != getattr(other, field.name):
                return field.name
        return None
