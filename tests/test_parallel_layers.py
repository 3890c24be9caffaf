"""engine/layers/linear.py at tp=2 in two real gloo ranks: each layer, loaded through its weight
loaders from the whole checkpoint tensors (and from safetensors' lazy slices, so a rank reads only
its rows), computes on each rank what nn.Linear / nn.Embedding compute on the whole weights."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from pdserve.engine.executor.parallel import SINGLE, close_parallel, init_parallel
from pdserve.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab,
)
from pdserve.launcher.ports import free_port
from pdserve.protocol.kv_layout import kv_heads_of

CONTEXT = multiprocessing.get_context("spawn")
TOLERANCE = 1e-5


def _full() -> dict[str, torch.Tensor]:
    """The whole checkpoint: the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "col.w": r(12, 16), "col.b": r(12),
        "gate.w": r(10, 16), "up.w": r(10, 16),
        "q.w": r(16, 16), "k.w": r(8, 16), "v.w": r(8, 16), "k1.w": r(4, 16), "v1.w": r(4, 16),
        "row.w": r(8, 12), "row.b": r(8),
        "emb.w": r(50, 8), "head.w": r(50, 8),
        "x16": r(5, 16), "x12": r(5, 12), "h8": r(5, 8),
    }  # fmt: skip


def _load(param: torch.Tensor, source, shard=None) -> None:
    param.weight_loader(param, source, shard)


def _check_rank(rank: int, port: int, folder: str, results) -> None:
    torch.set_num_threads(1)
    state = init_parallel(2, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60)
    try:
        results.put((rank, _errors(state, rank, folder)))
    finally:
        close_parallel(state)


def _errors(state, rank: int, folder: str) -> dict[str, float]:
    w = _full()
    lazy = safe_open(f"{folder}/full.safetensors", framework="pt")
    err = {}

    col = ColumnParallelLinear(16, 12, state, bias=True)
    _load(col.weight, lazy.get_slice("col.w"))  # a rank reads its rows of the file only
    _load(col.bias, lazy.get_slice("col.b"))
    want = nn.functional.linear(w["x16"], w["col.w"], w["col.b"])[:, rank * 6 : (rank + 1) * 6]
    err["column"] = (col(w["x16"]) - want).abs().max().item()

    merged = MergedColumnParallelLinear(16, [10, 10], state)
    _load(merged.weight, w["gate.w"], 0)
    _load(merged.weight, w["up.w"], 1)
    half = slice(rank * 5, (rank + 1) * 5)
    want = torch.cat([w["x16"] @ w["gate.w"][half].T, w["x16"] @ w["up.w"][half].T], dim=1)
    err["merged"] = (merged(w["x16"]) - want).abs().max().item()

    for kv_heads, k, v in ((2, "k.w", "v.w"), (1, "k1.w", "v1.w")):  # GQA split; one head replicated
        qkv = QKVParallelLinear(16, 4, 4, kv_heads, state)
        for name, shard in (("q.w", "q"), (k, "k"), (v, "v")):
            _load(qkv.weight, w[name], shard)
        heads = kv_heads_of(kv_heads, 2, rank)
        rows = slice(heads.start * 4, heads.stop * 4)
        want = torch.cat(
            [
                w["x16"] @ w["q.w"][rank * 8 : (rank + 1) * 8].T,
                w["x16"] @ w[k][rows].T,
                w["x16"] @ w[v][rows].T,
            ],
            1,
        )
        err[f"qkv-{kv_heads}-kv"] = (qkv(w["x16"]) - want).abs().max().item()

    row = RowParallelLinear(12, 8, state, bias=True)
    _load(row.weight, lazy.get_slice("row.w"))  # its columns only
    _load(row.bias, w["row.b"])
    x_local = w["x12"][:, rank * 6 : (rank + 1) * 6]
    err["row"] = (row(x_local) - nn.functional.linear(w["x12"], w["row.w"], w["row.b"])).abs().max().item()

    emb = VocabParallelEmbedding(50, 8, state)  # 50 rows: padded to 128, 64 on each rank
    _load(emb.weight, lazy.get_slice("emb.w"))
    ids = torch.tensor([0, 49, 17, 33, 2])
    err["embedding"] = (emb(ids) - w["emb.w"][ids]).abs().max().item()

    head = ParallelLMHead(50, 8, state)
    _load(head.weight, w["head.w"])
    err["head"] = (head(w["h8"]) - w["h8"] @ w["head.w"].T).abs().max().item()
    tied = ParallelLMHead(50, 8, state)
    tied.weight = emb.weight
    err["tied-head"] = (tied(w["h8"]) - w["h8"] @ w["emb.w"].T).abs().max().item()
    return err


@pytest.mark.usefixtures("processes")
def test_every_parallel_layer_at_tp2_computes_what_the_whole_layer_does(tmp_path):
    save_file({k: v.contiguous() for k, v in _full().items()}, str(tmp_path / "full.safetensors"))
    results = CONTEXT.Queue()
    port = free_port()
    procs = [
        CONTEXT.Process(target=_check_rank, args=(rank, port, str(tmp_path), results)) for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    try:
        errors = dict(results.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    for rank, errs in errors.items():
        assert all(e < TOLERANCE for e in errs.values()), (rank, errs)
    assert sorted(errors) == [0, 1] and len(errors[0]) == 8  # every layer, on both ranks


def test_at_tp1_the_layers_are_the_whole_layers_and_the_padding_never_wins():
    w = _full()
    qkv = QKVParallelLinear(16, 4, 4, 2, SINGLE)
    for name, shard in (("q.w", "q"), ("k.w", "k"), ("v.w", "v")):
        _load(qkv.weight, w[name], shard)
    whole = torch.cat([w["q.w"], w["k.w"], w["v.w"]])
    assert torch.equal(qkv.weight, whole)
    head = ParallelLMHead(50, 8, SINGLE)
    _load(head.weight, w["head.w"])
    assert head.weight.shape[0] == padded_vocab(50, 1) == 64 and not head.weight[50:].any()
    assert head(w["h8"]).shape == (5, 50)  # the padding rows are cut off, never sampled


def test_a_split_that_is_not_even_is_refused_naming_the_flag():
    from pdserve.engine.executor.parallel import ParallelState

    class _TwoRanks(ParallelState):
        def __post_init__(self) -> None:  # no group needed to size a layer
            pass

    with pytest.raises(ValueError, match="attention heads: 6 does not split over --tensor-parallel-size 4"):
        QKVParallelLinear(16, 4, 6, 2, _TwoRanks(tp_size=4, rank=0))
    with pytest.raises(ValueError, match="tensor-parallel size 4 exceeds the model's 3 KV heads"):
        QKVParallelLinear(16, 4, 12, 3, _TwoRanks(tp_size=4, rank=0))
