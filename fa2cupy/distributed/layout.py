"""Where each rank's slice of a sequence lies, and which attention calls one ring step needs: position arithmetic
only (no torch, no GPU), shared by the ring attention (:mod:`fa2cupy.distributed.ring`) and its tests.

A layout splits a sequence of ``seqlen`` tokens among ``world`` ranks into *segments*, runs of consecutive positions
``(start, length)``; a rank's local tensor is its segments concatenated in order (each in increasing position):

* ``"contiguous"``: rank r holds ``[r n, (r + 1) n)`` with n = seqlen / world. Causal attention is unbalanced there:
  the last rank attends to every key, the first to its own.
* ``"zigzag"``: the sequence cut into 2 world chunks of c = seqlen / (2 world); rank r holds chunks r and
  2 world - 1 - r, an early and a late one, so that every rank has the same causal work at every ring step.

One ring step pairs the rank's query segments with the key segments of the slice in hand (another rank's). A pair
needs one kernel call over the rectangle of rows and keys that see each other (none: no call), with the window
relative to that rectangle, where flash-attn's bottom-right alignment puts it: :func:`block_call`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LAYOUTS", "BlockCall", "VarlenCall", "block_call", "segments", "step_calls", "varlen_step_calls"]

LAYOUTS = ("zigzag", "contiguous")


def segments(layout: str, seqlen: int, world: int, rank: int) -> list[tuple[int, int]]:
    """The ``(start, length)`` runs of positions rank ``rank`` of ``world`` holds of a ``seqlen``-token sequence, in
    the order of its local tensor. Raises ValueError where the layout cannot split ``seqlen`` evenly."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world) with world >= 1, got rank {rank} of {world}")
    parts = world if layout == "contiguous" else 2 * world
    if seqlen < parts or seqlen % parts:
        raise ValueError(f"layout {layout!r} over {world} ranks cuts the sequence into {parts} equal parts: seqlen "
                         f"must be a positive multiple of {parts}, got {seqlen}")
    size = seqlen // parts
    if layout == "contiguous":
        return [(rank * size, size)]
    return [(rank * size, size), ((parts - 1 - rank) * size, size)]


@dataclass(frozen=True)
class BlockCall:
    """One kernel call of a ring step: query rows ``[q_start, q_stop)`` and key rows ``[k_start, k_stop)`` of the
    local query tensor and of the key slice in hand, with fa2cupy's ``window_size`` (bottom-right aligned within
    those rows; ``(-1, -1)`` when every row sees every key)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    window: tuple[int, int]


def block_call(q_segment: tuple[int, int], k_segment: tuple[int, int], left: int, right: int,
               q_offset: int = 0, k_offset: int = 0) -> BlockCall | None:
    """The call for query segment ``(start, length)`` against key segment ``(start, length)`` under the window
    ``(left, right)`` of the whole sequence (-1: no limit on that side; causal is ``right = 0``), or None where no
    query of the one sees a key of the other. ``q_offset``/``k_offset``: where the segments start in their local
    tensors (added to the call's rows).

    Query position p sees key position t iff ``p - left <= t <= p + right``. Within the pair, row i and key j (from
    the segments' starts) see each other iff ``lo <= j - i <= hi`` with ``lo = qs - ks - left``, ``hi = qs - ks +
    right``. The rows with a visible key and the keys visible to some row are intervals; over that rectangle the
    last row sees the last key (both bounds of the band only grow with the row), so the band holds the rectangle's
    bottom-right corner, and with ``diag`` = keys - rows the window relative to it, ``(diag - lo', hi' - diag)``,
    has no negative side: a window fa2cupy takes.
    """
    (qs, nq), (ks, nk) = q_segment, k_segment
    inf = nq + nk + 1  # beyond any j - i in the pair: "no limit"
    lo = qs - ks - left if left >= 0 else -inf
    hi = qs - ks + right if right >= 0 else inf
    i0, i1 = max(0, -hi), min(nq, nk - lo)
    j0, j1 = max(0, lo), min(nk, nq + hi)
    if i0 >= i1 or j0 >= j1:
        return None
    rows, keys = i1 - i0, j1 - j0
    diag = keys - rows
    lo, hi = lo - j0 + i0, hi - j0 + i0  # in the rectangle's coordinates
    # a side is unlimited where it reaches past every pair of the rectangle
    new_left = -1 if lo <= -(rows - 1) else diag - lo
    new_right = -1 if hi >= keys - 1 else hi - diag
    return BlockCall(q_offset + i0, q_offset + i1, k_offset + j0, k_offset + j1, (new_left, new_right))


def step_calls(q_segments, k_segments, left: int, right: int) -> list[BlockCall]:
    """Every call of one ring step: each query segment of the rank against each key segment of the slice in hand,
    rows and keys counted in the concatenated local tensors. Calls without a window that share their rows and
    meet on their keys (or share their keys and meet on their rows) are one call: fewer, larger kernel calls and
    fewer merges (zigzag's off-diagonal steps are one call each). A causal step against the rank's own slice is one
    causal call: its positions increase along the local tensor, so position order is local order."""
    if left < 0 and right == 0 and list(q_segments) == list(k_segments):
        n = sum(length for _, length in q_segments)
        return [BlockCall(0, n, 0, n, (-1, 0))]
    calls = []
    q_offset = 0
    for q_segment in q_segments:
        k_offset = 0
        for k_segment in k_segments:
            call = block_call(q_segment, k_segment, left, right, q_offset, k_offset)
            if call is not None:
                calls.append(call)
            k_offset += k_segment[1]
        q_offset += q_segment[1]
    return _coalesce(calls)


def _coalesce(calls: list[BlockCall]) -> list[BlockCall]:
    full = (-1, -1)
    merged = True
    while merged:
        merged = False
        for a in range(len(calls)):
            for b in range(len(calls)):
                x, y = calls[a], calls[b]
                if a == b or x.window != full or y.window != full:
                    continue
                if (x.q_start, x.q_stop) == (y.q_start, y.q_stop) and x.k_stop == y.k_start:
                    joined = BlockCall(x.q_start, x.q_stop, x.k_start, y.k_stop, full)
                elif (x.k_start, x.k_stop) == (y.k_start, y.k_stop) and x.q_stop == y.q_start:
                    joined = BlockCall(x.q_start, y.q_stop, x.k_start, x.k_stop, full)
                else:
                    continue
                calls = [c for i, c in enumerate(calls) if i not in (a, b)] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(calls, key=lambda c: (c.q_start, c.k_start))


@dataclass(frozen=True)
class VarlenCall:
    """One varlen kernel call of a ring step over packed documents: query rows ``[q_start, q_stop)`` and key rows
    ``[k_start, k_stop)`` of the local tensors cut into sequences of ``lengths_q[i]`` rows and ``lengths_k[i]`` keys
    (cu_seqlens from them), all under one ``window``. The pieces of documents are sequences; the rows and keys between
    two pieces are sequences of their own with no keys or no rows (their rows see nothing: lse +inf)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    window: tuple[int, int]
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]


def varlen_step_calls(q_segments, k_segments, cu_seqlens, left: int, right: int) -> list[VarlenCall]:
    """The calls of one ring step over packed documents (``cu_seqlens``: the whole packed sequence's document
    bounds): a query attends to keys of its own document only, under the window within it. For each pair of
    segments, each document's piece of the one against its piece of the other is a :func:`block_call` rectangle;
    the rectangles of one pair that share a window are one varlen call (documents in order, so their rows and keys
    increase together)."""
    bounds = list(cu_seqlens)
    calls = []
    q_offset = 0
    for qs, nq in q_segments:
        k_offset = 0
        for ks, nk in k_segments:
            by_window: dict[tuple[int, int], list[BlockCall]] = {}
            for ds, de in zip(bounds[:-1], bounds[1:]):
                q0, q1 = max(qs, ds), min(qs + nq, de)
                k0, k1 = max(ks, ds), min(ks + nk, de)
                if q0 >= q1 or k0 >= k1:
                    continue
                call = block_call((q0, q1 - q0), (k0, k1 - k0), left, right, q_offset + q0 - qs,
                                  k_offset + k0 - ks)
                if call is not None:
                    by_window.setdefault(call.window, []).append(call)
            for window, pieces in by_window.items():
                calls.append(_varlen_call(window, pieces))
            k_offset += nk
        q_offset += nq
    return calls


def _varlen_call(window, pieces: list[BlockCall]) -> VarlenCall:
    lengths_q, lengths_k = [], []
    q_at, k_at = pieces[0].q_start, pieces[0].k_start
    for p in pieces:
        if p.q_start > q_at:  # rows between pieces: a sequence with no keys
            lengths_q.append(p.q_start - q_at)
            lengths_k.append(0)
        if p.k_start > k_at:  # keys between pieces: a sequence with no rows
            lengths_q.append(0)
            lengths_k.append(p.k_start - k_at)
        lengths_q.append(p.q_stop - p.q_start)
        lengths_k.append(p.k_stop - p.k_start)
        q_at, k_at = p.q_stop, p.k_stop
    return VarlenCall(pieces[0].q_start, q_at, pieces[0].k_start, k_at, window, tuple(lengths_q), tuple(lengths_k))

