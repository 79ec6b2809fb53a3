"""Paged K/V (``block_table``) in the varlen forward and backward, on a real GPU.

The same keys are laid out twice: packed ``(total_k, hkv, d)`` and scattered over a shuffled pool of pages (unused
rows and pages hold other random values, unused block_table entries hold an invalid page so that reading one would
be reported). The paged call must equal the packed call on the same kernel bitwise (same tiles and arithmetic; only
the addresses of the K/V rows differ), and the packed call is checked against the float64 reference in
test_varlen_mods_gpu.py; one case here is also checked against the reference directly. On Hopper every check runs
on both forward kernels: the Hopper forward (which takes paged K/V at head dims 64 and 128 without modifiers) and
the mma.sync forward. Outputs are poisoned with NaN before every launch.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa2cupy import testing as B
from fa2cupy import paging
from fa2cupy.reference import attention_ref_varlen
from gpu_helpers import (  # noqa: F401 -- poison_forward_and_backward is an autouse fixture
    UNIT_ROUNDOFF, cu_seqlens, cupy_module as _cupy, fa2cupy_module, kernel_options, np_dtype as _np_dtype,
    poison_forward_and_backward, torch_cuda as _torch)

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 2, 15, 16, 17, 64, 65, 129, 200]
PAGE_SIZES = [1, 3, 16, 24, 64, 256]
HEAD_GROUPS = [(1, 1), (4, 1), (6, 3), (8, 2)]
EXAMPLES = max(10, settings().max_examples // 4)
KERNELS = ["hopper", "mma"]


def _forward_kernel(kernel: str):
    """Plans calls on one forward kernel: "hopper", the Hopper forward wherever it takes the call, whatever its
    length (short masked calls otherwise run the mma.sync forward; skipped off compute capability 9.0), or "mma",
    the mma.sync forward alone."""
    if kernel == "mma":
        return kernel_options(hopper_forward=False)
    if int(_cupy().cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper forward runs on compute capability 9.0 only")
    return kernel_options(hopper_masked_min_seqlen=0)


def _randn(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(_np_dtype(dtype))


def paged_layout(rng, lengths_k, page_size, k_packed, v_packed, share_first_page=False):
    """Page pools and a shuffled block_table holding packed K/V's sequences: (k_pages, v_pages, table) as NumPy.
    Unused pool rows hold other random values and unused block_table entries an invalid page (a read would be
    reported). With share_first_page, every sequence's first page is sequence 0's (prefix sharing); the packed
    arrays must then hold the same first page_size keys in every sequence (the caller arranges that)."""
    table, num_pages = paging.shuffled_block_table(
        rng, lengths_k, page_size, spare_pages=int(rng.integers(1, 4)), spare_columns=int(rng.integers(0, 2)),
        share_first_page=share_first_page, unused=1 << 30)
    pages = []
    for packed in (k_packed, v_packed):
        pool = (num_pages, page_size) + packed.shape[1:]
        pool_array = rng.standard_normal(pool, dtype=np.float32).astype(packed.dtype)
        paging.write_pages(np, pool_array, packed, cu_seqlens(lengths_k), table)
        pages.append(pool_array)
    return pages[0], pages[1], table


def small_case(seed, lengths_q, lengths_k, page_size, nheads, nheads_kv, headdim, dtype):
    """NumPy inputs of a small paged case: q, dout, k_pages, v_pages, block_table, cu_seqlens_q, cu_seqlens_k."""
    rng = np.random.default_rng(seed)
    k, v = (_randn(rng, (sum(lengths_k), nheads_kv, headdim), dtype) for _ in range(2))
    k_pages, v_pages, table = paged_layout(rng, lengths_k, page_size, k, v)
    q = _randn(rng, (sum(lengths_q), nheads, headdim), dtype)
    return q, _randn(rng, q.shape, dtype), k_pages, v_pages, table, cu_seqlens(lengths_q), cu_seqlens(lengths_k)


@st.composite
def paged_cases(draw, hopper=False):
    """A paged varlen case; with ``hopper``, only what the Hopper forward takes (head dims 64 and 128, no score
    modifiers, no dropout), so that every example reaches its paged path."""
    batch = draw(st.integers(1, 4))
    h, hkv = draw(st.sampled_from(HEAD_GROUPS))
    return dict(
        lengths_q=draw(st.lists(st.sampled_from(LENGTHS), min_size=batch, max_size=batch)),
        lengths_k=draw(st.lists(st.sampled_from(LENGTHS), min_size=batch, max_size=batch)),
        page_size=draw(st.sampled_from(PAGE_SIZES)), nheads=h, nheads_kv=hkv,
        headdim=draw(st.sampled_from([64, 128] if hopper else [32, 64, 128, 40, 256])),
        causal=draw(st.booleans()),
        window_size=draw(st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 80), st.integers(-1, 80)))),
        softcap=0.0 if hopper else draw(st.sampled_from([0.0, 0.0, 0.0, 5.0])),
        alibi=False if hopper else draw(st.booleans()),
        dropout_p=0.0 if hopper else draw(st.sampled_from([0.0, 0.0, 0.0, 0.3])),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def paged_case_arrays(c):
    """Device arrays of case dict ``c`` (paged_cases' keys; dropout and the mask's are not read): q, packed k and v,
    their page pools and block_table, cu_seqlens_q/k, and ALiBi slopes (nheads,) or None."""
    cp = _cupy()
    rng = np.random.default_rng(c["seed"])
    tq, tk = max(sum(c["lengths_q"]), 1), max(sum(c["lengths_k"]), 1)
    q = _randn(rng, (tq, c["nheads"], c["headdim"]), c["dtype"])
    k = _randn(rng, (tk, c["nheads_kv"], c["headdim"]), c["dtype"])
    v = _randn(rng, (tk, c["nheads_kv"], c.get("headdim_v") or c["headdim"]), c["dtype"])
    k_pages, v_pages, table = paged_layout(rng, c["lengths_k"], c["page_size"], k, v)
    slopes = rng.uniform(0.0, 0.5, (c["nheads"],)).astype(np.float32) if c["alibi"] else None
    put = lambda x: None if x is None else cp.asarray(x)  # noqa: E731
    return (put(q), put(k), put(v), put(k_pages), put(v_pages), put(table), put(cu_seqlens(c["lengths_q"])),
            put(cu_seqlens(c["lengths_k"])), put(slopes))


def _options(c, slopes):
    return dict(causal=c["causal"], window_size=c["window_size"], softcap=c["softcap"], alibi_slopes=slopes,
                dropout_p=c["dropout_p"], dropout_seed=c["seed"], dropout_offset=7)


def same_rows(a, b, rows):
    """Bitwise equality of the first ``rows`` rows (rows past cu_seqlens_q[-1] are not written)."""
    cp = _cupy()
    assert not np.isnan(B.to_numpy64(a[:rows])).any(), "rows of a sequence were left unwritten"
    assert cp.array_equal(a[:rows].view(cp.uint16), b[:rows].view(cp.uint16))


def paged_equals_packed(fa, arrays, max_q, max_k, rows, **options):
    """The varlen forward over ``arrays`` (paged_case_arrays') page pools and over its packed K/V: the same bits in
    every written row and the same lse, and no unused block_table entry read. Returns the paged call's (out, lse)."""
    q, k, v, k_pages, v_pages, table, cu_q, cu_k = arrays[:8]
    out_p, lse_p, _ = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max_q, max_k, block_table=table,
                                                return_attn_probs=True, **options)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True, **options)
    same_rows(out_p, out, rows)
    assert _cupy().array_equal(lse_p[:, :rows], lse[:, :rows])
    fa.check_device_errors()  # unused block_table entries (invalid pages) were never read
    return out_p, lse_p


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_paged_forward_equals_packed(kernel, data):
    fa = fa2cupy_module()
    c = data.draw(paged_cases(hopper=kernel == "hopper"))
    arrays = paged_case_arrays(c)
    with _forward_kernel(kernel):  # paged and packed K/V on the same kernel
        paged_equals_packed(fa, arrays, max(c["lengths_q"]), max(c["lengths_k"]), sum(c["lengths_q"]),
                            **_options(c, arrays[-1]))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("headdim, page_size", [(64, 48), (128, 16), (128, 5)])
def test_paged_forward_matches_reference(kernel, headdim, page_size):
    fa = fa2cupy_module()
    c = dict(lengths_q=[70, 1, 0, 130], lengths_k=[200, 17, 5, 129], page_size=page_size, nheads=4, nheads_kv=2,
             headdim=headdim, causal=True, window_size=(-1, -1), softcap=0.0, alibi=False, dropout_p=0.0,
             dtype="bfloat16", seed=11)
    q, k, v, k_pages, v_pages, table, cu_q, cu_k, _ = paged_case_arrays(c)
    with _forward_kernel(kernel):
        out, lse, _ = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 130, 200, causal=True,
                                                block_table=table, return_attn_probs=True)
    ref_out, ref_lse = attention_ref_varlen(*(B.to_numpy64(x) for x in (q, k, v)), cu_seqlens(c["lengths_q"]),
                                            cu_seqlens(c["lengths_k"]), causal=True)
    tol = 4 * UNIT_ROUNDOFF["bfloat16"] * float(np.abs(B.to_numpy64(v)).max()) + 1e-6
    assert np.abs(B.to_numpy64(out) - ref_out).max() <= tol
    live = ~np.isinf(ref_lse)
    assert np.all(np.abs(B.to_numpy64(lse)[live] - ref_lse[live]) <= 1e-3 * (1 + np.abs(ref_lse[live])))


def _scatter_to_pages(grad_packed, table, lengths_k, page_size, shape):
    """Float64 sum of packed per-key gradients onto their pages (the expected dk/dv of a paged call)."""
    grad = B.to_numpy64(grad_packed)
    table = _cupy().asnumpy(table)
    pages = np.zeros(shape)
    cu = cu_seqlens(lengths_k)
    for b, n in enumerate(lengths_k):
        for j in range(n):
            pages[table[b, j // page_size], j % page_size] += grad[cu[b] + j]
    return pages


@pytest.mark.parametrize("share_first_page", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
def test_paged_backward(share_first_page, deterministic):
    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(21)
    page_size, hkv, d, dtype = 32, 2, 64, "float16"
    lengths_q, lengths_k = [50, 0, 77], [100, 40, 90]
    k, v = (_randn(rng, (sum(lengths_k), hkv, d), dtype) for _ in range(2))
    if share_first_page:  # the same first page_size keys in every sequence
        cu = cu_seqlens(lengths_k)
        for b in range(1, len(lengths_k)):
            k[cu[b]:cu[b] + page_size], v[cu[b]:cu[b] + page_size] = k[:page_size], v[:page_size]
    k_pages, v_pages, table = paged_layout(rng, lengths_k, page_size, k, v, share_first_page)
    q = _randn(rng, (sum(lengths_q), 4, d), dtype)
    dout = _randn(rng, q.shape, dtype)
    q, k, v, k_pages, v_pages, table, dout = (cp.asarray(x) for x in (q, k, v, k_pages, v_pages, table, dout))
    cu_q, cu_k = cp.asarray(cu_seqlens(lengths_q)), cp.asarray(cu_seqlens(lengths_k))
    opts = dict(causal=True, window_size=(60, 0), deterministic=deterministic)
    out, lse, _ = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 77, 100, block_table=table,
                                            return_attn_probs=True, **opts)
    with warnings.catch_warnings():  # (no deprecated CuPy call on the way: cupyx.scatter_add warns since 14)
        warnings.simplefilter("error", DeprecationWarning)
        dq_p, dk_p, dv_p = fa.flash_attn_varlen_backward(dout, q, k_pages, v_pages, out, lse, cu_q, cu_k, 77, 100,
                                                         block_table=table, **opts)
    dq, dk, dv = fa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 77, 100, **opts)
    assert dk_p.shape == k_pages.shape and dv_p.shape == v_pages.shape
    unit = UNIT_ROUNDOFF[dtype]
    if deterministic:
        assert cp.array_equal(dq_p.view(cp.uint16), dq.view(cp.uint16))
    else:
        scale = float(cp.abs(dq.astype(cp.float32)).max())
        assert float(cp.abs(dq_p.astype(cp.float32) - dq.astype(cp.float32)).max()) <= 8 * unit * scale
    for got, packed in ((dk_p, dk), (dv_p, dv)):
        want = _scatter_to_pages(packed, table, lengths_k, page_size, got.shape)
        # one rounding of the float32 page sum (plus atomics' reordering of dq only): a few units of the largest
        tol = (2 if deterministic else 8) * unit * float(np.abs(want).max())
        assert np.abs(B.to_numpy64(got) - want).max() <= tol
    # rows no sequence reads get zero gradient
    touched = np.zeros(k_pages.shape[:2], bool)
    table_h = cp.asnumpy(table)
    for b, n in enumerate(lengths_k):
        for j in range(n):
            touched[table_h[b, j // page_size], j % page_size] = True
    assert not B.to_numpy64(dk_p)[~touched].any() and not B.to_numpy64(dv_p)[~touched].any()


@pytest.mark.parametrize("kernel, headdim, headdim_v", [("hopper", 64, 128), ("mma", 64, 128), ("mma", 192, 128),
                                                       ("mma", 128, 64)])
def test_paged_v_head_dim_of_its_own(kernel, headdim, headdim_v):
    # v's page pool with a head dim of its own (the narrower pool made ready at the wider one): forward equal to
    # the packed call's on the same kernel, gradients equal to the packed backward's summed onto the pages.
    fa = fa2cupy_module()
    cp = _cupy()
    c = dict(lengths_q=[70, 1, 0, 130], lengths_k=[200, 17, 5, 129], page_size=16, nheads=4, nheads_kv=2,
             headdim=headdim, headdim_v=headdim_v, causal=True, window_size=(-1, -1), softcap=0.0, alibi=False,
             dropout_p=0.0, dtype="bfloat16", seed=13)
    q, k, v, k_pages, v_pages, table, cu_q, cu_k, _ = paged_case_arrays(c)
    with _forward_kernel(kernel):
        out, lse = paged_equals_packed(fa, (q, k, v, k_pages, v_pages, table, cu_q, cu_k), 130, 200, 201,
                                       causal=True)
    assert out.shape == (201, 4, headdim_v)
    dout = cp.asarray(_randn(np.random.default_rng(5), out.shape, "bfloat16"))
    dq_p, dk_p, dv_p = fa.flash_attn_varlen_backward(dout, q, k_pages, v_pages, out, lse, cu_q, cu_k, 130, 200,
                                                     causal=True, block_table=table, deterministic=True)
    dq, dk, dv = fa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 130, 200, causal=True,
                                               deterministic=True)
    assert dk_p.shape == k_pages.shape and dv_p.shape == v_pages.shape
    assert cp.array_equal(dq_p.view(cp.uint16), dq.view(cp.uint16))
    for got, packed in ((dk_p, dk), (dv_p, dv)):
        want = _scatter_to_pages(packed, table, c["lengths_k"], c["page_size"], got.shape)
        assert np.abs(B.to_numpy64(got) - want).max() <= 2 * UNIT_ROUNDOFF["bfloat16"] * float(np.abs(want).max())


@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_page_is_reported(kernel):
    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(2)
    q = cp.asarray(_randn(rng, (40, 2, 64), "float16"))
    k_pages, v_pages = (cp.asarray(_randn(rng, (6, 16, 2, 64), "float16")) for _ in range(2))
    cu = cp.asarray(cu_seqlens([20, 20]))
    table = cp.asarray(np.array([[0, 1], [2, 6]], np.int32))  # page 6 of 6 does not exist (sequence 1, keys 16..)
    with _forward_kernel(kernel):
        fa.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, 20, 20, block_table=table)
        with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 6 is not a page of k"):
            fa.check_device_errors()
        table[1, 1] = 3
        out = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, 20, 20, block_table=table)
        fa.check_device_errors()
    assert not cp.isnan(out).any()


def test_paged_torch_autograd():
    torch = _torch()
    ft, fa = fa2cupy_module("torch"), fa2cupy_module()
    q, dout, k_pages, v_pages, table, cu_q, cu_k = small_case(8, [33, 64], [80, 47], 16, 4, 2, 128, "bfloat16")
    as_torch = lambda x: torch.from_dlpack(_cupy().asarray(x))  # noqa: E731
    qt, kt, vt = (as_torch(x).requires_grad_() for x in (q, k_pages, v_pages))
    tt, dt, cu_q, cu_k = (as_torch(x) for x in (table, dout, cu_q, cu_k))
    out = ft.flash_attn_varlen_func(qt, kt, vt, cu_q, cu_k, 64, 80, causal=True, block_table=tt, deterministic=True)
    out.backward(dt)
    ref_out, lse, _ = fa.flash_attn_varlen_func(qt.detach(), kt.detach(), vt.detach(), cu_q, cu_k, 64, 80, causal=True,
                                                block_table=tt, return_attn_probs=True)
    assert torch.equal(out.detach(), ref_out)
    grads = fa.flash_attn_varlen_backward(dt, qt.detach(), kt.detach(), vt.detach(), ref_out, lse, cu_q, cu_k, 64, 80,
                                          causal=True, block_table=tt, deterministic=True)
    for got, want in zip((qt.grad, kt.grad, vt.grad), grads):
        assert isinstance(want, torch.Tensor) and torch.equal(got, want)


def test_paged_jax_jit_grad():
    jax = pytest.importorskip("jax")
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        pytest.skip("JAX has no GPU")
    import jax.numpy as jnp

    fj, fa = fa2cupy_module("jax"), fa2cupy_module()
    cp = _cupy()
    q, dout, k_pages, v_pages, table, cu_q, cu_k = small_case(9, [20, 45], [64, 30], 32, 2, 1, 64, "float16")
    jq, jk, jv, jt, jd, jcq, jck = (jnp.asarray(x) for x in (q, k_pages, v_pages, table, dout, cu_q, cu_k))

    def loss(q_, k_, v_):
        out = fj.flash_attn_varlen_func(q_, k_, v_, jcq, jck, 45, 64, causal=True, block_table=jt,
                                        deterministic=True)
        return jnp.sum(out.astype(jnp.float32) * jd.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
    cq, ck, cv, ct, cd = (cp.asarray(x) for x in (q, k_pages, v_pages, table, dout))
    ccq, cck = cp.asarray(cu_q), cp.asarray(cu_k)
    out, lse, _ = fa.flash_attn_varlen_func(cq, ck, cv, ccq, cck, 45, 64, causal=True, block_table=ct,
                                            return_attn_probs=True)
    want = fa.flash_attn_varlen_backward(cd, cq, ck, cv, out, lse, ccq, cck, 45, 64, causal=True, block_table=ct,
                                         deterministic=True)
    for got, w in zip(grads, want):
        assert np.array_equal(np.asarray(got).view(np.uint16), cp.asnumpy(w).view(np.uint16))
    assert math.isfinite(float(loss(jq, jk, jv)))
