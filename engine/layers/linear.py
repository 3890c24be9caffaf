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
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.executor.parallel import ParallelState
from pdserve.kernels import cpu_int8, cpu_linear
from pdserve.protocol.kv_layout import check_tp_layout, kv_heads_of, query_heads_of

VOCAB_PADDING = 64  # each rank's vocabulary range is a multiple of this many rows


class CheckpointTensor:
    """A checkpoint tensor as the weight loaders read it, in this engine's [out, in] orientation:
    rows (dim 0) are a layer's outputs, columns (dim 1) its inputs. ``data`` is a tensor or a
    safetensors slice, read only where it is indexed. ``transposed``: a matrix stored [in, out]
    (GPT-2's Conv1D). ``part(offset, rows)``: rows of a tensor the checkpoint stores fused
    (Phi-3's qkv_proj, GPT-2's c_attn), each part loaded as if it were a tensor of its own."""

    def __init__(self, data: Any, transposed: bool = False, offset: int = 0, rows: int | None = None):
        shape = tuple(data.get_shape() if hasattr(data, "get_shape") else data.shape)
        self.data, self.offset = data, offset
        self.transposed = transposed and len(shape) == 2  # a bias is a bias either way
        self.stored_rows = shape[1] if self.transposed else shape[0]
        self.rows = self.stored_rows - offset if rows is None else rows

    def part(self, offset: int, rows: int) -> CheckpointTensor:
        return CheckpointTensor(self.data, self.transposed, self.offset + offset, rows)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) ``start:start+length``, with every column or row."""
        assert dim in (0, 1), dim
        if dim == 1 and self.rows != self.stored_rows:  # a fused part's columns: its rows first
            return self.narrow(0, 0, self.rows)[:, start : start + length]
        if dim == 0:
            assert length == 0 or start + length <= self.rows, (start, length, self.rows)
            start += self.offset
        stored_dim = 1 - dim if self.transposed else dim
        piece = self.data[start : start + length] if stored_dim == 0 else self.data[:, start : start + length]
        return piece.t() if self.transposed else piece

    def read(self) -> torch.Tensor:
        """All of it (a replicated parameter: a norm, a bias added after the all-reduce)."""
        return self.narrow(0, 0, self.rows)


def as_checkpoint(source: Any) -> CheckpointTensor:
    return source if isinstance(source, CheckpointTensor) else CheckpointTensor(source)


def narrow(source: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) ``start:start+length`` of a tensor, a safetensors slice
    or a CheckpointTensor."""
    return as_checkpoint(source).narrow(dim, start, length)


def _copy(param: torch.Tensor, piece: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(piece.shape):
        raise ValueError(
            f"{what}: checkpoint piece of shape {tuple(piece.shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(piece.to(param.dtype))


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LoRAHook(Protocol):
    """A layer's LoRA adapters (engine/lora/layers.py): adds each row's ``x A^T B^T`` to ``y`` in
    place, where the step has adapter rows."""

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None: ...


class RankRows(NamedTuple):
    """One output part's rows on this rank (a part: a merged layer's k-th matrix, or q, k or v):
    what an adapter's B is narrowed to, like the weight."""

    whole: int  # the part's rows in the checkpoint, every rank's
    start: int  # the first of them this rank computes
    length: int  # how many it computes
    at: int  # where they sit in this rank's output


class Packable:
    """``x W^T (+ b)`` on this rank's W: F.linear, or oneDNN on a packed copy once ``pack`` has
    run (kernels/cpu_linear.py's pack_linears, on the CPU), which drops the plain weight; or, once
    ``quantize`` has run, W8A8 on an int8 copy (kernels/cpu_int8.py: this rank's W, each output
    channel with its own scale). ``lora``: set by engine/lora on the qkv, gate_up, o and down
    projections when adapters are enabled; None (the default) costs nothing. An adapter's
    product is computed from the unquantized x, in the compute dtype, on a quantized base too."""

    packable = True
    quantizable = True  # the LM head sets False: it stays in the compute dtype
    packed_weight: torch.Tensor | None = None
    int8_weight: cpu_int8.Int8Weight | None = None
    weight: Any
    lora: LoRAHook | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.int8_weight is not None:
            return cpu_int8.int8_matmul(x, self.int8_weight, bias)
        if self.packed_weight is not None:
            return cpu_linear.packed_matmul(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)

    def pack(self) -> None:
        self.packed_weight = cpu_linear.pack_weight(self.weight)
        self.weight = None  # a tied head's embedding keeps its own reference

    def quantize(self) -> None:
        self.int8_weight = cpu_int8.pack_weight(self.weight)
        self.weight = None


class ColumnParallelLinear(Packable, nn.Module):
    """``y = x W^T + b`` with this rank's share of W's output rows (and of b): no communication."""

    def __init__(
        self, in_features: int, out_features: int, parallel: ParallelState, bias: bool = False
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.start, self.out_local = parallel.shard(out_features, "output features")
        self.weight = _parameter(self.out_local, in_features)  # [out / tp, in]
        self.weight.weight_loader = self.load_rows
        self.bias = _parameter(self.out_local) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_rows  # type: ignore[attr-defined]

    def load_rows(self, param: torch.Tensor, full: Any, shard: object = None) -> None:
        _copy(param, narrow(full, 0, self.start, self.out_local), "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out / tp]
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(Packable, nn.Module):
    """Several column-parallel matrices in one matmul (gate and up): this rank's rows of each, in
    order. ``weight_loader(param, full, k)`` fills part k from the checkpoint's k-th matrix."""

    def __init__(
        self, in_features: int, out_features: list[int], parallel: ParallelState, bias: bool = False
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.in_features = in_features
        self.shards = [
            parallel.shard(size, f"output features of part {k}") for k, size in enumerate(out_features)
        ]
        self.offsets = list(itertools.accumulate((n for _, n in self.shards), initial=0))
        self.fused_parts = list(enumerate(out_features))  # a fused checkpoint tensor's rows, by part
        self.weight = _parameter(self.offsets[-1], in_features)  # [sum(out_k) / tp, in]
        self.weight.weight_loader = self.load_part
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

    def rank_rows(self, part: object) -> RankRows:
        assert isinstance(part, int), part
        return RankRows(self.fused_parts[part][1], *self.shards[part], self.offsets[part])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_(x, y)
        return y


class QKVParallelLinear(Packable, nn.Module):
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
        self.in_features = hidden_size
        kv = kv_heads_of(num_kv_heads, parallel.tp_size, parallel.rank)
        q = query_heads_of(num_heads, num_kv_heads, parallel.tp_size, parallel.rank)
        q_start, self.num_heads = q.start, len(q)
        self.q_heads = q  # the model's query heads this rank computes (its KV heads' groups)
        self.num_kv_heads, self.head_dim = len(kv), head_dim
        # (checkpoint row start, rows) of each part, and where the part starts in this rank's rows
        self.parts = {
            "q": (q_start * head_dim, self.num_heads * head_dim, 0),
            "k": (kv.start * head_dim, len(kv) * head_dim, self.num_heads * head_dim),
            "v": (kv.start * head_dim, len(kv) * head_dim, (self.num_heads + len(kv)) * head_dim),
        }
        kv_rows = num_kv_heads * head_dim
        self.fused_parts = [("q", num_heads * head_dim), ("k", kv_rows), ("v", kv_rows)]  # whole rows
        rows = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.weight = _parameter(rows, hidden_size)  # [(H + 2 KVH) / tp * D, hidden]
        self.weight.weight_loader = self.load_part
        self.bias = _parameter(rows) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_part  # type: ignore[attr-defined]

    def load_part(self, param: torch.Tensor, full: Any, shard: object) -> None:
        start, length, at = self.parts[str(shard)]
        _copy(param[at : at + length], narrow(full, 0, start, length), f"{shard} projection")

    def rank_rows(self, part: object) -> RankRows:
        return RankRows(dict(self.fused_parts)[str(part)], *self.parts[str(part)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, (H + 2 KVH) / tp * D]
        y = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_(x, y)
        return y


class RowParallelLinear(Packable, nn.Module):
    """``y = x W^T + b`` with x and W's input columns split: each rank's partial product, summed
    over the ranks; the bias (whole on every rank) is added once, after the sum."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelState,
        bias: bool = False,
        columns: range | None = None,
    ) -> None:
        """``columns``: this rank's input features where they are not an even share (attention's
        output: the channels of the rank's query heads)."""
        super().__init__()
        self.parallel = parallel
        self.in_features, self.out_features = in_features, out_features
        if columns is None:
            self.start, self.in_local = parallel.shard(in_features, "input features")
        else:
            self.start, self.in_local = columns.start, len(columns)
        self.weight = _parameter(out_features, self.in_local)  # [out, in / tp]
        self.weight.weight_loader = self.load_columns
        self.bias = _parameter(out_features) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_bias  # type: ignore[attr-defined]

    def load_bias(self, param: torch.Tensor, full: Any, shard: object = None) -> None:
        _copy(param, as_checkpoint(full).read(), "bias")  # whole on every rank

    def load_columns(self, param: torch.Tensor, full: Any, shard: object = None) -> None:
        _copy(param, narrow(full, 1, self.start, self.in_local), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / tp] -> [T, out]
        y = self.matmul(x)
        if self.lora is not None:  # the rank's partial x_r A_r^T B^T: the all-reduce sums them too
            self.lora.add_(x, y)
        y = self.parallel.all_reduce(y)
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


class ParallelLMHead(Packable, VocabParallelEmbedding):
    """Logits of this rank's vocabulary range, gathered over the ranks, the padding cut off. A tied
    head takes the embedding's weight (``head.weight = embedding.weight``): the same range on every
    rank. Never quantized: the logits stay in the compute dtype."""

    quantizable = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab]
        local = self.matmul(hidden)  # [N, vocab_padded / tp]
        logits = self.parallel.all_gather(local, dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, : self.vocab_size].contiguous()
