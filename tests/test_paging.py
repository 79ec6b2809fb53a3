"""CPU tests of the paged varlen helpers: the page/slot map of packed key rows (fa2cupy.paging, run here with
NumPy, on the GPU with CuPy), the gather and the gradient sum onto pages, and the fast divisor the forward kernel
uses for page indices (FastDiv in cuda/common/fast_div.cuh)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa2cupy import paging
from fa2cupy.forward import fast_divisor


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 70), min_size=1, max_size=5), page_size=st.sampled_from([1, 3, 16, 32]),
       start=st.integers(0, 9), share=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_key_pages_gather_and_sum(lengths, page_size, start, share, seed):
    rng = np.random.default_rng(seed)
    if share:
        lengths = [max(n, page_size) for n in lengths]  # every sequence has the shared first page
    table, num_pages = paging.shuffled_block_table(rng, lengths, page_size, spare_pages=2, spare_columns=1,
                                                   share_first_page=share, unused=-3)
    cu = (start + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)  # need not start at 0
    rows = len(lengths) * max(max(lengths), 1)
    pages = rng.standard_normal((num_pages, page_size, 2, 8)).astype(np.float32)

    packed_cu, page, slot, inside = paging.key_pages(np, cu, table, rows, page_size, num_pages)
    assert np.array_equal(packed_cu, cu - cu[0])
    assert inside.sum() == sum(lengths) and not inside[sum(lengths):].any()
    packed = paging.gather(np, pages, page, slot, inside)
    grad = rng.standard_normal(packed.shape).astype(np.float32)
    want = np.zeros(pages.shape)
    for b, n in enumerate(lengths):
        for j in range(n):
            t = packed_cu[b] + j
            p = table[b, j // page_size]
            assert (page[t], slot[t]) == (p, j % page_size)
            assert np.array_equal(packed[t], pages[p, j % page_size])
            want[p, j % page_size] += grad[t]
    assert not packed[~inside].any()
    summed = paging.sum_onto_pages(np, grad, pages.shape, page, slot, inside)
    assert np.allclose(summed, want, rtol=1e-6, atol=1e-6)
    summed64 = paging.sum_onto_pages(np, grad.astype(np.float64), pages.shape, page, slot, inside)
    assert summed64.dtype == np.float64 and np.allclose(summed64, want, rtol=1e-12, atol=1e-12)
    if not share:  # write_pages puts packed rows where the block table says: gathering them back gives them again
        source = rng.standard_normal((sum(lengths), 2, 8)).astype(np.float32)
        paging.write_pages(np, pages, source, cu - cu[0], table)
        assert np.array_equal(paging.gather(np, pages, page, slot, inside)[: sum(lengths)], source)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gather_keeps_the_dtype(dtype):
    # The paged backward hands the gathered keys to the kernels, which take 16-bit floats only: gather must not
    # promote (CuPy's where() turned torch's bfloat16 into float32).
    np_dtype = np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    pages = np.arange(2 * 3 * 2 * 8, dtype=np.float32).reshape(2, 3, 2, 8).astype(np_dtype)
    page, slot, inside = np.array([1, 0, 0]), np.array([2, 1, 0]), np.array([True, True, False])
    packed = paging.gather(np, pages, page, slot, inside)
    assert packed.dtype == np_dtype
    assert np.array_equal(packed[:2].astype(np.float32), pages[[1, 0], [2, 1]].astype(np.float32))
    assert not packed[2].astype(np.float32).any()


def test_key_pages_bad_page_is_outside():
    table = np.array([[0, 7]], np.int32)  # page 7 of 2 does not exist
    _, page, slot, inside = paging.key_pages(np, np.array([0, 5], np.int32), table, 5, 3, 2)
    assert inside.tolist() == [True, True, True, False, False]
    assert page.tolist() == [0, 0, 0, 0, 0] and slot.tolist() == [0, 1, 2, 0, 0]


def test_bfloat16_round_trip_rounds_to_nearest_even():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000) * 10.0 ** rng.integers(-30, 30, 10000),
                        [0.0, -0.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38]]).astype(np.float32)
    got = paging.from_float32(np, x, np.dtype(ml_dtypes.bfloat16))
    assert got.dtype == ml_dtypes.bfloat16
    assert np.array_equal(got.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.array_equal(paging.to_float32(np, got), got.astype(np.float32))
    with np.errstate(over="ignore"):  # float16 overflows to inf, as astype does
        assert np.array_equal(paging.from_float32(np, x, np.float16), x.astype(np.float16))


@pytest.mark.parametrize("d", list(range(1, 300)) + [2**k for k in range(9, 31)] + [3 * 2**20, 1000003, 2**31 - 1])
def test_fast_divisor_is_exact(d):
    magic, shift = fast_divisor(d)
    assert 0 <= magic < 2**32
    rng = np.random.default_rng(d)
    n = np.concatenate([np.arange(0, 4 * d + 3, max(1, d // 7)), [d - 1, d, d + 1, 2**31 - 2, 2**31 - 1],
                        rng.integers(0, 2**31, 500)]).astype(np.uint64)
    n = n[n < 2**31]
    q = (((n * np.uint64(magic)) >> np.uint64(32)) + n) >> np.uint64(shift)  # __umulhi, add, shift
    assert np.array_equal(q, n // np.uint64(d))


@pytest.mark.parametrize("d", [0, -1, 2**31])
def test_fast_divisor_rejects(d):
    with pytest.raises(ValueError):
        fast_divisor(d)
