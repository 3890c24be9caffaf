"""Tensor-parallel linear layers and the vocabulary's embedding and head (after vLLM's
linear.py and vocab_parallel_embedding.py; written for pdserve).

    ColumnParallelLinear        y_r = x W_r^T              W's output rows split over the ranks
    MergedColumnParallelLinear  gate_up: gate's share of rows, then up's share, on each rank
    QKVParallelLinear           q: its heads split; k, v: their heads split, or replicated when
                                the ranks outnumber them (protocol/kv_layout.py: kv_heads_of)
    RowParallelLinear           y = sum_r x_r W_r^T (+ b)  W's input columns split; an all-reduce
    VocabParallelEmbedding      the vocabulary (padded to a multiple of 64 x tp) split in ranges;
                                ids outside a rank's range embed as zeros, then an all-reduce
    ParallelLMHead              each rank's range of logits, gathered, the padding cut off

Each parameter carries a ``weight_loader(param, checkpoint_tensor, shard)`` that narrows the
whole checkpoint tensor to this rank's piece. It indexes only with slices along one dimension,
which safetensors' lazy ``get_slice`` objects take as well as tensors: a rank reads its rows,
never the whole tensor. At tp=1 every layer computes what ``nn.Linear`` / ``nn.Embedding`` does.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.parallel import ParallelState
from pdserve.protocol.kv_layout import check_tp_layout, kv_heads_of

VOCAB_PADDING = 64  # each rank's vocabulary range is a multiple of this many rows


def narrow(source: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) ``start:start+length`` of a tensor or a safetensors slice."""
    assert dim in (0, 1), dim
    return source[start : start + length] if dim == 0 else source[:, start : start + length]


def _copy(param: torch.Tensor, piece: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(piece.shape):
        raise ValueError(
            f"{what}: checkpoint piece of shape {tuple(piece.shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(piece.to(param.dtype))


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with this rank's share of W's output rows (and of b): no communication."""

    def __init__(
        self, in_features: int, out_features: int, parallel: ParallelState, bias: bool = False
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.start, self.out_local = parallel.shard(out_features, "output features")
        self.weight = _parameter(self.out_local, in_features)  # [out / tp, in]
        self.weight.weight_loader = self.load_rows  # type: ignore[attr-defined]
        self.bias = _parameter(self.out_local) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_rows  # type: ignore[attr-defined]

    def load_rows(self, param: torch.Tensor, full: Any, shard: object = None) -> None:
        _copy(param, narrow(full, 0, self.start, self.out_local), "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out / tp]
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel matrices in one matmul (gate and up): this rank's rows of each, in
    order. ``weight_loader(param, full, k)`` fills part k from the checkpoint's k-th matrix."""

    def __init__(
        self, in_features: int, out_features: list[int], parallel: ParallelState, bias: bool = False
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.shards = [
            parallel.shard(size, f"output features of part {k}") for k, size in enumerate(out_features)
        ]
        self.offsets = list(itertools.accumulate((n for _, n in self.shards), initial=0))
        self.weight = _parameter(self.offsets[-1], in_features)  # [sum(out_k) / tp, in]
        self.weight.weight_loader = self.load_part  # type: ignore[attr-defined]
        self.bias = _parameter(self.offsets[-1]) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_part  # type: ignore[attr-defined]

    def load_part(self, param: torch.Tensor, full: Any, shard: object) -> None:
        assert isinstance(shard, int), shard
        start, length = self.shards[shard]
        _copy(
            param[self.offsets[shard] : self.offsets[shard] + length],
            narrow(full, 0, start, length),
            f"part {shard}",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(nn.Module):
    """The fused q, k, v projection: this rank's query heads, then its KV heads' k, then their v.
    Query heads split evenly; KV heads split evenly, or (more ranks than KV heads) each rank holds
    one, replicated. ``weight_loader(param, full, "q" | "k" | "v")``."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        parallel: ParallelState,
        bias: bool = False,
    ) -> None:
        super().__init__()
        check_tp_layout(num_kv_heads, parallel.tp_size)
        q_start, self.num_heads = parallel.shard(num_heads, "attention heads")
        kv = kv_heads_of(num_kv_heads, parallel.tp_size, parallel.rank)
        self.num_kv_heads, self.head_dim = len(kv), head_dim
        # (checkpoint row start, rows) of each part, and where the part starts in this rank's rows
        self.parts = {
            "q": (q_start * head_dim, self.num_heads * head_dim, 0),
            "k": (kv.start * head_dim, len(kv) * head_dim, self.num_heads * head_dim),
            "v": (kv.start * head_dim, len(kv) * head_dim, (self.num_heads + len(kv)) * head_dim),
        }
        rows = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.weight = _parameter(rows, hidden_size)  # [(H + 2 KVH) / tp * D, hidden]
        self.weight.weight_loader = self.load_part  # type: ignore[attr-defined]
        self.bias = _parameter(rows) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_part  # type: ignore[attr-defined]

    def load_part(self, param: torch.Tensor, full: Any, shard: object) -> None:
        start, length, at = self.parts[str(shard)]
        _copy(param[at : at + length], narrow(full, 0, start, length), f"{shard} projection")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, (H + 2 KVH) / tp * D]
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with x and W's input columns split: each rank's partial product, summed
    over the ranks; the bias (whole on every rank) is added once, after the sum."""

    def __init__(
        self, in_features: int, out_features: int, parallel: ParallelState, bias: bool = False
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.start, self.in_local = parallel.shard(in_features, "input features")
        self.weight = _parameter(out_features, self.in_local)  # [out, in / tp]
        self.weight.weight_loader = self.load_columns  # type: ignore[attr-defined]
        self.bias = _parameter(out_features) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = lambda param, full, shard=None: _copy(param, full[:], "bias")  # type: ignore[attr-defined]

    def load_columns(self, param: torch.Tensor, full: Any, shard: object = None) -> None:
        _copy(param, narrow(full, 1, self.start, self.in_local), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / tp] -> [T, out]
        y = self.parallel.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """The vocabulary's rows across the ranks: a multiple of VOCAB_PADDING on each."""
    step = VOCAB_PADDING * tp_size
    return math.ceil(vocab_size / step) * step


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + per_rank)`` of the (padded) vocabulary on each rank. An id outside
    them embeds as zeros here, and the all-reduce adds the one rank that holds it."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel, self.vocab_size = parallel, vocab_size
        self.per_rank = padded_vocab(vocab_size, parallel.tp_size) // parallel.tp_size
        self.start = parallel.rank * self.per_rank
        self.num_real = max(0, min(self.per_rank, vocab_size - self.start))  # the rest: padding rows
        self.weight = _parameter(self.per_rank, hidden_size)
        self.weight.weight_loader = self.load_rows  # type: ignore[attr-defined]

    def load_rows(self, param: torch.Tensor, full: Any, shard: object = None) -> None:
        with torch.no_grad():
            param[self.num_real :].zero_()  # padding: never a real token's row
        _copy(param[: self.num_real], narrow(full, 0, self.start, self.num_real), "vocabulary rows")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, hidden]
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_real)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of this rank's vocabulary range, gathered over the ranks, the padding cut off. A tied
    head takes the embedding's weight (``head.weight = embedding.weight``): the same range on every
    rank."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab]
        local = F.linear(hidden, self.weight)  # [N, vocab_padded / tp]
        return self.parallel.all_gather(local, dim=-1)[:, : self.vocab_size]
