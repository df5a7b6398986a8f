"""Packing: routes times pieces become transfers, in execution order, grouped into messages."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from wb.algorithms.planner.routes import Routes
from wb.data.correspondence import Correspondence
from wb.data.plan import Messages, Pieces, Transfers
from wb.data.plan.plan import SMALL_RUN_BYTES


class Moves(NamedTuple):
    """Every piece of every route, route after route: the transfers before they are ordered."""

    piece: np.ndarray  # (t,) int64 piece moved
    stage: np.ndarray  # (t,) int8 its route's stage
    after: np.ndarray  # (t,) int64 move that must deliver the piece to the source first; -1 none
    level: np.ndarray  # (t,) int64 its route's forwarding depth
    src_inc: np.ndarray  # (t,) int64 source incidence
    dst_inc: np.ndarray  # (t,) int64 destination incidence
    src_slot: np.ndarray  # (t,) int64
    dst_slot: np.ndarray  # (t,) int64
    src_rank: np.ndarray  # (t,) int64
    dst_rank: np.ndarray  # (t,) int64
    src_f0: np.ndarray  # (t,) int64 flat index of the piece's first element in the source
    dst_f0: np.ndarray  # (t,) int64 and in the destination
    nbytes: np.ndarray  # (t,) int64 bytes of the piece as it travels


def transfers_and_messages(corr: Correspondence, table, routes: Routes, pieces: Pieces,
                           chunk_bytes: int, pack_below: int = SMALL_RUN_BYTES
                           ) -> tuple[Transfers, Messages]:
    """Routes x pieces -> transfers in execution order, grouped into messages.

    Args:
        corr: the correspondence.
        table: ``slot_table(corr.slots, trainers, rollouts)[0]`` (:mod:`wb.data.plan`).
        routes: how each needed cell travels.
        pieces: every needed cell cut into pieces, sorted by cell.
        chunk_bytes: largest piece, in bytes; a message is cut where it passes this many.
        pack_below: contiguous ranges of fewer bytes travel packed (:func:`pack_small_ranges`).

    Returns:
        ``(transfers, messages)``.
    """
    moves = expand_routes(corr, table, routes, pieces)
    order, message, message_parent = message_order(moves, table.dtype[moves.dst_slot], pieces,
                                                   chunk_bytes, pack_below)
    n_moves = moves.piece.size
    position = np.empty(n_moves, np.int64)
    position[order] = np.arange(n_moves)
    after = moves.after[order]
    after = np.where(after >= 0, position[np.maximum(after, 0)], -1)
    message = message[order]
    src_inc, dst_inc = moves.src_inc[order], moves.dst_inc[order]
    transfers = Transfers(
        stage=moves.stage[order], piece=moves.piece[order],
        src_slot=moves.src_slot[order], src_f0=moves.src_f0[order],
        src_fa=corr.inc_fa[src_inc], src_fb=corr.inc_fb[src_inc],
        dst_slot=moves.dst_slot[order], dst_f0=moves.dst_f0[order],
        dst_fa=corr.inc_fa[dst_inc], dst_fb=corr.inc_fb[dst_inc],
        after=after, message=message, src_inc=src_inc, dst_inc=dst_inc)
    n_messages = message_parent.size
    first = np.searchsorted(message, np.arange(n_messages))  # transfers sort by message
    nbytes = np.bincount(message, weights=moves.nbytes[order], minlength=n_messages)
    messages = Messages(
        stage=transfers.stage[first], src_rank=moves.src_rank[order][first],
        dst_rank=moves.dst_rank[order][first], nbytes=nbytes.astype(np.int64),
        parent=message_parent, first=first, count=np.bincount(message, minlength=n_messages))
    return transfers, messages


def expand_routes(corr: Correspondence, table, routes: Routes, pieces: Pieces) -> Moves:
    """Each route as one move per piece of its cell; a forwarded piece waits for the same piece
    of the parent route."""
    pieces_per_cell = np.bincount(pieces.cell, minlength=corr.cell_id0.size)
    first_piece = np.r_[0, np.cumsum(pieces_per_cell)[:-1]]  # pieces are sorted by cell
    pieces_per_route = pieces_per_cell[routes.cell]
    route = np.repeat(np.arange(routes.cell.size), pieces_per_route)
    before_route = np.cumsum(pieces_per_route) - pieces_per_route
    number = np.arange(route.size) - np.repeat(before_route, pieces_per_route)  # within the cell
    first_move = np.r_[0, np.cumsum(pieces_per_route)[:-1]]  # of each route
    piece = first_piece[routes.cell[route]] + number
    parent = routes.parent[route]
    after = np.where(parent >= 0, first_move[np.maximum(parent, 0)] + number, -1)
    src_inc, dst_inc = routes.src[route], routes.dst[route]
    src_slot, dst_slot = corr.inc_slot[src_inc], corr.inc_slot[dst_inc]
    i0, j0 = pieces.i0[piece], pieces.j0[piece]
    return Moves(
        piece=piece, stage=routes.stage[route].astype(np.int8), after=after,
        level=routes.level[route], src_inc=src_inc, dst_inc=dst_inc,
        src_slot=src_slot, dst_slot=dst_slot,
        src_rank=table.rank[src_slot], dst_rank=table.rank[dst_slot],
        src_f0=corr.inc_f0[src_inc] + i0 * corr.inc_fa[src_inc] + j0 * corr.inc_fb[src_inc],
        dst_f0=corr.inc_f0[dst_inc] + i0 * corr.inc_fa[dst_inc] + j0 * corr.inc_fb[dst_inc],
        nbytes=pieces.nbytes[piece])


def message_order(moves: Moves, dst_dtype: np.ndarray, pieces: Pieces, chunk_bytes: int,
                  pack_below: int = SMALL_RUN_BYTES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The moves in execution order and their messages, numbered level by level (a forwarded
    message names the message it waits for, numbered at the level before).

    Level 0 groups moves by pair of ranks; a forwarding level by the message it waits for and
    the destination rank. Within a group, pieces go in destination-buffer order: consecutive
    pieces then often form one contiguous range of the buffer, which the executor receives
    without staging.

    Returns:
        ``(order, message, message_parent)``: ``(t,) int64`` moves in execution order,
        ``(t,) int64`` message of each move (indexed as ``moves``), ``(m,) int64`` message
        each message waits for, -1 none.
    """
    message = np.full(moves.piece.size, -1, np.int64)
    order: list[np.ndarray] = []
    message_parent: list[np.ndarray] = []
    numbered = 0
    for level in range(int(moves.level.max(initial=-1)) + 1):
        at = np.flatnonzero(moves.level == level)
        if level == 0:
            at = at[np.lexsort((moves.dst_f0[at], moves.dst_slot[at], moves.dst_rank[at],
                                moves.src_rank[at]))]
            pair = (moves.src_rank[at] * (int(moves.dst_rank.max(initial=0)) + 1)
                    + moves.dst_rank[at])
            starts_group = np.r_[True, pair[1:] != pair[:-1]]
            parent = np.full(at.size, -1, np.int64)
        else:
            waits_for = message[moves.after[at]]
            by = np.lexsort((moves.dst_f0[at], moves.dst_slot[at], moves.dst_rank[at], waits_for))
            at, parent = at[by], waits_for[by]
            dst_rank = moves.dst_rank[at]
            starts_group = np.r_[True, (parent[1:] != parent[:-1])
                                 | (dst_rank[1:] != dst_rank[:-1])]
        at, starts, parent = pack_small_ranges(at, starts_group, parent, moves, dst_dtype, pieces,
                                               pack_below)
        # A message is cut every chunk_bytes of its pieces, at a piece's start.
        nbytes = moves.nbytes[at]
        offset = np.cumsum(nbytes) - nbytes
        range_offset = offset - np.maximum.accumulate(np.where(starts, offset, 0))
        chunk = range_offset // chunk_bytes
        starts_message = starts | np.r_[True, chunk[1:] != chunk[:-1]]
        message[at] = numbered + np.cumsum(starts_message) - 1
        message_parent.append(parent[starts_message])
        numbered += int(starts_message.sum())
        order.append(at)
    return (np.concatenate(order) if order else np.zeros(0, np.int64), message,
            np.concatenate(message_parent) if message_parent else np.zeros(0, np.int64))


def pack_small_ranges(at: np.ndarray, starts_group: np.ndarray, parent: np.ndarray, moves: Moves,
                      dst_dtype: np.ndarray, pieces: Pieces, pack_below: int = SMALL_RUN_BYTES
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where messages start within groups of moves (a pair of ranks, or a parent message and a
    destination rank), each group's moves in destination order.

    A message ends where the destination stops being one contiguous range (another buffer, or a
    gap): such a message is received in place, without staging. Ranges of less than
    ``pack_below`` bytes (:data:`~wb.data.plan.plan.SMALL_RUN_BYTES` unless told) would each
    cost a message of their own (a scale tensor per expert, a bias, a norm: thousands per rank
    where each costs more than its bytes), so they go after the group's large ranges, packed
    together into staged messages of one travelling and one destination dtype (a message packs
    and unpacks aligned in one of each).

    Args:
        at: ``(k,) int64`` moves, group after group, each in destination order.
        starts_group: ``(k,) bool`` where a group starts.
        parent: ``(k,) int64`` the message each move waits for, -1 none.
        moves: all moves.
        dst_dtype: ``(t,) int64`` destination dtype code of every move.
        pieces: the pieces.
        pack_below: see above.

    Returns:
        ``(at, starts_message, parent)``: ``at`` and ``parent`` reordered (small ranges after
        the large ones of their group), and where each message starts.
    """
    elements = (pieces.na * pieces.nb)[moves.piece[at]]
    wire_dtype, dst_dtype = pieces.dtype[moves.piece[at]], dst_dtype[at]
    dst_slot, dst_f0 = moves.dst_slot[at], moves.dst_f0[at]
    starts_range = starts_group.copy()
    starts_range[1:] |= ((dst_slot[1:] != dst_slot[:-1])
                         | (dst_f0[1:] != dst_f0[:-1] + elements[:-1])
                         | (wire_dtype[1:] != wire_dtype[:-1]))
    range_of_move = np.cumsum(starts_range) - 1
    small = (np.bincount(range_of_move, weights=moves.nbytes[at]) < pack_below)[range_of_move]
    group = np.cumsum(starts_group) - 1
    order = np.lexsort((np.arange(at.size), np.where(small, dst_dtype, -1),
                        np.where(small, wire_dtype, -1), small, group))
    at, starts_range, parent = at[order], starts_range[order], parent[order]
    small, group = small[order], group[order]
    wire_dtype, dst_dtype = wire_dtype[order], dst_dtype[order]
    starts_message = np.where(small, False, starts_range)
    starts_message[1:] |= ((group[1:] != group[:-1]) | (small[1:] != small[:-1])
                           | (wire_dtype[1:] != wire_dtype[:-1])
                           | (dst_dtype[1:] != dst_dtype[:-1]))
    starts_message[:1] = True
    return at, starts_message, parent
