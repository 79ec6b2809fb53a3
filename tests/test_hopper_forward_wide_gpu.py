"""The Hopper forward at the wide head dims, 192 and 256 (configs.FORWARD_HOPPER_TABLE's rows), on a GPU of compute
capability 9.0: they must be the kernels planned (the mma.sync forward with KernelOptions(hopper_forward=False)),
and match the float64 reference on every mask, grouping and ragged length, padded, varlen and paged, with
every output poisoned with NaN before its launch (an element a kernel fails to write shows up).

What these rows do differently from d = 64 and 128, and so what is checked first here: P V on wgmma of N = 192 and
256 (cuda/sm90/wgmma.cuh), S = Q K^T over 3 and 4 slabs, 64-key tiles (no P V halves), one Q buffer at d = 256
(the next item's Q waits for this item's rows to be written out), the varlen loader's and the ragged output rows'
slab-at-a-time copies, and paged K/V's 16 rows a warp (cuda/sm90/slabs.cuh).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from gpu_helpers import (UNIT_ROUNDOFF, cu_seqlens, cupy_module as _cupy, debug_poison, fa2cupy_module,
                         kernel_options, recorded_forward_plans, skip_unless_hopper)
from test_forward_gpu import check_against_reference, make_input, run_case
# (imported here, not inside a Hypothesis test: importing applies @given, which Hypothesis refuses while a test runs)
from test_paged_varlen_gpu import paged_case_arrays, paged_equals_packed
from test_hopper_forward_gpu import hopper_cases
from test_varlen_mods_gpu import _check_out, _host, _randn

pytestmark = pytest.mark.gpu

WIDE = [192, 256]


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


def _wide(**options):
    """Runs the calls inside on the Hopper forward, whatever the length of a masked call."""
    skip_unless_hopper("forward")
    return kernel_options(hopper_forward=True, hopper_masked_min_seqlen=0, **options)


def _assert_wide(plans, d):
    from fa2cupy import configs

    assert plans and all(p.config is configs.FORWARD_HOPPER_TABLE[d] for p in plans), [p.config for p in plans]


@pytest.mark.parametrize("d", WIDE)
def test_wide_rows_are_the_ones_planned(d):
    skip_unless_hopper("forward")
    from fa2cupy import configs, forward
    from fa2cupy.options import KernelOptions

    strides = ((2048 * 8 * d, 8 * d, d, 1),) * 4
    shape = (1, 2048, 8, d)
    for causal in (False, True):
        plan = forward.plan_forward(shape, shape, strides, "bfloat16", 0.1, causal, 90)
        assert plan.config is configs.FORWARD_HOPPER_TABLE[d]
    assert plan.launch.block == (384, 1, 1) and plan.launch.grid[1:] == (1, 1)
    plan = forward.plan_forward(shape, shape, strides, "bfloat16", 0.1, True, 90,
                                options=KernelOptions(hopper_forward=False))
    assert isinstance(plan.config, configs.FwdConfig)
    plan = forward.plan_forward(shape, shape, strides, "bfloat16", 0.1, True, 90, dropout_p=0.1)
    assert plan.config is configs.FORWARD_HOPPER_TABLE[d]  # dropout: the modifier rows


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize(
    "b,sq,sk,h,hkv,causal,window",
    [
        (1, 1, 1, 1, 1, False, (-1, -1)),  # one item, one row, one key
        (2, 129, 65, 4, 2, False, (-1, -1)),  # ragged: the second warpgroup's rows, the last key tile
        (2, 300, 300, 6, 3, True, (-1, -1)),  # causal diagonal, a ragged last item
        (1, 700, 300, 4, 1, True, (-1, -1)),  # sq > sk: rows and whole items with no key
        (1, 1000, 1000, 4, 4, False, (100, 0)),  # a band: warpgroups pass over tiles the other computes
        (1, 129, 2000, 2, 2, False, (50, 50)),  # a narrow band over long keys
        (2, 1025, 1025, 8, 2, True, (-1, -1)),  # many items per block: Q buffers and rings wrap
        (1, 63, 4000, 2, 1, False, (-1, -1)),  # one short item over 63 key tiles
    ],
)
def test_fixed_wide_cases(d, b, sq, sk, h, hkv, causal, window):
    with _wide(), recorded_forward_plans() as plans:
        for dtype in ("float16", "bfloat16"):
            run_case(dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hkv, headdim=d, causal=causal,
                          window_size=window, dtype=dtype, softmax_scale=None, transposed=False, return_lse=True,
                          seed=sq + sk + d))
    _assert_wide(plans, d)


# (64-key tiles and 64-row consumer steps: lengths around their multiples)
LENGTHS = [1, 2, 17, 63, 64, 65, 127, 128, 129, 191, 255, 257, 500]


@given(hopper_cases(headdims=WIDE, lengths=LENGTHS))
def test_wide_matches_reference(case):
    note(repr(case))
    with _wide():
        run_case(case)


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("sms", [3, None])
def test_wide_tile_counter_and_persistent_blocks(d, sms):
    """Few persistent blocks walking many masked items (the tile counter): at d = 256 each item's Q waits for the
    one Q buffer to be written out; the counter and the grid stride give the same bits."""
    fa2cupy = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(d)
    q, k, v = (make_input(rng, (2, 1500, n, d), "bfloat16") for n in (6, 2, 2))
    results = {}
    for counter in (False, True):
        with _wide(sm_count=sms, tile_counter=counter), recorded_forward_plans() as plans:
            results[counter] = fa2cupy.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]
        _assert_wide(plans, d)
    for stride_part, counter_part in zip(*results.values()):
        assert cp.array_equal(stride_part, counter_part)
    check_against_reference(q, k, v, *results[True], None, True, "bfloat16")


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (90, 30))])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wide_varlen_matches_reference(d, causal, window, dtype):
    """Ragged sequences: whole tiles by TMA, a sequence's ragged last K/V tile and output rows by every producer
    thread's copies, a slab at a time."""
    from fa2cupy.reference import attention_ref_varlen

    fa2cupy = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(d + causal)
    lengths_q, lengths_k = [0, 1, 63, 64, 65, 129, 300, 17], [5, 1, 200, 64, 65, 129, 300, 0]
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    q, k, v = (_randn(rng, shape, dtype) for shape in ((sum(lengths_q), 6, d), (sum(lengths_k), 2, d),
                                                       (sum(lengths_k), 2, d)))
    kw = dict(causal=causal, window_size=window)
    with _wide(), recorded_forward_plans() as plans:
        out, lse, _ = fa2cupy.flash_attn_varlen_func(q, k, v, cp.asarray(cu_q), cp.asarray(cu_k), max(lengths_q) + 9,
                                                     max(lengths_k), return_attn_probs=True, **kw)
    _assert_wide(plans, d)
    ref_out, ref_lse = attention_ref_varlen(_host(q), _host(k), _host(v), cu_q, cu_k, **kw)
    _check_out(out, lse, ref_out, ref_lse, v, dtype, rows=np.arange(int(cu_q[-1])))


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("page_size", [1, 5, 16, 64, 256])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (40, 40))])
def test_wide_paged_equals_packed_and_reference(d, page_size, causal, window):
    """Paged K/V gathered 16 rows a warp into 64-key tiles: the same bits as packed K/V on the same kernel, the
    reference's answer, and no unused block_table entry read."""
    from fa2cupy.reference import attention_ref_varlen

    fa2cupy = fa2cupy_module()
    lengths_q, lengths_k = [70, 1, 0, 130], [200, 17, 5, 129]
    arrays = paged_case_arrays(dict(lengths_q=lengths_q, lengths_k=lengths_k, page_size=page_size, nheads=4,
                                    nheads_kv=2, headdim=d, alibi=False, dtype="bfloat16", seed=d + page_size))
    q, k, v = arrays[:3]
    rows = sum(lengths_q)
    with _wide(), recorded_forward_plans() as plans:
        out_p, lse_p = paged_equals_packed(fa2cupy, arrays, 130, 200, rows, causal=causal, window_size=window)
    _assert_wide(plans, d)
    ref_out, ref_lse = attention_ref_varlen(_host(q), _host(k), _host(v), cu_seqlens(lengths_q),
                                            cu_seqlens(lengths_k), causal=causal, window_size=window)
    tol = 4 * UNIT_ROUNDOFF["bfloat16"] * float(np.abs(_host(v)).max()) + 1e-6
    assert np.abs(_host(out_p[:rows]) - ref_out).max() <= tol
    live = ~np.isinf(ref_lse)
    got_lse = _host(lse_p)[:, :rows]
    assert np.all(np.abs(got_lse[live] - ref_lse[live]) <= 1e-3 * (1 + np.abs(ref_lse[live])))


@settings(deadline=None)
@given(st.sampled_from(WIDE), st.sampled_from(["float16", "bfloat16"]), st.integers(0, 2**32 - 1))
def test_wide_matches_the_mma_sync_forward_closely(d, dtype, seed):
    """The wide rows against the mma.sync forward (KernelOptions(hopper_forward=False)), on one causal GQA call."""
    fa2cupy = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(seed)
    q, k, v = (make_input(rng, (1, 333, n, d), dtype) for n in (4, 2, 2))
    with _wide():
        wide = fa2cupy.flash_attn_func(q, k, v, causal=True)
    with kernel_options(hopper_forward=False):
        mma = fa2cupy.flash_attn_func(q, k, v, causal=True)
    tol = 8 * UNIT_ROUNDOFF[dtype] * float(cp.abs(v.astype(cp.float32)).max()) + 1e-6
    assert float(cp.abs(wide.astype(cp.float32) - mma.astype(cp.float32)).max()) <= tol
