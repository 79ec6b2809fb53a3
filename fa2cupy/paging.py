"""Paged K/V <-> packed K/V on the device, for the paged varlen backward.

The varlen forward reads pages in place (cuda/fwd.cu); its backward gathers each sequence's keys into packed
rows, runs the packed backward and sums dk/dv back onto the pages. Everything here is array-module generic
(``xp`` is cupy on the GPU, numpy in the CPU tests) and needs no host synchronisation: the packed arrays have
``batch * max_seqlen_k`` rows, an upper bound on the keys, and rows past the last sequence stay zero.
"""

from __future__ import annotations

from .arrays import bf16_bits, bf16_bits_to_float


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
    """Packed ``(rows, heads, d)`` copy of the keys (or values) at ``page``/``slot``; zero where not inside, in
    pages' dtype (selected on the raw bits: ``where`` promotes a bfloat16 array from torch to float32 in CuPy)."""
    picked = pages[page, slot]
    bits = picked.view(f"uint{8 * picked.itemsize}")
    return xp.where(inside[:, None, None], bits, bits.dtype.type(0)).view(pages.dtype)


def sum_onto_pages(xp, grad, pages_shape, page, slot, inside):
    """The packed gradient rows summed onto the page rows they came from, in float32 (float64 for float64 grads),
    returned in grad's dtype (a page shared by several sequences gets all their rows; rows no key came from are 0).
    ``xp.add.at`` accumulates (CuPy's and NumPy's alike; ``cupyx.scatter_add`` is deprecated since CuPy 14)."""
    if grad.dtype == xp.float64:
        summed = xp.zeros(pages_shape, dtype=xp.float64)
        xp.add.at(summed, (page, slot), xp.where(inside[:, None, None], grad, 0.0))
        return summed
    summed = xp.zeros(pages_shape, dtype=xp.float32)
    xp.add.at(summed, (page, slot), xp.where(inside[:, None, None], to_float32(xp, grad), 0.0))
    return from_float32(xp, summed, grad.dtype)


def to_float32(xp, x):
    """x (float16 / bfloat16 / float32) as float32; bfloat16 through its bits (arrays.bf16_bits_to_float)."""
    if x.dtype.name != "bfloat16":
        return x.astype(xp.float32)
    return bf16_bits_to_float(xp, x.view(xp.uint16))


def from_float32(xp, x, dtype):
    """float32 x rounded to ``dtype`` (nearest, ties to even); bfloat16 through the bits (arrays.bf16_bits)."""
    if getattr(dtype, "name", dtype) != "bfloat16":
        return x.astype(dtype)
    return bf16_bits(xp, x).view(dtype)


# ---- layouts for tests and benchmarks (host-side; NumPy block tables) ------------------------------------------


def shuffled_block_table(rng, lengths, page_size: int, spare_pages: int = 0, spare_columns: int = 0,
                         share_first_page: bool = False, unused: int = -1):
    """``(block_table, num_pages)``: int32 ``(batch, max_pages + spare_columns)`` page indices for sequences of
    ``lengths`` keys on pages of ``page_size`` rows, drawn in a random order (NumPy Generator ``rng``) from a pool
    with ``spare_pages`` pages no sequence uses; entries past a sequence's pages hold ``unused``. With
    ``share_first_page`` every sequence's first page is sequence 0's (prefix sharing)."""
    import numpy as np

    need = [-(-int(n) // page_size) for n in lengths]
    num_pages = sum(need) + spare_pages
    order = iter(rng.permutation(num_pages).tolist())
    table = np.full((len(need), max(need + [1]) + spare_columns), unused, np.int32)
    for b, n in enumerate(need):
        for p in range(n):
            table[b, p] = table[0, 0] if share_first_page and b > 0 and p == 0 else next(order)
    return table, num_pages


def write_pages(xp, pages, packed, cu_seqlens, block_table) -> None:
    """Stores sequence b's rows of ``packed`` (``cu_seqlens[b]:cu_seqlens[b + 1]``, host ints) into the page pool
    ``pages`` ``(num_pages, page_size, ...)`` where the host ``block_table`` puts them."""
    page_size = pages.shape[1]
    for b in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        j = xp.arange(end - start)
        pages[xp.asarray(block_table[b])[j // page_size], j % page_size] = packed[start:end]
