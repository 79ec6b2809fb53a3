"""flash_attn_with_kvcache on a real GPU: decode attention over a KV cache, with in-place append.

What is checked (flash-attn 2.x semantics):

* out/lse against the float64 reference, one batch row at a time: row ``b`` attends to the first
  ``cache_seqlens[b] + seqlen_new`` entries of its cache row (``cache_batch_idx[b]``, or its pages through
  ``block_table[b]``) *after* ``k``/``v`` were written at ``cache_seqlens[b] ..``. Rows differ in length, so
  the reference is built per row on the host from the cache as it should be after the append. Causal is
  bottom-right aligned per row. A row with no key gives out 0 and lse +inf.
* the append itself: the new keys/values land bitwise at the expected slots and every other cache entry
  (unused slots, unused pages, other cache rows) is bitwise unchanged.
* paged and contiguous layouts of the same logical cache give bitwise-identical out for one ``num_splits``;
  different ``num_splits`` agree within the error bound.
* bad arguments raise TypeError/ValueError naming the argument, and the caches are left untouched.
* v_cache (and v) may have a head dim of their own, the output's (DeepSeek's 192 / 128 among them): the same
  checks, with v's head dim drawn apart from q's and k's.
* the optional features, each against the same float64 reference: sliding windows (rows that see no key
  included; a small window over a long cache must be cheap), softcap, ALiBi ((nheads,) and (batch, nheads)),
  cache_leftpad (row b's keys are slots [cache_leftpad[b], cache_seqlens[b] + seqlen_new)) and rotary embeddings
  (the new keys are stored rotated at their slots, within one rounding of the float64 rotation; q is rotated at
  cache_seqlens[b] + t under a causal or local mask, else at cache_seqlens[b]; the caller's q and k are never
  modified). With features the attention reference reads the cache as the kernels left it (after checking it),
  so a rotated key's rounding is not counted twice.

Error bound for out: 4u * max|v| + 1e-6 with u the unit roundoff (fp16 2^-11, bf16 2^-8), max|v| over the
values that row attends to; see tests/test_forward_gpu.py for the derivation (a split-K combine adds one more
fp32 rescale, far below u). lse: |lse - ref| <= 1e-3 * (1 + |ref|).

Every cache slot that no row may read (beyond ``cache_seqlens + seqlen_new``, unused pages, cache rows no batch
row selects) holds fresh random data rather than zeros, so reading past the valid length moves the result.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from fa2cupy.reference import apply_rotary_ref, attention_ref
from gpu_helpers import (
    UNIT_ROUNDOFF, cupy_module as _cupy, debug_poison, fa2cupy_module, kernel_options, np_dtype as _np_dtype,
    options_for_test)

pytestmark = pytest.mark.gpu

HEAD_GROUPS = [(1, 1), (4, 1), (8, 2), (32, 8), (6, 3), (16, 16)]
HEADDIMS = [64, 128, 40, 96, 256]
HEADDIMS_V = [128, 64, 32, 192]  # v_cache's where drawn apart from q's and k's
PAGE_SIZES = [16, 32, 64]
NUM_SPLITS = [0, 1, 3, 7]


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    # Same poisoning as tests/test_forward_gpu.py: any output element the kernels fail to write is NaN and caught
    # below.
    with debug_poison():
        yield


def _kvcache():
    return fa2cupy_module().flash_attn_with_kvcache


def _randn(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(_np_dtype(dtype))


def _bits(x):
    """Host array ``x`` (fp16/bf16) as uint16, for bitwise comparisons."""
    return np.ascontiguousarray(x).view(np.uint16)


# ------------------------------------------------------------------ building a case on the host


def build_case(rng, *, batch, seqlen_q, nheads, nheads_kv, headdim, dtype, capacity, seqlens, seqlen_new,
               page_size=None, use_batch_idx=False, extra_pages=3, extra_rows=2, headdim_v=None):
    """Host arrays for one call.

    The *logical* cache is ``(batch_cache, capacity, nheads_kv, headdim)`` (V's: ``headdim_v``, None for
    ``headdim``), random everywhere (valid entries
    and garbage alike). Contiguous: it is passed as is (``batch_cache = batch + extra_rows`` with a permuted
    ``cache_batch_idx`` when ``use_batch_idx``). Paged: ``capacity`` is rounded up to whole pages and the
    logical rows are scattered over a shuffled pool of ``batch * max_pages + extra_pages`` random pages.

    Returns a dict of host arrays and metadata (see the keys below).
    """
    seqlens = np.asarray(seqlens, dtype=np.int32)
    assert seqlens.shape == (batch,)
    paged = page_size is not None
    assert not (paged and use_batch_idx)
    if paged:
        max_pages = -(-capacity // page_size)
        capacity = max_pages * page_size
    assert int(seqlens.max()) + seqlen_new <= capacity and int(seqlens.min()) >= 0
    batch_cache = batch + extra_rows if use_batch_idx else batch
    dv = headdim if headdim_v is None else headdim_v
    kv_shape = (batch_cache, capacity, nheads_kv, headdim)
    case = dict(
        dtype=dtype, batch=batch, capacity=capacity, seqlens=seqlens, seqlen_new=seqlen_new,
        page_size=page_size,
        q=_randn(rng, (batch, seqlen_q, nheads, headdim), dtype),
        logical_k=_randn(rng, kv_shape, dtype),
        logical_v=_randn(rng, kv_shape[:3] + (dv,), dtype),
        k_new=_randn(rng, (batch, seqlen_new, nheads_kv, headdim), dtype) if seqlen_new else None,
        v_new=_randn(rng, (batch, seqlen_new, nheads_kv, dv), dtype) if seqlen_new else None,
        cache_batch_idx=(rng.permutation(batch_cache)[:batch].astype(np.int32) if use_batch_idx else None),
        block_table=None,
    )
    if paged:
        num_pages = batch * max_pages + extra_pages
        pool = rng.permutation(num_pages).astype(np.int32)
        table = pool[: batch * max_pages].reshape(batch, max_pages)
        pages_k = _randn(rng, (num_pages, page_size, nheads_kv, headdim), dtype)
        pages_v = _randn(rng, (num_pages, page_size, nheads_kv, dv), dtype)
        for b in range(batch):
            for j in range(max_pages):
                pages_k[table[b, j]] = case["logical_k"][b, j * page_size:(j + 1) * page_size]
                pages_v[table[b, j]] = case["logical_v"][b, j * page_size:(j + 1) * page_size]
        case.update(block_table=np.ascontiguousarray(table), phys_k=pages_k, phys_v=pages_v)
    else:
        case.update(phys_k=case["logical_k"], phys_v=case["logical_v"])
    return case


def cache_row(case, b):
    """Cache row (logical) that batch row ``b`` uses."""
    idx = case["cache_batch_idx"]
    return b if idx is None else int(idx[b])


def expected_after(case):
    """(logical_k, logical_v, phys_k, phys_v) as they must be after the call appended k_new/v_new."""
    lk, lv = case["logical_k"].copy(), case["logical_v"].copy()
    pk, pv = case["phys_k"].copy(), case["phys_v"].copy()
    n = case["seqlen_new"]
    for b in range(case["batch"]):
        s, row = int(case["seqlens"][b]), cache_row(case, b)
        if n == 0:
            continue
        lk[row, s:s + n] = case["k_new"][b]
        lv[row, s:s + n] = case["v_new"][b]
        if case["block_table"] is None:
            pk[row, s:s + n] = case["k_new"][b]
            pv[row, s:s + n] = case["v_new"][b]
        else:
            ps = case["page_size"]
            for i in range(n):
                page = case["block_table"][b, (s + i) // ps]
                pk[page, (s + i) % ps] = case["k_new"][b, i]
                pv[page, (s + i) % ps] = case["v_new"][b, i]
    return lk, lv, pk, pv


def call(case, *, causal=False, num_splits=0, softmax_scale=None, return_lse=True, seqlens_form="array",
         as_contiguous=False):
    """Runs flash_attn_with_kvcache on fresh device copies of the case's cache.

    seqlens_form: "array" (int32 CuPy array), "int" (a Python int; all rows must agree) or "none" (all rows
    must be full and nothing appended). as_contiguous: pass the logical cache instead of the pages (a paged
    case seen as contiguous, for the paged-vs-contiguous comparison).

    Returns (out, lse or None, k_cache, v_cache) as CuPy arrays (caches after the call).
    """
    cp = _cupy()
    paged = case["block_table"] is not None and not as_contiguous
    host_k, host_v = (case["phys_k"], case["phys_v"]) if paged else (case["logical_k"], case["logical_v"])
    k_cache, v_cache = cp.asarray(host_k), cp.asarray(host_v)
    seqlens = case["seqlens"]
    if seqlens_form == "array":
        cache_seqlens = cp.asarray(seqlens)
    elif seqlens_form == "int":
        assert np.all(seqlens == seqlens[0])
        cache_seqlens = int(seqlens[0])
    else:
        assert seqlens_form == "none" and not paged and case["seqlen_new"] == 0
        assert np.all(seqlens == case["capacity"])
        cache_seqlens = None
    kwargs = dict(cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                  num_splits=num_splits, return_softmax_lse=return_lse)
    if case["seqlen_new"]:
        kwargs.update(k=cp.asarray(case["k_new"]), v=cp.asarray(case["v_new"]))
    if case["cache_batch_idx"] is not None:
        kwargs["cache_batch_idx"] = cp.asarray(case["cache_batch_idx"])
    if paged:
        kwargs["block_table"] = cp.asarray(case["block_table"])
    q = cp.asarray(case["q"])
    res = _kvcache()(q, k_cache, v_cache, **kwargs)
    if return_lse:
        assert isinstance(res, tuple) and len(res) == 2
        out, lse = res
    else:
        out, lse = res, None
    cp.cuda.runtime.deviceSynchronize()
    assert isinstance(out, cp.ndarray)
    assert out.shape == q.shape[:3] + v_cache.shape[3:] and out.dtype == q.dtype
    if lse is not None:
        b, sq, h, _ = q.shape
        assert isinstance(lse, cp.ndarray) and lse.dtype == cp.float32 and lse.shape == (b, h, sq)
    return out, lse, k_cache, v_cache


def _note(msg):
    if currently_in_test_context():  # note() only works inside @given
        note(msg)


def check_cache(case, k_cache, v_cache, as_contiguous=False):
    """The caches after the call hold k_new/v_new at the expected slots and nothing else changed (bitwise)."""
    cp = _cupy()
    lk, lv, pk, pv = expected_after(case)
    paged = case["block_table"] is not None and not as_contiguous
    want_k, want_v = (pk, pv) if paged else (lk, lv)
    got_k, got_v = cp.asnumpy(k_cache), cp.asnumpy(v_cache)
    for name, got, want in (("k_cache", got_k, want_k), ("v_cache", got_v, want_v)):
        bad = _bits(got) != _bits(want)
        if bad.any():
            where = np.argwhere(bad.any(axis=(2, 3)))[:8].tolist()
            raise AssertionError(f"{name} differs from the expected post-append state at (row/page, slot) {where}")


def _check_row(b, keys, out_h, lse_h, ref_out, ref_lse, v_rows, u):
    """Batch row b's out (and lse) against the reference over its keys (``keys`` names them in messages)."""
    tol = 4 * u * float(np.abs(v_rows.astype(np.float64)).max()) + 1e-6
    err = np.abs(out_h[b] - ref_out)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    _note(f"row {b}: {keys}, max|out-ref|={err.max():.3e} at {worst}, tol={tol:.3e}")
    assert err.max() <= tol, f"row {b} ({keys}): max|out-ref| = {err.max():.3e} at {worst} > {tol:.3e}"
    dead = np.isinf(ref_lse)  # (h, sq): queries that see no key
    if dead.any():
        assert np.all(out_h[b][dead.T] == 0.0), f"row {b}: queries that see no key must give exactly 0"
    if lse_h is not None:
        assert not np.isnan(lse_h[b]).any(), "lse has NaN"
        assert np.all(lse_h[b][dead] == np.inf), f"row {b}: queries that see no key must have lse +inf"
        live = ~dead
        lerr = np.abs(lse_h[b][live] - ref_lse[live])
        assert np.all(lerr <= 1e-3 * (1 + np.abs(ref_lse[live]))), f"row {b}: max|lse-ref| = {lerr.max():.3e}"


def check_outputs(case, out, lse, softmax_scale, causal):
    """out/lse against attention_ref per batch row, over the keys of that row after the append."""
    cp = _cupy()
    lk, lv, _, _ = expected_after(case)
    out_h = cp.asnumpy(out).astype(np.float64)
    lse_h = None if lse is None else cp.asnumpy(lse).astype(np.float64)
    assert not np.isnan(out_h).any(), "out has NaN"
    if lse_h is not None:
        assert not np.isnan(lse_h).any(), "lse has NaN"
    u = UNIT_ROUNDOFF[case["dtype"]]
    for b in range(case["batch"]):
        row = cache_row(case, b)
        nkeys = int(case["seqlens"][b]) + case["seqlen_new"]
        if nkeys == 0:
            assert np.all(out_h[b] == 0.0), f"row {b} has no key: out must be exactly 0"
            if lse_h is not None:
                assert np.all(lse_h[b] == np.inf), f"row {b} has no key: lse must be +inf"
            continue
        k_rows, v_rows = lk[row:row + 1, :nkeys], lv[row:row + 1, :nkeys]
        ref_out, ref_lse = attention_ref(case["q"][b:b + 1], k_rows, v_rows, softmax_scale, causal)
        _check_row(b, f"{nkeys} keys", out_h, lse_h, ref_out[0], ref_lse[0], v_rows, u)


def run_and_check(case, **kw):
    out, lse, k_cache, v_cache = call(case, **kw)
    check_cache(case, k_cache, v_cache, as_contiguous=kw.get("as_contiguous", False))
    check_outputs(case, out, lse, kw.get("softmax_scale"), kw.get("causal", False))
    return out, lse


# ------------------------------------------------------------------ property test


@st.composite
def kv_cases(draw):
    seqlen_new = draw(st.sampled_from([0, 0, 1, 1, 2, 3, 4]))  # weight: no append and single-token decode
    capacity = draw(st.one_of(st.integers(max(1, seqlen_new), 600),
                              st.sampled_from([max(1, seqlen_new), 16, 17, 63, 64, 128, 129, 600])))
    page_size = draw(st.sampled_from([None, None] + PAGE_SIZES))
    if page_size is not None:
        capacity = -(-capacity // page_size) * page_size
    batch = draw(st.integers(1, 4))
    top = capacity - seqlen_new
    seqlens = draw(st.lists(st.one_of(st.just(0), st.just(top), st.integers(0, top)), min_size=batch,
                            max_size=batch))
    nheads, nheads_kv = draw(st.sampled_from(HEAD_GROUPS))
    return dict(
        batch=batch,
        seqlen_q=draw(st.integers(1, 8)),
        nheads=nheads,
        nheads_kv=nheads_kv,
        headdim=draw(st.sampled_from(HEADDIMS)),
        headdim_v=draw(st.one_of(st.none(), st.none(), st.sampled_from(HEADDIMS_V))),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        capacity=capacity,
        seqlens=seqlens,
        seqlen_new=seqlen_new,
        page_size=page_size,
        use_batch_idx=page_size is None and draw(st.booleans()),
        extra_pages=draw(st.integers(0, 5)),
        causal=draw(st.booleans()),
        num_splits=draw(st.sampled_from(NUM_SPLITS)),
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.01, 1.0))),
        return_lse=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=30)
@given(kv_cases())
def test_matches_reference(c):
    note(repr(c))
    rng = np.random.default_rng(c["seed"])
    case = build_case(
        rng, batch=c["batch"], seqlen_q=c["seqlen_q"], nheads=c["nheads"], nheads_kv=c["nheads_kv"],
        headdim=c["headdim"], dtype=c["dtype"], capacity=c["capacity"], seqlens=c["seqlens"],
        seqlen_new=c["seqlen_new"], page_size=c["page_size"], use_batch_idx=c["use_batch_idx"],
        extra_pages=c["extra_pages"], headdim_v=c["headdim_v"],
    )
    run_and_check(case, causal=c["causal"], num_splits=c["num_splits"], softmax_scale=c["softmax_scale"],
                  return_lse=c["return_lse"])


# ------------------------------------------------------------------ fixed cases


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "b,sq,h,hkv,d,capacity,seqlens,new,page_size,causal",
    [
        (1, 1, 1, 1, 64, 1, [1], 0, None, False),  # one key, full cache
        (2, 1, 8, 2, 128, 300, [0, 299], 1, None, False),  # empty row + append, full row after append
        (3, 4, 32, 8, 128, 512, [100, 0, 508], 4, 16, True),
        (4, 8, 6, 3, 96, 200, [5, 7, 3, 190], 2, None, True),  # seqlen_q > keys of some rows: dead queries
        (2, 3, 16, 16, 256, 129, [64, 1], 3, 64, False),
        (1, 16, 4, 1, 40, 600, [333], 4, 32, True),
    ],
)
def test_fixed_cases(dtype, b, sq, h, hkv, d, capacity, seqlens, new, page_size, causal):
    rng = np.random.default_rng(capacity * 7 + sq)
    case = build_case(rng, batch=b, seqlen_q=sq, nheads=h, nheads_kv=hkv, headdim=d, dtype=dtype,
                      capacity=capacity, seqlens=seqlens, seqlen_new=new, page_size=page_size)
    run_and_check(case, causal=causal)


@pytest.mark.parametrize("d,dv,page_size,num_splits,causal", [
    (192, 128, None, 0, True),  # DeepSeek-V2/V3's q/k and v head dims
    (192, 128, 16, 5, False),
    (64, 128, 32, 1, True),  # v wider than q and k
    (128, 64, None, 3, False),
    (256, 8, 64, 0, True),
])
def test_v_cache_head_dim_of_its_own(d, dv, page_size, num_splits, causal):
    rng = np.random.default_rng(d * 1000 + dv)
    case = build_case(rng, batch=3, seqlen_q=2, nheads=16, nheads_kv=4, headdim=d, headdim_v=dv, dtype="bfloat16",
                      capacity=700, seqlens=[0, 517, 697], seqlen_new=3, page_size=page_size)
    out, _ = run_and_check(case, causal=causal, num_splits=num_splits)
    assert out.shape == (3, 2, 16, dv)


@pytest.mark.parametrize("paged", [False, True])
def test_v_cache_head_dim_of_its_own_with_features(paged):
    rng = np.random.default_rng(19)
    case = build_case(rng, batch=3, seqlen_q=3, nheads=8, nheads_kv=2, headdim=192, headdim_v=128,
                      dtype="float16", capacity=320, seqlens=[40, 0, 300], seqlen_new=2,
                      page_size=32 if paged else None)
    f = make_features(rng, case, window=(64, 0), softcap=30.0, alibi="heads", rotary_dim=64,
                      leftpad=None if paged else [3, 0, 17])
    run_features(case, f, num_splits=3)


@pytest.mark.parametrize("paged", [False, True])
def test_row_without_keys(paged):
    # cache_seqlens 0 and nothing appended: the row attends to nothing -> out exactly 0, lse +inf.
    rng = np.random.default_rng(1)
    case = build_case(rng, batch=4, seqlen_q=2, nheads=4, nheads_kv=2, headdim=64, dtype="float16",
                      capacity=160, seqlens=[0, 5, 0, 130], seqlen_new=0, page_size=32 if paged else None)
    out, lse = run_and_check(case, causal=False)
    out_h, lse_h = _cupy().asnumpy(out), _cupy().asnumpy(lse)
    for b in (0, 2):
        assert np.all(out_h[b] == 0) and np.all(lse_h[b] == np.inf)
    for b in (1, 3):
        assert np.all(np.isfinite(lse_h[b]))


@pytest.mark.parametrize("causal", [False, True])
def test_cache_seqlens_int_and_none(causal):
    rng = np.random.default_rng(2)
    # A Python int: every row has that many valid entries.
    case = build_case(rng, batch=3, seqlen_q=3, nheads=8, nheads_kv=2, headdim=64, dtype="bfloat16",
                      capacity=100, seqlens=[57, 57, 57], seqlen_new=2, use_batch_idx=True)
    run_and_check(case, causal=causal, seqlens_form="int")
    # None: the whole cache is valid (no append).
    case = build_case(rng, batch=2, seqlen_q=4, nheads=8, nheads_kv=2, headdim=64, dtype="bfloat16",
                      capacity=77, seqlens=[77, 77], seqlen_new=0)
    run_and_check(case, causal=causal, seqlens_form="none")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_equals_contiguous_bitwise(dtype, page_size, num_splits):
    rng = np.random.default_rng(page_size + num_splits)
    case = build_case(rng, batch=3, seqlen_q=4, nheads=8, nheads_kv=2, headdim=128, dtype=dtype,
                      capacity=500, seqlens=[0, 200, 509], seqlen_new=3,  # capacity rounds up to 512
                      page_size=page_size, extra_pages=4)
    out_p, lse_p = run_and_check(case, causal=True, num_splits=num_splits)
    out_c, lse_c = run_and_check(case, causal=True, num_splits=num_splits, as_contiguous=True)
    cp = _cupy()
    assert np.array_equal(_bits(cp.asnumpy(out_p)), _bits(cp.asnumpy(out_c))), \
        "paged and contiguous caches with the same content must give bitwise-identical out"


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_evict_first_stream_changes_no_bit(page_size, num_splits):
    # K/V copies under the L2 evict-first policy (which calls past the L2 size take) give the reference's answer
    # and the bits of copies under no policy (KernelOptions.decode_stream_evict_first forces either).
    cp = _cupy()
    rng = np.random.default_rng(7 + num_splits)
    case = build_case(rng, batch=2, seqlen_q=1, nheads=32, nheads_kv=8, headdim=128, dtype="bfloat16",
                      capacity=2048, seqlens=[2047, 900], seqlen_new=1, page_size=page_size)
    results = []
    for evict_first in (True, False):
        with kernel_options(decode_stream_evict_first=evict_first):
            out, lse = run_and_check(case, num_splits=num_splits)
        results.append((_bits(cp.asnumpy(out)), cp.asnumpy(lse).view(np.uint32)))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged"])
@pytest.mark.parametrize("new", [1, 4])
def test_append_writes_exactly_the_new_slots(layout, new):
    rng = np.random.default_rng(new + len(layout))
    capacity = 96
    case = build_case(rng, batch=4, seqlen_q=1, nheads=4, nheads_kv=4, headdim=64, dtype="float16",
                      capacity=capacity, seqlens=[0, 15, 16, capacity - new], seqlen_new=new,
                      page_size=16 if layout == "paged" else None, use_batch_idx=layout == "batch_idx",
                      extra_rows=3, extra_pages=5)
    # Slots 15/16 straddle a page boundary; the last row fills the cache to the brim.
    run_and_check(case, causal=False)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("form", ["array", "int"])
@pytest.mark.parametrize("cached_dispatch", [False, True])
def test_decode_loop_appends_one_token_per_step(paged, form, cached_dispatch, monkeypatch):
    # Real decode: the same cache arrays across steps, cache_seqlens advancing by one each step. With
    # cached_dispatch the output poisoning is off, so from the second step on the call takes the cached fast
    # path (plan reused, nothing re-validated on the host but an int cache_seqlens).
    if cached_dispatch:
        options_for_test(monkeypatch, debug_poison=False)
    cp = _cupy()
    rng = np.random.default_rng(3)
    batch, h, hkv, d, dtype, ps, steps = 2, 8, 2, 64, "float16", 16, 5
    case = build_case(rng, batch=batch, seqlen_q=1, nheads=h, nheads_kv=hkv, headdim=d, dtype=dtype,
                      capacity=64, seqlens=[14, 30] if form == "array" else [20, 20], seqlen_new=1,
                      page_size=ps if paged else None)
    k_cache, v_cache = cp.asarray(case["phys_k" if paged else "logical_k"]), cp.asarray(case["phys_v" if paged else "logical_v"])
    extra = dict(block_table=cp.asarray(case["block_table"])) if paged else {}
    logical_k, logical_v = case["logical_k"].copy(), case["logical_v"].copy()
    seqlens = case["seqlens"].copy()
    for _ in range(steps):
        q = _randn(rng, (batch, 1, h, d), dtype)
        kn, vn = _randn(rng, (batch, 1, hkv, d), dtype), _randn(rng, (batch, 1, hkv, d), dtype)
        lens = cp.asarray(seqlens) if form == "array" else int(seqlens[0])
        out, lse = _kvcache()(cp.asarray(q), k_cache, v_cache, k=cp.asarray(kn), v=cp.asarray(vn),
                              cache_seqlens=lens, return_softmax_lse=True, **extra)
        for b in range(batch):
            logical_k[b, seqlens[b]] = kn[b, 0]
            logical_v[b, seqlens[b]] = vn[b, 0]
        # The token just appended at slot seqlens[b] is attended to: seqlens + 1 keys per row.
        step = dict(case, q=q, seqlens=seqlens + 1, seqlen_new=0, logical_k=logical_k, logical_v=logical_v)
        check_outputs(step, out, lse, None, True)
        seqlens += 1
    if cached_dispatch:  # the cached path also rejects an int cache_seqlens past the capacity, on the host
        with pytest.raises(ValueError, match="cache_seqlens"):
            _kvcache()(cp.asarray(q), k_cache, v_cache, k=cp.asarray(kn), v=cp.asarray(vn),
                       cache_seqlens=64, **extra)
    stored_k = cp.asnumpy(k_cache)
    for b in range(batch):
        for p in range(int(seqlens[b])):
            where = (case["block_table"][b, p // ps], p % ps) if paged else (b, p)
            assert np.array_equal(_bits(stored_k[where]), _bits(logical_k[b, p])), (b, p)


@pytest.fixture(params=[(False, False), (True, False), (None, True), (True, True)],
                ids=["table_ring", "deep_ring", "warp_items", "warp_items_deep_ring"])
def ring(request, monkeypatch):
    # Both ring depths of the d=128 row wherever the test's calls use it (KernelOptions.decode_deep_ring forces the
    # choice that configs.decode_config otherwise makes from the work items' lengths), and its warp-items twin
    # wherever a call has one split (KernelOptions.decode_warp_items forces what decode.uses_warp_items decides from
    # the grid).
    deep, warp_items = request.param
    options_for_test(monkeypatch, decode_deep_ring=deep, decode_warp_items=warp_items)
    return request.param


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True])
def test_num_splits_agree(dtype, paged, ring):
    cp = _cupy()
    rng = np.random.default_rng(4)
    case = build_case(rng, batch=3, seqlen_q=2, nheads=16, nheads_kv=4, headdim=128, dtype=dtype,
                      capacity=2048, seqlens=[2046, 700, 1], seqlen_new=2, page_size=64 if paged else None)
    out1, lse1 = run_and_check(case, causal=True, num_splits=1)
    v_max = float(np.abs(case["logical_v"].astype(np.float64)).max())
    tol = 4 * UNIT_ROUNDOFF[dtype] * v_max + 1e-6
    o1, l1 = cp.asnumpy(out1).astype(np.float64), cp.asnumpy(lse1).astype(np.float64)
    for splits in (0, 2, 3, 7, 16, 64):
        out, lse = run_and_check(case, causal=True, num_splits=splits)
        err = np.abs(cp.asnumpy(out).astype(np.float64) - o1).max()
        assert err <= tol, f"num_splits={splits} vs 1: max|diff| = {err:.3e} > {tol:.3e}"
        lerr = np.abs(cp.asnumpy(lse).astype(np.float64) - l1)
        assert np.all(lerr <= 1e-3 * (1 + np.abs(l1))), f"num_splits={splits}: lse differs by {lerr.max():.3e}"


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("seqlen_new", [0, 1])
def test_non_finite_slots_past_the_rows_never_reach_the_output(seqlen_new, page_size, ring):
    # A cache's first key tiles load before cache_seqlens arrives, as if each row were full, and are loaded again
    # where the row is shorter (cuda/decode.cu): every slot past a row's keys holds NaN or +-inf here, so a kept
    # speculative tile (or any read past a row's length) would show as NaN in out or lse. Paged, the guess also
    # reads block_table entries past each row's pages, which hold values out of range here: those must be neither
    # read through nor reported. Lengths sit on either side of tile boundaries, for several split counts, at the
    # decode bar's head layout.
    rng = np.random.default_rng(21 + seqlen_new)
    capacity = 2048
    seqlens = np.array([0, 1, 31, 32, 33, 64, 255, 256, 257, 700, 2047, 2048], dtype=np.int32)
    seqlens = np.minimum(seqlens, capacity - seqlen_new)
    case = build_case(rng, batch=len(seqlens), seqlen_q=1, nheads=32, nheads_kv=8, headdim=128, dtype="bfloat16",
                      capacity=capacity, seqlens=seqlens, seqlen_new=seqlen_new, page_size=page_size)
    garbage = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
    for b, length in enumerate(seqlens):
        for cache in (case["logical_k"], case["logical_v"]):
            tail = cache[b, length:]
            tail[...] = rng.choice(garbage, size=tail.shape).astype(tail.dtype)
    if page_size is not None:
        table = case["block_table"]
        num_pages = case["phys_k"].shape[0]
        for phys, logical in ((case["phys_k"], case["logical_k"]), (case["phys_v"], case["logical_v"])):
            phys[...] = rng.choice(garbage, size=phys.shape).astype(phys.dtype)  # spare pages too
            for b, length in enumerate(seqlens):
                for j in range(-(-int(length) // page_size)):
                    phys[table[b, j]] = logical[b, j * page_size:(j + 1) * page_size]
        for b, length in enumerate(seqlens):
            used = -(-(int(length) + seqlen_new) // page_size)
            table[b, used:] = rng.choice([-1, num_pages, 2**31 - 1, -2**31], size=table.shape[1] - used)
    for splits in (0, 1, 3, 16):
        run_and_check(case, num_splits=splits)


@pytest.mark.parametrize("num_splits", [1, 0])
def test_decode_step_under_torch_cuda_graph(num_splits):
    # A decode step (append, then attention; at the bar's heads, 16 splits with num_splits=0) captured in a torch
    # CUDA graph and replayed on new q and new keys/values: each replay equals the same step run eagerly, bitwise.
    # On sm_90 the kernels are captured with programmatic launches (build.Launch), so the graph holds those
    # dependencies, and a replay follows the previous one's split merge.
    torch = pytest.importorskip("torch")
    fa2cupy = fa2cupy_module()
    gen = torch.Generator(device="cuda").manual_seed(5)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    b, capacity, hq, hkv, d = 2, 4096, 32, 8, 128
    q, k_cache, v_cache = randn(b, 1, hq, d), randn(b, capacity, hkv, d), randn(b, capacity, hkv, d)
    k_new, v_new = randn(b, 1, hkv, d), randn(b, 1, hkv, d)
    lens = torch.tensor([4000, 1234], device="cuda", dtype=torch.int32)

    def step():
        return fa2cupy.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens,
                                               num_splits=num_splits)

    with debug_poison(False):  # (the fast path, which graphs capture, takes no poisoning)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and plan outside the capture
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):
            for x in (q, k_new, v_new):
                x.copy_(randn(*x.shape))
            graph.replay()
            replayed = out.clone()
            eager = step()  # the same step again (the append writes the same values to the same slots)
            torch.cuda.synchronize()
            assert not torch.isnan(replayed).any()
            assert torch.equal(replayed, eager)
            assert torch.equal(k_cache[0, 4000], k_new[0, 0]) and torch.equal(v_cache[1, 1234], v_new[1, 0])


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("pretend_sms", [None, 3])
def test_split_merge_bitwise_whichever_block_merges(paged, pretend_sms, monkeypatch):
    # The last split block of a row to arrive merges the row; which block that is changes from launch to launch.
    # Repeated launches on the same inputs must give the same bits, and each must leave its arrival counters at 0
    # (the next launch on the stream starts from them, with no memset). A pretend 3-SM GPU makes blocks walk items
    # that merge.
    cp = _cupy()
    from fa2cupy import decode

    plans = []
    workspace = decode.DecodePlan.workspace

    def spy(plan, stream_ptr, framework, device):
        plans.append(plan)
        return workspace(plan, stream_ptr, framework, device)

    monkeypatch.setattr(decode.DecodePlan, "workspace", spy)
    options_for_test(monkeypatch, sm_count=pretend_sms)
    rng = np.random.default_rng(31 + paged + 2 * bool(pretend_sms))
    seqlens = rng.integers(2000, 4097, size=2)
    case = build_case(rng, batch=2, seqlen_q=1, nheads=32, nheads_kv=8, headdim=128, dtype="bfloat16",
                      capacity=4096, seqlens=seqlens, seqlen_new=0, page_size=64 if paged else None)
    q = cp.asarray(case["q"])
    k_cache, v_cache = cp.asarray(case["phys_k"]), cp.asarray(case["phys_v"])
    kwargs = dict(cache_seqlens=cp.asarray(case["seqlens"]), return_softmax_lse=True)
    if paged:
        kwargs["block_table"] = cp.asarray(case["block_table"])
    for splits in (16, 5):
        first_out, first_lse = (cp.asnumpy(x) for x in run_and_check(case, num_splits=splits))
        for _ in range(40):
            out, lse = _kvcache()(q, k_cache, v_cache, num_splits=splits, **kwargs)
            assert np.array_equal(_bits(cp.asnumpy(out)), _bits(first_out))
            assert np.array_equal(cp.asnumpy(lse).view(np.uint32), first_lse.view(np.uint32))
        cp.cuda.runtime.deviceSynchronize()
    assert plans and all(plan.splits > 1 for plan in plans)
    for plan in {id(plan): plan for plan in plans}.values():
        for array, _ in plan.workspaces.values():
            counters = cp.asnumpy(array[:plan.arrivals].view(cp.int32))
            assert counters.size == plan.arrivals and not counters.any(), counters


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("features", [False, True])
def test_blocks_walking_several_items(paged, features, monkeypatch, ring):
    # More work items than the GPU holds blocks: the launch has fewer blocks, each walking items in grid strides
    # with its K/V ring running on into the next item. A pretend 3-SM GPU makes each block walk 8 to 24 items,
    # with rows of 0 to 10 key tiles (so some warps have none) and, with num_splits=3, a split merge per item.
    # (The module's calls are poisoned, so each is planned: the spy sees every launch's grid.)
    from fa2cupy import decode

    launches = []
    attention_grid = decode._attention_grid

    def spy(function, config, device, items, sms):
        blocks, smem = attention_grid(function, config, device, items, sms)
        launches.append((blocks, items))
        return blocks, smem

    monkeypatch.setattr(decode, "_attention_grid", spy)
    options_for_test(monkeypatch, sm_count=3)
    rng = np.random.default_rng(11 + paged + 2 * features)
    seqlens = rng.integers(0, 300, size=12)
    seqlens[:3] = [0, 299, 1]
    case = build_case(rng, batch=12, seqlen_q=2, nheads=8, nheads_kv=2, headdim=128, dtype="bfloat16",
                      capacity=300, seqlens=seqlens, seqlen_new=1, page_size=16 if paged else None)
    f = make_features(rng, case, window=(64, 3), softcap=5.0, alibi="batch",
                      leftpad=None if paged else "random") if features else None
    for causal in (False, True):
        for splits in (0, 1, 3):
            if features:
                run_features(case, f, causal=causal, num_splits=splits)
            else:
                run_and_check(case, causal=causal, num_splits=splits)
    assert launches and all(blocks == 3 < items for blocks, items in launches), launches


@contextlib.contextmanager
def _warp_items_forced(pretend_sms=None):
    """Warp items forced on (KernelOptions.decode_warp_items; and, given, a pretend SM count); yields the list of
    the decode plans made meanwhile (the module's calls are poisoned, so each is planned). (A context manager, not
    monkeypatch: Hypothesis tests cannot take it.)"""
    from fa2cupy import decode

    plans, plan_decode = [], decode.plan_decode

    def recording(*args, **kwargs):
        plans.append(plan_decode(*args, **kwargs))
        return plans[-1]

    with kernel_options(decode_warp_items=True, sm_count=pretend_sms), pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "plan_decode", recording)
        yield plans


@settings(max_examples=20)
@given(kv_cases(), st.integers(1, 4))
def test_warp_items_match_reference(c, pretend_sms):
    # Warps that stream whole work items alone (the d=128 row's warp-items twin, one split) against the float64
    # reference, on a pretend GPU of 1 to 4 SMs so that warps walk several items, rows of every length included.
    note(repr(c))
    rng = np.random.default_rng(c["seed"])
    case = build_case(
        rng, batch=c["batch"], seqlen_q=c["seqlen_q"], nheads=c["nheads"], nheads_kv=c["nheads_kv"],
        headdim=128, dtype=c["dtype"], capacity=c["capacity"], seqlens=c["seqlens"],
        seqlen_new=c["seqlen_new"], page_size=c["page_size"], use_batch_idx=c["use_batch_idx"],
        extra_pages=c["extra_pages"], headdim_v=c["headdim_v"] if (c["headdim_v"] or 0) <= 128 else None,
    )  # (v's head dim kept to the d = 128 row, which has the warp-items twin)
    with _warp_items_forced(pretend_sms) as plans:
        run_and_check(case, causal=c["causal"], num_splits=1, softmax_scale=c["softmax_scale"],
                      return_lse=c["return_lse"])
    assert plans and all(plan.splits == 1 and plan.config.warp_items for plan in plans), plans


# A kernel that lets the next one start at once (programmatic launch), then rewrites a table after a pause.
_LATE_WRITER = r"""
extern "C" __global__ void late_writer(int* table, const int* values, int n, unsigned long long pause_ns) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < pause_ns);
    for (int i = threadIdx.x; i < n; i += blockDim.x) table[i] = values[i];
}
"""


@pytest.mark.parametrize("page_size", [16, 64])
def test_block_table_written_by_the_kernel_before(page_size):
    # The decode kernel reads the block_table entries of its first tiles before griddepcontrol.wait, as guesses.
    # Here the kernel right before it (whose programmatic launch lets the decode blocks start while it runs) rewrites
    # the table after a pause: the guesses read the old table, whose pages hold other keys, and the kernel must
    # find that out after the wait and load those tiles again. The result must equal the same call on a table
    # that was never rewritten, bitwise, and the reference. (On GPUs without programmatic launches the writer
    # simply runs first.)
    cp = _cupy()
    rng = np.random.default_rng(page_size)
    case = build_case(rng, batch=2, seqlen_q=1, nheads=32, nheads_kv=8, headdim=128, dtype="bfloat16",
                      capacity=4096, seqlens=[4096, 3000], seqlen_new=0, page_size=page_size)
    new_table = case["block_table"]
    old_table = np.ascontiguousarray(np.roll(new_table, 1, axis=1))  # each entry names another logical page
    writer = cp.RawKernel(_LATE_WRITER, "late_writer")
    k_cache, v_cache = cp.asarray(case["phys_k"]), cp.asarray(case["phys_v"])
    q, lens = cp.asarray(case["q"]), cp.asarray(case["seqlens"])
    values = cp.asarray(new_table)

    def run(table):
        return _kvcache()(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, num_splits=16,
                          return_softmax_lse=True)

    want_out, want_lse = run(values)  # poisoned outputs: every element written
    check_outputs(case, want_out, want_lse, None, False)
    with debug_poison(False):  # (no fill kernel between the writer and the decode kernel)
        run(values)  # the plan and its split workspace exist before the timed pair
        for _ in range(5):
            table = cp.asarray(old_table)
            cp.cuda.runtime.deviceSynchronize()
            writer((1,), (256,), (table, values, np.int32(values.size), np.uint64(50_000)))
            out, lse = run(table)
            cp.cuda.runtime.deviceSynchronize()
            assert cp.array_equal(table, values)
            assert np.array_equal(_bits(cp.asnumpy(out)), _bits(cp.asnumpy(want_out)))
            assert cp.array_equal(lse, want_lse)


def test_non_default_stream():
    cp = _cupy()
    rng = np.random.default_rng(5)
    case = build_case(rng, batch=2, seqlen_q=1, nheads=4, nheads_kv=1, headdim=64, dtype="float16",
                      capacity=256, seqlens=[100, 255], seqlen_new=1, page_size=32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        out, lse, k_cache, v_cache = call(case, num_splits=3)
    s.synchronize()
    check_cache(case, k_cache, v_cache)
    check_outputs(case, out, lse, None, False)


# ------------------------------------------------------------------ errors (cheap, but they need CuPy arrays)


def _valid_args(paged=False, headdim=64):
    """Keyword arguments of a small valid call: batch 2, seqlen_q 1, 4/2 heads, d 64, capacity 64, append 2."""
    cp = _cupy()
    rng = np.random.default_rng(6)
    case = build_case(rng, batch=2, seqlen_q=1, nheads=4, nheads_kv=2, headdim=headdim, dtype="float16",
                      capacity=64, seqlens=[3, 40], seqlen_new=2, page_size=16 if paged else None)
    args = dict(q=cp.asarray(case["q"]), k_cache=cp.asarray(case["phys_k"]), v_cache=cp.asarray(case["phys_v"]),
                k=cp.asarray(case["k_new"]), v=cp.asarray(case["v_new"]), cache_seqlens=cp.asarray(case["seqlens"]))
    if paged:
        args["block_table"] = cp.asarray(case["block_table"])
    return args


def _assert_rejected(exc, match, args):
    """The call with ``args`` raises ``exc`` matching ``match``, and neither cache changed."""
    cp = _cupy()
    before = {n: np.ascontiguousarray(cp.asnumpy(args[n])) for n in ("k_cache", "v_cache")
              if hasattr(args.get(n), "shape")}
    with pytest.raises(exc, match=match):
        _kvcache()(**args)
    cp.cuda.runtime.deviceSynchronize()
    _assert_unchanged(args, before)


def _assert_unchanged(args, before):
    cp = _cupy()
    for n, old in before.items():
        assert np.array_equal(np.ascontiguousarray(cp.asnumpy(args[n])).view(np.uint8), old.view(np.uint8)), \
            f"{n} was modified by a rejected call"


def _assert_rejected_on_device(match, args, bad_rows):
    """A bad value inside a device array: the call itself returns (no synchronisation), the rows ``bad_rows`` of
    its output are NaN, the caches are untouched, and fa2cupy.check_device_errors() raises ValueError matching
    ``match``; the same report is not raised twice, and a valid call afterwards is fine again."""
    import fa2cupy

    cp = _cupy()
    before = {n: np.ascontiguousarray(cp.asnumpy(args[n])) for n in ("k_cache", "v_cache")}
    out = _kvcache()(**args)
    host = cp.asnumpy(out).astype(np.float32)
    for b in bad_rows:
        assert np.isnan(host[b]).all(), f"row {b} of a call with a bad value is not NaN"
    with pytest.raises(ValueError, match=match):
        fa2cupy.check_device_errors()
    _assert_unchanged(args, before)
    fa2cupy.check_device_errors()  # reported once, then cleared
    valid = _valid_args(paged="block_table" in args)
    assert not np.isnan(cp.asnumpy(_kvcache()(**valid)).astype(np.float32)).any()


@pytest.mark.parametrize("paged", [False, True])
def test_valid_args_accepted(paged):
    # The base of the error tests below must itself be valid, or they prove nothing.
    out = _kvcache()(**_valid_args(paged))
    assert out.shape == (2, 1, 4, 64)


@pytest.mark.parametrize("paged", [False, True])
def test_append_past_capacity_rejected(paged):
    cp = _cupy()
    args = _valid_args(paged)
    args["cache_seqlens"] = 63  # Python int form: checked on the host, raised by the call itself
    _assert_rejected(ValueError, "cache_seqlens", args)
    args["cache_seqlens"] = -1
    _assert_rejected(ValueError, "cache_seqlens", args)
    # Device arrays: checked by the kernels. With an append, one bad row stops the whole append and poisons
    # every row (the others would attend to keys that were not written).
    args["cache_seqlens"] = cp.asarray([3, 63], dtype=cp.int32)  # row 1: 63 + 2 > 64
    _assert_rejected_on_device(r"cache_seqlens\[1\] = 63", args, bad_rows=[0, 1])
    args["cache_seqlens"] = cp.asarray([-1, 3], dtype=cp.int32)
    _assert_rejected_on_device(r"cache_seqlens\[0\] = -1", args, bad_rows=[0, 1])
    args = _valid_args(paged)
    del args["k"], args["v"]
    args["cache_seqlens"] = cp.asarray([3, 65], dtype=cp.int32)  # past capacity even without an append
    _assert_rejected_on_device(r"cache_seqlens\[1\] = 65", args, bad_rows=[1])


def test_error_raised_by_the_next_call():
    # Without check_device_errors(), the next call raises the pending report itself (before launching anything).
    cp = _cupy()
    args = _valid_args()
    args["cache_seqlens"] = cp.asarray([3, 64], dtype=cp.int32)
    _kvcache()(**args)
    cp.cuda.runtime.deviceSynchronize()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 64"):
        _kvcache()(**_valid_args())
    assert not np.isnan(cp.asnumpy(_kvcache()(**_valid_args())).astype(np.float32)).any()


@pytest.mark.parametrize("bad", [-1, "num_pages"])
@pytest.mark.parametrize("append", [True, False])
def test_block_table_entry_out_of_range(bad, append):
    args = _valid_args(paged=True)
    table = args["block_table"].copy()
    value = args["k_cache"].shape[0] if bad == "num_pages" else bad
    table[1, 0] = value
    args["block_table"] = table
    if not append:
        del args["k"], args["v"]
    _assert_rejected_on_device(rf"block_table\[1, 0\] = {value}", args, bad_rows=[0, 1] if append else [1])


@pytest.mark.parametrize("paged", [False, True])
def test_bad_values_found_by_warp_items(paged):
    # The warp-items kernel (d=128, one split; forced) checks the index values as the block kernels do: the bad
    # rows are NaN, the caches untouched, the value reported once.
    cp = _cupy()
    with _warp_items_forced() as plans:
        args = _valid_args(paged, headdim=128)
        del args["k"], args["v"]
        args["num_splits"] = 1
        args["cache_seqlens"] = cp.asarray([3, 65], dtype=cp.int32)  # past capacity
        _assert_rejected_on_device(r"cache_seqlens\[1\] = 65", args, bad_rows=[1])
        args = dict(_valid_args(paged, headdim=128), num_splits=1)
        if paged:
            table = args["block_table"].copy()
            table[1, 0] = -1
            args["block_table"] = table
            _assert_rejected_on_device(r"block_table\[1, 0\] = -1", args, bad_rows=[0, 1])
        else:
            args["cache_batch_idx"] = cp.asarray([0, 2], dtype=cp.int32)  # k_cache has 2 rows
            _assert_rejected_on_device(r"cache_batch_idx\[1\] = 2", args, bad_rows=[0, 1])
    solo = [plan.config.warp_items for plan in plans if plan.config.headdim == 128]
    assert solo and all(solo), plans


def test_cache_batch_idx_out_of_range():
    cp = _cupy()
    args = _valid_args()
    args["cache_batch_idx"] = cp.asarray([0, 2], dtype=cp.int32)  # k_cache has 2 rows
    _assert_rejected_on_device(r"cache_batch_idx\[1\] = 2", args, bad_rows=[0, 1])
    del args["k"], args["v"]
    args["cache_batch_idx"] = cp.asarray([-1, 1], dtype=cp.int32)
    _assert_rejected_on_device(r"cache_batch_idx\[0\] = -1", args, bad_rows=[0])


def test_paged_argument_errors():
    cp = _cupy()
    args = _valid_args(paged=True)
    table64 = args["block_table"].astype(cp.int64)
    _assert_rejected((TypeError, ValueError), "block_table", dict(args, block_table=table64))
    _assert_rejected(ValueError, "block_table", dict(args, block_table=args["block_table"][:1]))  # batch 1 != 2
    _assert_rejected(ValueError, "block_table", dict(args, block_table=args["block_table"][0]))  # 1-D
    _assert_rejected(ValueError, "cache_batch_idx",
                     dict(args, cache_batch_idx=cp.asarray([1, 0], dtype=cp.int32)))
    _assert_rejected(ValueError, "cache_seqlens", dict(args, cache_seqlens=None))
    # page_size 8 (not a multiple of 16): same pool reshaped to twice as many half pages.
    kc, vc = (x.reshape(x.shape[0] * 2, 8, *x.shape[2:]) for x in (args["k_cache"], args["v_cache"]))
    _assert_rejected(ValueError, r"page_size|k_cache", dict(args, k_cache=kc, v_cache=vc))


def test_shape_and_dtype_errors():
    cp = _cupy()
    args = _valid_args()
    q, kc, k = args["q"], args["k_cache"], args["k"]
    cases = [
        (TypeError, r"\bq\b", dict(q=q.astype(cp.float32))),
        (TypeError, r"\bq\b|k_cache", dict(q=cp.asarray(cp.asnumpy(q).astype(_np_dtype("bfloat16"))))),
        (TypeError, r"\bk\b", dict(k=k.astype(cp.float32))),
        (ValueError, r"\bq\b", dict(q=q[:, 0])),  # 3-D
        (ValueError, r"k_cache", dict(k_cache=kc[0])),  # 3-D
        (ValueError, r"k_cache|v_cache", dict(k_cache=kc[..., :32])),  # headdim mismatch
        (ValueError, r"v_cache", dict(v_cache=args["v_cache"][:, :32])),  # capacity != k_cache's
        (ValueError, r"\bk\b", dict(k=k[:, :, :1])),  # nheads_kv mismatch
        (ValueError, r"\bv\b", dict(v=args["v"][:, :1])),  # seqlen_new mismatch
        (ValueError, r"\bv\b", dict(v=None)),  # k without v
        (ValueError, r"\bk\b", dict(k=None)),  # v without k
        (ValueError, r"nheads|\bq\b|k_cache", dict(q=q[:, :, :3])),  # 3 heads over 2 kv heads
        (ValueError, r"cache_seqlens", dict(cache_seqlens=args["cache_seqlens"][:1])),  # wrong length
        ((TypeError, ValueError), r"cache_seqlens", dict(cache_seqlens=args["cache_seqlens"].astype(cp.int64))),
        ((TypeError, ValueError), r"cache_batch_idx",
         dict(cache_batch_idx=cp.asarray([1, 0], dtype=cp.int64))),
        (ValueError, r"cache_batch_idx", dict(cache_batch_idx=cp.asarray([0], dtype=cp.int32))),  # wrong length
    ]
    for exc, match, change in cases:
        _assert_rejected(exc, match, dict(args, **change))


# ------------------------------------------------------------------ window, softcap, ALiBi, leftpad, rotary


def _effective_window(window, causal, capacity):
    """flash-attn's normalisation: causal sets the right side to 0; a side of at least the capacity is no limit."""
    left, right = (int(w) for w in window)
    if causal:
        right = 0
    return (-1 if left >= capacity else left), (-1 if right >= capacity else right)


def make_features(rng, case, *, window=(-1, -1), softcap=0.0, alibi=None, leftpad=None, rotary_dim=0,
                  interleaved=True, seqlen_ro=None):
    """Host arrays of the optional arguments. alibi: None, "heads" ((nheads,) slopes) or "batch" ((batch,
    nheads)); leftpad: None, "random" (each in [0, cache_seqlens[b]]) or a list; rotary_dim 0 means none
    (seqlen_ro defaults to capacity + seqlen_q, enough for every q position)."""
    batch, seqlen_q, nheads = case["q"].shape[:3]
    f = dict(window=tuple(window), softcap=float(softcap), alibi=None, leftpad=None, rotary=None)
    if alibi == "heads":
        f["alibi"] = rng.uniform(0.0, 0.3, nheads).astype(np.float32)
    elif alibi == "batch":
        f["alibi"] = rng.uniform(0.0, 0.3, (batch, nheads)).astype(np.float32)
    if leftpad is not None:
        pads = [int(rng.integers(0, s + 1)) for s in case["seqlens"]] if leftpad == "random" else leftpad
        f["leftpad"] = np.asarray(pads, dtype=np.int32)
    if rotary_dim:
        rows = seqlen_ro or case["capacity"] + seqlen_q
        angle = rng.uniform(0.0, 2 * np.pi, (rows, rotary_dim // 2))
        dt = _np_dtype(case["dtype"])
        f["rotary"] = dict(cos=np.cos(angle).astype(dt), sin=np.sin(angle).astype(dt), interleaved=interleaved)
    return f


def rotary_positions(case, f, causal):
    """(q positions (batch, seqlen_q), new-key positions (batch, seqlen_new)): flash-attn's rule."""
    left, right = _effective_window(f["window"], causal, case["capacity"])
    seqlen_q, n = case["q"].shape[1], case["seqlen_new"]
    s = case["seqlens"].astype(np.int64)[:, None]
    q_pos = s + (np.arange(seqlen_q)[None] if left >= 0 or right >= 0 else 0) + np.zeros((1, seqlen_q), np.int64)
    return q_pos, s + np.arange(n)[None]


def _round(x, dtype):
    return x.astype(_np_dtype(dtype)).astype(np.float64)


def call_features(case, f, *, causal=False, num_splits=0, softmax_scale=None, return_lse=True,
                  seqlens_form="array"):
    """Like call(), with the features of ``f``; also checks that the caller's q and k were not modified."""
    cp = _cupy()
    paged = case["block_table"] is not None
    k_cache = cp.asarray(case["phys_k"] if paged else case["logical_k"])
    v_cache = cp.asarray(case["phys_v"] if paged else case["logical_v"])
    seqlens = case["seqlens"]
    cache_seqlens = cp.asarray(seqlens) if seqlens_form == "array" else int(seqlens[0])
    kwargs = dict(cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, causal=causal, window_size=f["window"],
                  softcap=f["softcap"], num_splits=num_splits, return_softmax_lse=return_lse)
    if case["seqlen_new"]:
        kwargs.update(k=cp.asarray(case["k_new"]), v=cp.asarray(case["v_new"]))
    if case["cache_batch_idx"] is not None:
        kwargs["cache_batch_idx"] = cp.asarray(case["cache_batch_idx"])
    if paged:
        kwargs["block_table"] = cp.asarray(case["block_table"])
    if f["alibi"] is not None:
        kwargs["alibi_slopes"] = cp.asarray(f["alibi"])
    if f["leftpad"] is not None:
        kwargs["cache_leftpad"] = cp.asarray(f["leftpad"])
    if f["rotary"] is not None:
        kwargs.update(rotary_cos=cp.asarray(f["rotary"]["cos"]), rotary_sin=cp.asarray(f["rotary"]["sin"]),
                      rotary_interleaved=f["rotary"]["interleaved"])
    q = cp.asarray(case["q"])
    res = _kvcache()(q, k_cache, v_cache, **kwargs)
    out, lse = res if return_lse else (res, None)
    cp.cuda.runtime.deviceSynchronize()
    assert out.shape == q.shape[:3] + v_cache.shape[3:] and out.dtype == q.dtype
    assert np.array_equal(_bits(cp.asnumpy(q)), _bits(case["q"])), "q was modified"
    if case["seqlen_new"]:
        assert np.array_equal(_bits(cp.asnumpy(kwargs["k"])), _bits(case["k_new"])), "k was modified"
    return out, lse, k_cache, v_cache


def _append_slot(case, b, t):
    """Physical index (cache row or page, slot) of the t-th appended key of batch row b."""
    pos = int(case["seqlens"][b]) + t
    if case["block_table"] is None:
        return cache_row(case, b), pos
    ps = case["page_size"]
    return int(case["block_table"][b, pos // ps]), pos % ps


def check_cache_features(case, f, causal, k_cache, v_cache):
    """v_cache bitwise as expected_after(); k_cache too, except the rotated columns of the appended keys, which
    must lie within one rounding (of the dtype, plus fp32 arithmetic) of the float64 rotation of k."""
    cp = _cupy()
    if f["rotary"] is None or case["seqlen_new"] == 0:
        check_cache(case, k_cache, v_cache)
        return
    rot = f["rotary"]
    _, k_pos = rotary_positions(case, f, causal)
    k_rot = apply_rotary_ref(case["k_new"], rot["cos"], rot["sin"], k_pos, rot["interleaved"])
    rounded = k_rot.astype(_np_dtype(case["dtype"]))
    lk, lv, pk, pv = expected_after(dict(case, k_new=rounded))
    want_k, want_v = (pk, pv) if case["block_table"] is not None else (lk, lv)
    got_k, got_v = cp.asnumpy(k_cache), cp.asnumpy(v_cache)
    assert np.array_equal(_bits(got_v), _bits(want_v)), "v_cache differs from the expected post-append state"
    rotary_dim = 2 * rot["cos"].shape[1]
    allowed = np.zeros(got_k.shape, dtype=bool)
    ref = want_k.astype(np.float64)
    for b in range(case["batch"]):
        for t in range(case["seqlen_new"]):
            where = _append_slot(case, b, t)
            allowed[where][..., :rotary_dim] = True
            ref[where] = k_rot[b, t]
    differs = _bits(got_k) != _bits(want_k)
    assert not (differs & ~allowed).any(), \
        f"k_cache differs outside the rotated columns at {np.argwhere(differs & ~allowed)[:8].tolist()}"
    u = UNIT_ROUNDOFF[case["dtype"]]
    tol = u * np.abs(ref) + 2.0**-22 * float(np.abs(case["k_new"].astype(np.float64)).max()) + 2.0**-24
    err = np.abs(got_k.astype(np.float64) - ref)
    bad = allowed & (err > tol)
    assert not bad.any(), f"rotated keys off by more than one rounding at {np.argwhere(bad)[:8].tolist()}"


def _logical(case, phys):
    if case["block_table"] is None:
        return phys
    table = case["block_table"]
    gathered = phys[table]  # (batch, max_pages, page_size, hkv, d)
    return gathered.reshape(table.shape[0], -1, *phys.shape[2:])


def check_outputs_features(case, f, out, lse, k_cache, v_cache, softmax_scale, causal):
    """out/lse against attention_ref per batch row, over that row's keys as the call left them in the cache."""
    cp = _cupy()
    lk, lv = _logical(case, cp.asnumpy(k_cache)), _logical(case, cp.asnumpy(v_cache))
    out_h = cp.asnumpy(out).astype(np.float64)
    lse_h = None if lse is None else cp.asnumpy(lse).astype(np.float64)
    assert not np.isnan(out_h).any(), "out has NaN"
    window = _effective_window(f["window"], causal, case["capacity"])
    q = case["q"].astype(np.float64)
    if f["rotary"] is not None:
        rot = f["rotary"]
        q_pos, _ = rotary_positions(case, f, causal)
        q = _round(apply_rotary_ref(case["q"], rot["cos"], rot["sin"], q_pos, rot["interleaved"]), case["dtype"])
    u = UNIT_ROUNDOFF[case["dtype"]]
    for b in range(case["batch"]):
        row = b if case["block_table"] is not None else cache_row(case, b)
        pad = 0 if f["leftpad"] is None else int(f["leftpad"][b])
        end = int(case["seqlens"][b]) + case["seqlen_new"]
        if end - pad == 0:
            assert np.all(out_h[b] == 0.0), f"row {b} has no key: out must be exactly 0"
            if lse_h is not None:
                assert np.all(lse_h[b] == np.inf), f"row {b} has no key: lse must be +inf"
            continue
        k_rows, v_rows = lk[row:row + 1, pad:end], lv[row:row + 1, pad:end]
        slopes = f["alibi"] if f["alibi"] is None or f["alibi"].ndim == 1 else f["alibi"][b:b + 1]
        ref_out, ref_lse = attention_ref(q[b:b + 1], k_rows, v_rows, softmax_scale, causal, window, f["softcap"],
                                         slopes)
        _check_row(b, f"keys [{pad}, {end})", out_h, lse_h, ref_out[0], ref_lse[0], v_rows, u)


def run_features(case, f, **kw):
    out, lse, k_cache, v_cache = call_features(case, f, **kw)
    check_cache_features(case, f, kw.get("causal", False), k_cache, v_cache)
    check_outputs_features(case, f, out, lse, k_cache, v_cache, kw.get("softmax_scale"), kw.get("causal", False))
    return out, lse


@st.composite
def feature_cases(draw):
    c = draw(kv_cases())
    paged = c["page_size"] is not None
    window = draw(st.one_of(st.sampled_from([(-1, -1), (0, 0), (3, 0), (16, -1), (-1, 2), (40, 5), (-1, 0)]),
                            st.tuples(st.integers(-1, 700), st.integers(-1, 20))))
    rotary_dim = draw(st.sampled_from([0, 0, 2, 16, 32, 40, c["headdim"]]))
    c.update(window=window, softcap=draw(st.sampled_from([0.0, 0.0, 5.0, 30.0])),
             alibi=draw(st.sampled_from([None, None, "heads", "batch"])),
             leftpad=None if paged else draw(st.sampled_from([None, "random", "random"])),
             rotary_dim=rotary_dim if rotary_dim <= c["headdim"] else 0, interleaved=draw(st.booleans()))
    return c


@settings(max_examples=30)
@given(feature_cases())
def test_features_match_reference(c):
    note(repr(c))
    rng = np.random.default_rng(c["seed"])
    case = build_case(
        rng, batch=c["batch"], seqlen_q=c["seqlen_q"], nheads=c["nheads"], nheads_kv=c["nheads_kv"],
        headdim=c["headdim"], dtype=c["dtype"], capacity=c["capacity"], seqlens=c["seqlens"],
        seqlen_new=c["seqlen_new"], page_size=c["page_size"], use_batch_idx=c["use_batch_idx"],
        extra_pages=c["extra_pages"], headdim_v=c["headdim_v"],
    )
    f = make_features(rng, case, window=c["window"], softcap=c["softcap"], alibi=c["alibi"], leftpad=c["leftpad"],
                      rotary_dim=c["rotary_dim"], interleaved=c["interleaved"])
    run_features(case, f, causal=c["causal"], num_splits=c["num_splits"], softmax_scale=c["softmax_scale"],
                 return_lse=c["return_lse"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("window,causal", [
    ((0, 0), False),  # each query sees one key; with seqlen_q > keys, the first queries see none
    ((2, 0), True), ((5, 3), False), ((-1, 0), False), ((0, -1), False), ((1000, 1000), False), ((40, 0), True),
])
def test_windows(dtype, paged, window, causal):
    rng = np.random.default_rng(len(window) + window[0] + 7 * causal)
    case = build_case(rng, batch=4, seqlen_q=8, nheads=8, nheads_kv=2, headdim=128, dtype=dtype, capacity=320,
                      seqlens=[0, 3, 150, 318], seqlen_new=2, page_size=32 if paged else None)
    f = make_features(rng, case, window=window)
    for splits in (1, 3):
        run_features(case, f, causal=causal, num_splits=splits)


def test_small_window_over_a_long_cache_is_cheap(monkeypatch):
    # 4 x 64k keys (1 GB of K/V), a 256-key window: the kernel reads a few tiles per row, not the cache. Ten calls
    # back to back between the events (cached dispatch, no output poisoning), so the full attention is GPU-bound.
    options_for_test(monkeypatch, debug_poison=False)
    cp = _cupy()
    rng = np.random.default_rng(8)
    b, h, hkv, d, capacity, window = 4, 32, 8, 128, 65536, 256
    k_cache = cp.asarray(_randn(rng, (b, capacity, hkv, d), "bfloat16"))
    v_cache = cp.asarray(_randn(rng, (b, capacity, hkv, d), "bfloat16"))
    q = cp.asarray(_randn(rng, (b, 1, h, d), "bfloat16"))
    lens = cp.asarray([capacity, capacity - 1000, 300, 5], dtype=cp.int32)

    def median_ms(**kw):
        _kvcache()(q, k_cache, v_cache, cache_seqlens=lens, **kw)  # compile, warm up, cache the plan
        times = []
        for _ in range(7):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(10):
                _kvcache()(q, k_cache, v_cache, cache_seqlens=lens, **kw)
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / 10)
        return float(np.median(times))

    full, windowed = median_ms(causal=True), median_ms(causal=True, window_size=(window, 0))
    print(f"decode over 4 x 64k keys: full causal {full:.3f} ms, (256, 0) window {windowed:.3f} ms")
    assert windowed < 0.25 * full, f"a 256-key window over 64k keys took {windowed:.3f} ms vs {full:.3f} ms full"
    # And it is right: one query sees the last window + 1 keys of its row, i.e. plain attention over those.
    out, lse = _kvcache()(q, k_cache, v_cache, cache_seqlens=lens, causal=True, window_size=(window, 0),
                          return_softmax_lse=True)
    out_h, lse_h = cp.asnumpy(out).astype(np.float64), cp.asnumpy(lse).astype(np.float64)
    for row, n in enumerate(cp.asnumpy(lens).tolist()):
        lo = max(0, n - window - 1)
        k_rows, v_rows = cp.asnumpy(k_cache[row:row + 1, lo:n]), cp.asnumpy(v_cache[row:row + 1, lo:n])
        ref_out, ref_lse = attention_ref(cp.asnumpy(q[row:row + 1]), k_rows, v_rows)
        tol = 4 * UNIT_ROUNDOFF["bfloat16"] * float(np.abs(v_rows.astype(np.float64)).max()) + 1e-6
        assert np.abs(out_h[row] - ref_out[0]).max() <= tol, row
        assert np.all(np.abs(lse_h[row] - ref_lse[0]) <= 1e-3 * (1 + np.abs(ref_lse[0]))), row


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("softcap", [0.0, 10.0])
@pytest.mark.parametrize("alibi", [None, "heads", "batch"])
@pytest.mark.parametrize("paged", [False, True])
def test_softcap_and_alibi(dtype, softcap, alibi, paged):
    if softcap == 0.0 and alibi is None:
        pytest.skip("the plain decode (tested above)")
    rng = np.random.default_rng(int(softcap) + len(str(alibi)))
    case = build_case(rng, batch=3, seqlen_q=4, nheads=16, nheads_kv=4, headdim=64, dtype=dtype, capacity=500,
                      seqlens=[0, 200, 496], seqlen_new=4, page_size=16 if paged else None)
    f = make_features(rng, case, softcap=softcap, alibi=alibi)
    for causal in (False, True):
        for splits in (0, 1, 5):
            run_features(case, f, causal=causal, num_splits=splits)
    # Scores large enough for the cap to bite: q scaled up.
    case["q"] = (case["q"].astype(np.float32) * 8).astype(_np_dtype(dtype))
    run_features(case, f, causal=False, num_splits=2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("use_batch_idx", [False, True])
@pytest.mark.parametrize("window,causal", [((-1, -1), False), ((-1, -1), True), ((6, 0), False), ((3, 2), True)])
def test_cache_leftpad(dtype, use_batch_idx, window, causal):
    rng = np.random.default_rng(5 + use_batch_idx)
    # Pads: none, some, all the cached keys (only the appended ones remain), and an empty row (pad 0 of 0).
    case = build_case(rng, batch=5, seqlen_q=3, nheads=8, nheads_kv=2, headdim=96, dtype=dtype, capacity=200,
                      seqlens=[50, 120, 40, 0, 197], seqlen_new=3, use_batch_idx=use_batch_idx)
    f = make_features(rng, case, window=window, leftpad=[0, 70, 40, 0, 196], alibi="heads")
    run_features(case, f, causal=causal, num_splits=3)
    # Without an append: a row whose pad equals its length has no key at all (out 0, lse +inf).
    case = build_case(rng, batch=3, seqlen_q=2, nheads=8, nheads_kv=2, headdim=64, dtype=dtype, capacity=100,
                      seqlens=[30, 30, 99], seqlen_new=0, use_batch_idx=use_batch_idx)
    f = make_features(rng, case, window=window, leftpad=[30, 5, 0])
    run_features(case, f, causal=causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("headdim,rotary_dim", [(128, 128), (128, 64), (64, 2), (40, 24), (256, 96)])
@pytest.mark.parametrize("paged", [False, True])
def test_rotary(dtype, interleaved, headdim, rotary_dim, paged):
    rng = np.random.default_rng(headdim + rotary_dim + interleaved)
    for seqlen_q, new, causal, window in ((1, 1, False, (-1, -1)), (4, 4, True, (-1, -1)),
                                         (24, 24, True, (-1, -1)), (5, 2, False, (-1, -1)),
                                         (6, 6, False, (10, 0)), (3, 3, False, (700, 700))):
        case = build_case(rng, batch=3, seqlen_q=seqlen_q, nheads=8, nheads_kv=2, headdim=headdim, dtype=dtype,
                          capacity=160, seqlens=[0, 17, 160 - max(new, seqlen_q)], seqlen_new=new,
                          page_size=16 if paged else None)
        f = make_features(rng, case, window=window, rotary_dim=rotary_dim, interleaved=interleaved,
                          seqlen_ro=case["capacity"])
        run_features(case, f, causal=causal, num_splits=2)


def test_rotary_with_leftpad_uses_the_slot_as_position():
    # flash-attn: the new key at slot cache_seqlens[b] + t is rotated at that position, pad included.
    rng = np.random.default_rng(9)
    case = build_case(rng, batch=2, seqlen_q=2, nheads=4, nheads_kv=4, headdim=64, dtype="float16", capacity=64,
                      seqlens=[20, 33], seqlen_new=2)
    f = make_features(rng, case, leftpad=[7, 30], rotary_dim=64)
    run_features(case, f, causal=True)


@pytest.mark.parametrize("paged", [False, True])
def test_features_in_a_cached_decode_loop(paged, monkeypatch):
    # The cached fast path (no output poisoning) replays the plan with its rotary buffer and extra pointers.
    options_for_test(monkeypatch, debug_poison=False)
    cp = _cupy()
    rng = np.random.default_rng(10)
    batch, h, hkv, d, dtype = 2, 8, 2, 64, "bfloat16"
    case = build_case(rng, batch=batch, seqlen_q=1, nheads=h, nheads_kv=hkv, headdim=d, dtype=dtype,
                      capacity=96, seqlens=[14, 40], seqlen_new=1, page_size=16 if paged else None)
    f = make_features(rng, case, window=(8, 0), softcap=20.0, alibi="batch", rotary_dim=32, interleaved=False)
    k_cache = cp.asarray(case["phys_k" if paged else "logical_k"])
    v_cache = cp.asarray(case["phys_v" if paged else "logical_v"])
    extra = dict(block_table=cp.asarray(case["block_table"])) if paged else {}
    rot = f["rotary"]
    cos, sin, slopes = cp.asarray(rot["cos"]), cp.asarray(rot["sin"]), cp.asarray(f["alibi"])
    seqlens = case["seqlens"].copy()
    for _ in range(4):
        q = _randn(rng, (batch, 1, h, d), dtype)
        kn, vn = _randn(rng, (batch, 1, hkv, d), dtype), _randn(rng, (batch, 1, hkv, d), dtype)
        step = dict(case, q=q, k_new=kn, v_new=vn, seqlens=seqlens.copy(), seqlen_new=1)
        out, lse = _kvcache()(cp.asarray(q), k_cache, v_cache, k=cp.asarray(kn), v=cp.asarray(vn),
                              cache_seqlens=cp.asarray(seqlens), rotary_cos=cos, rotary_sin=sin,
                              rotary_interleaved=False, causal=True, window_size=(8, 0), softcap=20.0,
                              alibi_slopes=slopes, return_softmax_lse=True, **extra)
        cp.cuda.runtime.deviceSynchronize()
        check_outputs_features(step, f, out, lse, k_cache, v_cache, None, True)
        seqlens += 1


# ------------------------------------------------------------------ errors of the features (caches untouched)


def _feature_args(paged=False):
    cp = _cupy()
    args = _valid_args(paged)  # batch 2, seqlen_q 1, 4/2 heads, d 64, capacity 64, append 2, cache_seqlens [3, 40]
    cos = cp.asarray(np.ones((64, 16), np.float16))
    return args, cos


def test_feature_argument_errors():
    cp = _cupy()
    args, cos = _feature_args()
    cases = [
        (ValueError, "window_size", dict(window_size=(-2, 0))),
        ((TypeError, ValueError), "window_size", dict(window_size=(1.5, 0))),
        (ValueError, "softcap", dict(softcap=-1.0)),
        (TypeError, "alibi_slopes", dict(alibi_slopes=cp.ones(4, dtype=cp.float16))),
        (ValueError, "alibi_slopes", dict(alibi_slopes=cp.ones(3, dtype=cp.float32))),
        (ValueError, "alibi_slopes", dict(alibi_slopes=cp.ones((3, 4), dtype=cp.float32))),
        (ValueError, "cache_leftpad", dict(cache_leftpad=cp.zeros(2, dtype=cp.int64))),
        (ValueError, "cache_leftpad", dict(cache_leftpad=cp.zeros(3, dtype=cp.int32))),
        (ValueError, "rotary_sin", dict(rotary_cos=cos)),
        (TypeError, "rotary_cos", dict(rotary_cos=cos.astype(cp.float32), rotary_sin=cos.astype(cp.float32))),
        (ValueError, "rotary_dim", dict(rotary_cos=cp.ones((64, 33), cp.float16), rotary_sin=cp.ones((64, 33), cp.float16))),
        (ValueError, "rotary_cos", dict(rotary_cos=cos[:63], rotary_sin=cos[:63])),  # fewer rows than the capacity
        (ValueError, "rotary_cos", dict(rotary_cos=cos, rotary_sin=cos[:, :8])),
        # int cache_seqlens: q (4 tokens, causal) would reach position 60 + 3 = 63 < 64: fine; 61 + 3 = 64 is not.
        (ValueError, "rotary_cos", dict(rotary_cos=cos, rotary_sin=cos, causal=True, cache_seqlens=61,
                                        q=cp.asarray(np.ones((2, 4, 4, 64), np.float16)))),
    ]
    for exc, match, change in cases:
        _assert_rejected(exc, match, dict(args, **change))
    paged_args, _ = _feature_args(paged=True)
    _assert_rejected(ValueError, r"cache_leftpad.*block_table",
                     dict(paged_args, cache_leftpad=cp.zeros(2, dtype=cp.int32)))


@pytest.mark.parametrize("append", [True, False])
def test_cache_leftpad_past_cache_seqlens_rejected_on_device(append):
    cp = _cupy()
    args, _ = _feature_args()
    args["cache_leftpad"] = cp.asarray([0, 41], dtype=cp.int32)  # cache_seqlens[1] = 40
    if not append:
        del args["k"], args["v"]
    _assert_rejected_on_device(r"cache_leftpad\[1\] = 41", args, bad_rows=[0, 1] if append else [1])
    args["cache_leftpad"] = cp.asarray([-1, 0], dtype=cp.int32)
    _assert_rejected_on_device(r"cache_leftpad\[0\] = -1", args, bad_rows=[0, 1] if append else [0])


@pytest.mark.parametrize("append", [True, False])
def test_rotary_position_past_the_table_rejected_on_device(append):
    # cos has 64 rows (the capacity); 4 causal queries from cache_seqlens 62 reach position 65.
    cp = _cupy()
    args, cos = _feature_args()
    args.update(q=cp.asarray(np.ones((2, 4, 4, 64), np.float16)), rotary_cos=cos, rotary_sin=cos, causal=True,
                cache_seqlens=cp.asarray([3, 62], dtype=cp.int32))
    if append:
        args.update(k=args["k"][:, :1], v=args["v"][:, :1])
    else:
        del args["k"], args["v"]
    _assert_rejected_on_device(r"cache_seqlens\[1\].*rotary_cos", args, bad_rows=[0, 1])
