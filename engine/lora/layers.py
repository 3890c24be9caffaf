"""Every adapter slot's A and B for one parallel linear layer, split over the tensor-parallel
ranks like the layer's weight, and the hook that adds them to its output (engine/layers/linear.py
calls ``add_`` when ``layer.lora`` is set).

    column-parallel (qkv, gate_up)   A whole [r, in];          B: this rank's output rows
    row-parallel (o, down)           A: this rank's columns;   B whole [out, r]
                                     (x_r A_r^T B^T summed by the layer's own all-reduce)

A merged layer's parts (q, k, v; gate, up) share one shrink: A stacks part p's rows at
p * max_rank, and part p's B adds into its own rows of the output.

    a: [num_slots, P * max_rank, in_local]     b_p: [num_slots, rows_p, max_rank]
        slot s  [ q: r rows, 0-padded | k | v ]      (scale folded into B, padding zero)
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RankRows,
    RowParallelLinear,
    narrow,
)
from pdserve.engine.lora.compute import JoinedParts, LoRABatch, StackedPart, lora_add_


class ActiveBatch:
    """The step's LoRABatch, shared by one model's LoRA layers: set only for the length of a
    ``LoRAModel.step`` block, None outside it (and for a step with no adapter rows)."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


ParallelLinear = QKVParallelLinear | MergedColumnParallelLinear | RowParallelLinear


class LoRALinear:
    """``layer``'s adapters: ``parts`` maps each PEFT module name the layer computes (q_proj, ...)
    to the layer's part id (``rank_rows``'s argument; None for a row-parallel layer)."""

    def __init__(
        self,
        layer: ParallelLinear,
        parts: dict[str, object],
        active: ActiveBatch,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer, self.parts, self.active, self.max_rank = layer, parts, active, max_rank
        self.row_parallel = isinstance(layer, RowParallelLinear)
        in_local = layer.in_local if isinstance(layer, RowParallelLinear) else layer.in_features
        rows = [self._rank_rows(part) for part in parts.values()]
        # a: [num_slots, P * max_rank, in_local]; each part's b: [num_slots, rows on this rank, max_rank]
        self.a = torch.zeros(num_slots, len(parts) * max_rank, in_local, dtype=dtype, device=device)
        self.stacked = [
            StackedPart(
                torch.zeros(num_slots, length, max_rank, dtype=dtype, device=device), slice(at, at + length)
            )
            for _, _, length, at in rows
        ]
        # the CPU path's block-diagonal B, where the parts' rows of the output are contiguous
        starts = [at for _, _, _, at in rows]
        ends = [at + length for _, _, length, at in rows]
        contiguous = all(end == start for end, start in zip(ends, starts[1:], strict=False))
        self.joined = None
        if contiguous and device.type != "cuda":
            b = torch.zeros(
                num_slots, ends[-1] - starts[0], len(parts) * max_rank, dtype=dtype, device=device
            )
            self.joined = JoinedParts(b, slice(starts[0], ends[-1]))

    def _rank_rows(self, part: object) -> RankRows:
        if isinstance(self.layer, RowParallelLinear):  # every output row, on every rank
            return RankRows(self.layer.out_features, 0, self.layer.out_features, 0)
        return self.layer.rank_rows(part)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        batch = self.active.batch
        if batch is not None:
            lora_add_(y, x, self.a, self.stacked, batch, self.joined)

    def fill(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Slot ``slot`` := the adapter ``weights`` (module -> whole A [r, in], B [out, r]), this
        rank's pieces; the layer's modules it does not name are zeroed."""
        self.clear(slot)
        for p, (module, part) in enumerate(self.parts.items()):
            if module not in weights:
                continue
            a, b = weights[module]
            rank = a.shape[0]
            whole_rows, start, length, _ = self._rank_rows(part)
            whole_in = self.layer.in_features
            if a.shape[1] != whole_in or b.shape[0] != whole_rows:
                raise ValueError(
                    f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                    f"model's [{whole_rows}, {whole_in}] projection"
                )
            if self.row_parallel:
                assert isinstance(self.layer, RowParallelLinear)
                a = narrow(a, 1, self.layer.start, self.layer.in_local)  # [r, in / tp]
            else:
                b = narrow(b, 0, start, length)  # [out / tp, r]
            with torch.no_grad():
                self.a[slot, p * self.max_rank : p * self.max_rank + rank] = a
                self.stacked[p].b[slot, :, :rank] = b.float() * scale  # rounded once, to the slot's dtype
                if self.joined is not None:
                    rows = self.stacked[p].rows
                    at = rows.start - self.joined.rows.start
                    block = self.joined.b[slot, at : at + rows.stop - rows.start]
                    block[:, p * self.max_rank : p * self.max_rank + rank] = self.stacked[p].b[slot, :, :rank]

    def clear(self, slot: int) -> None:
        with torch.no_grad():
            self.a[slot].zero_()
            for part in self.stacked:
                part.b[slot].zero_()
            if self.joined is not None:
                self.joined.b[slot].zero_()


def lora_targets(layer: nn.Module) -> dict[str, tuple[ParallelLinear, dict[str, object]]]:
    """A decoder layer's linears that adapters may patch: attribute path -> (the linear, PEFT module
    name -> its part). Empty entries for what the layer lacks (an MoE layer's MLP)."""
    found: dict[str, tuple[ParallelLinear, dict[str, object]]] = {}
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    qkv, o = getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None)
    gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
    if isinstance(qkv, QKVParallelLinear):
        found["self_attn.qkv_proj"] = (qkv, {"q_proj": "q", "k_proj": "k", "v_proj": "v"})
    if isinstance(o, RowParallelLinear):
        found["self_attn.o_proj"] = (o, {"o_proj": None})
    if isinstance(gate_up, MergedColumnParallelLinear) and len(gate_up.shards) == 2:
        found["mlp.gate_up_proj"] = (gate_up, {"gate_proj": 0, "up_proj": 1})
    if isinstance(down, RowParallelLinear):
        found["mlp.down_proj"] = (down, {"down_proj": None})
    return found
