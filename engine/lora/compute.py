"""One step's adapter rows, and the batched LoRA sum over them: each row adds its own adapter's
``scale * (x A^T) B^T`` (the scale folded into B when the slot was filled).

A row's adapter is a slot index; a base-model row holds ``num_slots``, one past the last slot,
which names no weights (no sign trick, no -1). On CUDA the Triton kernels of
kernels/lora_triton.py read every row's index; on the CPU the rows are grouped by slot (a step
has few distinct adapters) and each group is two matmuls, gathered and index-added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch


@dataclasses.dataclass(frozen=True, slots=True)
class LoRABatch:
    """A step's adapter of every row, as the model's LoRA layers read it (built by ``build``)."""

    token_slots: torch.Tensor  # [T] int32 on the model's device: each row's slot, num_slots for base
    num_slots: int  # the model's adapter slots (--max-loras); also the base rows' index
    use_triton: bool  # the Triton kernels (which read token_slots), else the torch path (slot_rows)
    # the torch path's groups: (slot, its rows [n] int64 on the device) of each slot the step
    # uses, ascending; empty where the kernels run
    slot_rows: tuple[tuple[int, torch.Tensor], ...] = ()

    @classmethod
    def build(
        cls, token_slots: np.ndarray, num_slots: int, device: torch.device, backend: str | None = None
    ) -> LoRABatch | None:
        """From the step's [T] slot per row (host array; ``num_slots`` for base rows): None when no
        row has an adapter, so that the layers cost nothing. ``backend``: None picks Triton on
        CUDA and torch elsewhere; "triton" or "torch" forces one."""
        assert token_slots.ndim == 1, token_slots.shape
        in_range = token_slots.size == 0 or (token_slots.min() >= 0 and token_slots.max() <= num_slots)
        assert in_range, (token_slots, num_slots)
        if backend not in (None, "triton", "torch"):
            raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
        used = np.unique(token_slots)
        used = used[used < num_slots]
        if used.size == 0:
            return None
        use_triton = device.type == "cuda" if backend is None else backend == "triton"
        slots = torch.from_numpy(token_slots.astype(np.int32)).to(device)
        if use_triton:
            return cls(slots, num_slots, use_triton=True)
        groups = tuple(
            (int(s), torch.from_numpy(np.flatnonzero(token_slots == s)).to(device)) for s in used.tolist()
        )
        return cls(slots, num_slots, use_triton=False, slot_rows=groups)


def token_slots_of(
    seq_slots: Sequence[int | None], num_new_tokens: Sequence[int], num_slots: int
) -> np.ndarray:
    """[T] slot per row for sequences whose rows are consecutive (the model runner's order):
    sequence i's ``num_new_tokens[i]`` rows get ``seq_slots[i]``, or ``num_slots`` where None."""
    per_seq = np.fromiter((num_slots if s is None else s for s in seq_slots), np.int64, len(seq_slots))
    return np.repeat(per_seq, np.asarray(num_new_tokens, np.int64))


@dataclasses.dataclass(frozen=True, slots=True)
class StackedPart:
    """One output part's B for every slot, and where the part's rows sit in the layer's output."""

    b: torch.Tensor  # [num_slots, rows, max_rank], scale folded in
    rows: slice  # the part's columns of the layer's output y


@dataclasses.dataclass(frozen=True, slots=True)
class JoinedParts:
    """A layer's parts' B side by side, for the CPU path: where the parts' output rows are
    contiguous, one block-diagonal B per slot turns the P expands (and index-adds) into one."""

    b: (
        torch.Tensor
    )  # [num_slots, rows of all parts, P * max_rank]: part p's B in its rows, columns p * max_rank on
    rows: slice  # the parts' columns of the layer's output y, together


def lora_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    parts: list[StackedPart],
    batch: LoRABatch,
    joined: JoinedParts | None = None,
) -> None:
    """y [T, out] += each row's adapter over every part, in place.

    x: [T, in]; a: [num_slots, P * max_rank, in], part p's A in rows p * max_rank onwards (one
    shrink for every part); parts[p].b: [num_slots, rows_p, max_rank]. A part, or rank, that an
    adapter does not target holds zeros and adds exactly nothing."""
    assert x.dim() == 2 and y.shape[0] == x.shape[0], (x.shape, y.shape)
    assert a.shape == (batch.num_slots, len(parts) * parts[0].b.shape[2], x.shape[1]), (a.shape, x.shape)
    assert batch.token_slots.shape == x.shape[:1], (batch.token_slots.shape, x.shape)
    if batch.use_triton:
        _lora_add_triton(y, x, a, parts, batch)
    elif joined is not None:
        _lora_add_joined(y, x, a, joined, batch)
    else:
        _lora_add_grouped(y, x, a, parts, batch)


def _lora_add_joined(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, joined: JoinedParts, batch: LoRABatch
) -> None:
    """Two matmuls a slot; a slot that every row uses needs no gather or index-add either."""
    out = y[:, joined.rows]  # [T, rows of all parts], a view: written in place
    if len(batch.slot_rows) == 1 and batch.slot_rows[0][1].numel() == x.shape[0]:
        slot = batch.slot_rows[0][0]
        out.addmm_(x @ a[slot].t(), joined.b[slot].t())
        return
    for slot, rows in batch.slot_rows:
        out.index_add_(0, rows, (x[rows] @ a[slot].t()) @ joined.b[slot].t())


def _lora_add_grouped(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, parts: list[StackedPart], batch: LoRABatch
) -> None:
    rank = parts[0].b.shape[2]
    for slot, rows in batch.slot_rows:
        h = x[rows] @ a[slot].t()  # [n, P * rank]
        for p, part in enumerate(parts):
            delta = h[:, p * rank : (p + 1) * rank] @ part.b[slot].t()  # [n, rows_p]
            y[:, part.rows].index_add_(0, rows, delta)


def _lora_add_triton(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, parts: list[StackedPart], batch: LoRABatch
) -> None:
    from pdserve.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

    x = x if x.stride(1) == 1 else x.contiguous()
    rank = parts[0].b.shape[2]
    h = torch.empty(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)  # [T, P * rank]
    lora_shrink_triton(x, a, batch.token_slots, h)
    for p, part in enumerate(parts):
        lora_expand_triton(h[:, p * rank : (p + 1) * rank], part.b, batch.token_slots, y[:, part.rows])
