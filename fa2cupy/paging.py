"""Paged K/V <-> packed K/V on the device, for the paged varlen backward.

The varlen forward reads pages in place (cuda/fwd.cu); its backward gathers each sequence's keys into packed
rows, runs the packed backward and sums dk/dv back onto the pages. Everything here is array-module generic
(``xp`` is cupy on the GPU, numpy in the CPU tests) and needs no host synchronisation: the packed arrays have
``batch * max_seqlen_k`` rows, an upper bound on the keys, and rows past the last sequence stay zero.
"""

from __future__ import annotations


def key_pages(xp, cu_seqlens_k, block_table, rows: int, page_size: int, num_pages: int):
    """Where each packed key row lives: ``(packed_cu_seqlens_k, page, slot, inside)``.

    Packed row ``t`` is key ``j`` of sequence ``b`` with the sequences renumbered from row 0
    (``packed_cu_seqlens_k = cu_seqlens_k - cu_seqlens_k[0]``); it lives in row ``slot[t]`` of page ``page[t]``.
    ``inside[t]`` is False for rows past the last sequence and for keys whose page index is not a page (the
    forward reported those); their page and slot are 0, so indexing with them stays in bounds.
    """
    batch, max_pages = block_table.shape
    packed_cu = cu_seqlens_k - cu_seqlens_k[0]
    t = xp.arange(rows, dtype=xp.int32)
    b = xp.searchsorted(packed_cu[1:], t, side="right").astype(xp.int32)
    inside = b < batch
    b = xp.minimum(b, batch - 1)
    j = t - packed_cu[b]
    page_idx = j // page_size
    inside &= (j >= 0) & (page_idx < max_pages)
    page = block_table[b, xp.clip(page_idx, 0, max_pages - 1)]
    inside &= (page >= 0) & (page < num_pages)
    return packed_cu, xp.where(inside, page, 0), xp.where(inside, j % page_size, 0), inside


def gather(xp, pages, page, slot, inside):
    """Packed ``(rows, heads, d)`` copy of the keys (or values) at ``page``/``slot``; zero where not inside."""
    return xp.where(inside[:, None, None], pages[page, slot], xp.zeros((), pages.dtype))


def sum_onto_pages(xp, scatter_add, grad, pages_shape, page, slot, inside):
    """The packed gradient rows summed onto the page rows they came from, in float32, returned in grad's dtype (a
    page shared by several sequences gets all their rows; rows no key came from are 0); ``scatter_add(a, index,
    values)`` accumulates in place (``cupyx.scatter_add`` / ``numpy.add.at``)."""
    summed = xp.zeros(pages_shape, dtype=xp.float32)
    scatter_add(summed, (page, slot), xp.where(inside[:, None, None], to_float32(xp, grad), 0.0))
    return from_float32(xp, summed, grad.dtype)


def to_float32(xp, x):
    """x (float16 / bfloat16 / float32) as float32; bfloat16 through its bits (exact: the high half of a float32)."""
    if x.dtype.name != "bfloat16":
        return x.astype(xp.float32)
    return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def from_float32(xp, x, dtype):
    """float32 x rounded to ``dtype`` (nearest, ties to even); bfloat16 through the bits, finite values only."""
    if getattr(dtype, "name", dtype) != "bfloat16":
        return x.astype(dtype)
    bits = xp.ascontiguousarray(x).view(xp.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return rounded.astype(xp.uint16).view(dtype)
