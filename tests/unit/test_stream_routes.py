"""The weight stream's plan, one process: where a block lies in a bucket (against torch's own views),
and who fills, sends and receives which block on a 4-rank HSDP-like layout (two replicas of two row
shards), a per-expert layout whose blocks join into one transfer, and a plain tensor."""

from __future__ import annotations

import itertools

import torch

from shardtune.checkpoint.storage.writer import WriteItem
from shardtune.inference.stream import _contiguous_start, _Move, _route, _runs
from shardtune.state_dict.layout import Piece, TensorLayout


def test_contiguous_start_agrees_with_torch_views():
    shape = (3, 4, 5)
    full = torch.empty(shape, dtype=torch.float32)
    for offset in itertools.product(range(3), range(4), range(5)):
        for size in itertools.product(range(1, 4), range(1, 5), range(1, 6)):
            if any(o + n > s for o, n, s in zip(offset, size, shape)):
                continue
            piece = Piece(shape=size, offset=offset)
            view = full[piece.slices]
            got = _contiguous_start(piece, shape, 100, 4)
            if view.is_contiguous():
                assert got == 100 + view.storage_offset() * 4, piece
            else:
                assert got is None, piece


def _item(name: str, shape: tuple[int, ...], pieces: tuple[Piece, ...] | None) -> WriteItem:
    return WriteItem(name, torch.empty(0), torch.float32, TensorLayout(shape=shape, pieces=pieces))


def test_hsdp_replicas_fill_their_own_rows_and_receive_the_others_from_the_lowest_holder():
    top, bottom = Piece((2, 4), (0, 0)), Piece((2, 4), (2, 0))
    items = [(_item("w", (4, 4), (top, bottom, top, bottom)), 0)]
    routes = {me: _route(items, [0, 1, 2, 3], me, 4) for me in range(4)}
    assert routes[2].fills == [(0, top)] and routes[3].fills == [(0, bottom)]
    assert {p: [(m.piece, m.start) for m in ms] for p, ms in routes[2].recvs.items()} == {1: [(bottom, 32)]}
    assert sorted(routes[1].sends) == [0, 2] and sorted(routes[0].sends) == [1, 3]  # never to a holder
    assert not routes[2].sends and not routes[3].sends  # replicas above the lowest send nothing
    to_rank0 = {me: _route(items, [0], me, 4) for me in range(4)}
    assert sorted(to_rank0[1].sends) == [0] and not to_rank0[3].sends and not to_rank0[2].recvs


def test_a_ranks_per_expert_blocks_join_into_one_transfer_and_plain_tensors_move_not_at_all():
    # four experts' [2, 3] weights, experts 0-1 on rank 0 and 2-3 on rank 1, adjacent in the bucket
    whole, empty = Piece((2, 3), (0, 0)), Piece((0, 3), (0, 0))
    items = [(_item(f"e{e}", (2, 3), (whole, empty) if e < 2 else (empty, whole)), 24 * e) for e in range(4)]
    sends = _route(items, [0, 1], 1, 2).sends[0]
    assert [[m.item for m in run] for run in _runs(sends)] == [[2, 3]]
    plain = [(_item("norm", (3,), None), 0)]
    assert all(not _route(plain, [0, 1], me, 2).sends and not _route(plain, [0, 1], me, 2).recvs for me in (0, 1))
    assert _runs([_Move(0, Piece((1,), (0,)), None, 4), _Move(1, Piece((1,), (0,)), None, 4)]) == [
        [_Move(0, Piece((1,), (0,)), None, 4)],
        [_Move(1, Piece((1,), (0,)), None, 4)],
    ]
