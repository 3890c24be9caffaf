"""KV heads across tensor-parallel ranks (protocol/kv_layout.py): which heads a rank holds, which
ranks hold a head, and the plan that moves a prompt's KV from a prefill layout to a decode layout,
checked on every servable (heads, prefill tp, decode tp) of h in {1, 2, 3, 4, 6, 8}, tp in
{1, 2, 4, 8}: uneven shares (SmolLM2's 3 heads over 2 ranks) included."""

from __future__ import annotations

import itertools

import pytest

from pdserve.protocol.kv_layout import (
    HeadPiece,
    check_tp_layout,
    kv_heads_of,
    kv_owners,
    query_heads_of,
    transfer_plan,
)

HEADS = (1, 2, 3, 4, 6, 8)
TPS = (1, 2, 4, 8)


def _valid(h: int, tp: int) -> bool:
    return tp <= h or tp % h == 0


@pytest.mark.parametrize("h, tp", [(2, 3), (4, 6), (3, 4), (6, 8)])
def test_more_ranks_than_heads_and_not_a_multiple_is_refused_by_name(h, tp):
    with pytest.raises(ValueError, match=f"tensor-parallel size {tp} exceeds the model's {h} KV heads"):
        check_tp_layout(h, tp)


@pytest.mark.parametrize(("h", "tp", "held"), [(3, 2, [[0, 1], [2]]), (6, 4, [[0, 1], [2, 3], [4], [5]])])
def test_an_uneven_share_gives_the_first_ranks_one_more_head(h, tp, held):
    assert [list(kv_heads_of(h, tp, rank)) for rank in range(tp)] == held
    assert [list(query_heads_of(3 * h, h, tp, rank)) for rank in range(tp)] == [
        [q for k in heads for q in range(3 * k, 3 * k + 3)] for heads in held
    ]  # each rank's query heads: its KV heads' groups


@pytest.mark.parametrize("h, tp", [(h, tp) for h in HEADS for tp in TPS if _valid(h, tp)])
def test_ranks_hold_a_share_or_one_replicated_head_and_owners_agree(h, tp):
    held = [kv_heads_of(h, tp, rank) for rank in range(tp)]
    assert all(len(heads) in (max(1, h // tp), -(-h // tp)) for heads in held)
    assert sorted({x for heads in held for x in heads}) == list(range(h))  # every head somewhere
    for head in range(h):
        owners = kv_owners(h, tp, head)
        assert len(owners) == max(1, tp // h)  # its replicas
        assert list(owners) == [rank for rank in range(tp) if head in held[rank]]


@pytest.mark.parametrize(
    "h, p, d", [x for x in itertools.product(HEADS, TPS, TPS) if _valid(*x[:2]) and _valid(x[0], x[2])]
)
def test_each_decode_rank_receives_exactly_its_heads_once_from_ranks_that_hold_them(h, p, d):
    plan = transfer_plan(h, p, d)
    for dst in range(d):
        mine = kv_heads_of(h, d, dst)
        pieces = [piece for piece in plan if piece.dst_rank == dst]
        landed = [piece.dst_head + i for piece in pieces for i in range(piece.num_heads)]
        assert sorted(landed) == list(range(len(mine))), (dst, pieces)  # tiles its pool's heads once
        for piece in pieces:
            src_heads = kv_heads_of(h, p, piece.src_rank)
            assert 0 <= piece.src_head and piece.src_head + piece.num_heads <= len(src_heads)
            for i in range(piece.num_heads):  # the same model head on both sides
                assert src_heads[piece.src_head + i] == mine[piece.dst_head + i]


@pytest.mark.parametrize(
    "h, p, d, pieces",
    [
        (2, 1, 1, [(0, 0, 0, 0, 2)]),
        (2, 1, 2, [(0, 0, 0, 0, 1), (0, 1, 1, 0, 1)]),  # P0 splits its heads
        (2, 2, 1, [(0, 0, 0, 0, 1), (1, 0, 0, 1, 1)]),  # two pieces land in one pool
        (2, 2, 2, [(0, 0, 0, 0, 1), (1, 1, 0, 0, 1)]),
        (1, 1, 2, [(0, 0, 0, 0, 1), (0, 1, 0, 0, 1)]),  # fan-out: each decode rank gets the head
        (1, 2, 1, [(0, 0, 0, 0, 1)]),  # P1 holds a replica and sends nothing
        (1, 2, 2, [(0, 0, 0, 0, 1), (1, 1, 0, 0, 1)]),  # each decode rank from its own replica
        (8, 2, 4, [(0, 0, 0, 0, 2), (0, 1, 2, 0, 2), (1, 2, 0, 0, 2), (1, 3, 2, 0, 2)]),
    ],
)
def test_the_plans_of_the_parallel_plan_table(h, p, d, pieces):
    want = tuple(
        HeadPiece(src_rank=s, dst_rank=t, src_head=a, dst_head=b, num_heads=n) for s, t, a, b, n in pieces
    )
    assert transfer_plan(h, p, d) == want


@pytest.mark.parametrize(
    "h, p, d", [x for x in itertools.product(HEADS, TPS, TPS) if _valid(*x[:2]) and _valid(x[0], x[2])]
)
def test_heads_moved_are_the_decode_layouts_heads_and_no_more(h, p, d):
    moved = sum(piece.num_heads for piece in transfer_plan(h, p, d))
    assert moved == max(h, d)  # a replicated decode layout receives each replica
    if d <= h:
        assert moved == h  # the same bytes as a transfer between equal layouts
