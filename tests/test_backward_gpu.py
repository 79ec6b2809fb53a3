"""Backward pass on a real GPU: ``fa2cupy.flash_attn_backward`` against float64 gradients.

What is compared
----------------
out and lse come from the library's own forward (``flash_attn_func(...,
return_attn_probs=True)``), dout is random normal, all inputs rounded to the dtype.
The reference, ``fa2cupy.testing.reference_gradients``, is
``fa2cupy.reference.attention_ref_backward`` on exactly those rounded inputs plus
one exact correction: FlashAttention-2's backward uses the ``out`` it is *given*,
only through ``D_i = rowsum(dO_i * out_i)``, and the kernel's out is the rounded
forward result.  Where the softmax is peaked (large scale, few keys) ``dP - D``
cancels and ``dD = rowsum(dO * (out - out_exact))`` -- up to ~u sqrt(d) |dO| |out|
-- would dominate dq/dk with an error that owes nothing to the backward.  The
gradients are linear in D, so the reference for the given out is
``dq - scale dD_i (P K)_i``, ``dk_j - scale sum_i P_ij dD_i q_i`` (dv does not
use D); this is exact, not a bound.

The bound (``fa2cupy.testing.gradient_bound``), for g in dq, dk, dv
--------------------------------------------------------------------
    max|g - ref_g| <= 16 u max|ref_g| + floor,    u = 2^-11 (fp16), 2^-8 (bf16).

The kernel's low-precision roundings, each with relative error <= u:
  1. P = exp(S - lse) (fp32) rounded to the dtype before dV = P^T dO;
  2. dS = P * (dP - D) (fp32) rounded to the dtype before dQ = scale dS K and
     dK = scale dS^T Q;
  3. dq/dk/dv rounded to the dtype at the end (dq accumulated in fp32 first, by
     atomics when not deterministic: only the fp32 summation order changes);
     with GQA possibly one more rounding per query head before the group sum.
Everything else is fp32 (S, lse, dP, D, the accumulators): O(d 2^-24) relative.
Rounding 3 is <= u |g|.  Roundings 1 and 2 perturb every term of a sum
``g = sum_j c_j x_j`` by a relative u, i.e. by at most u * sum_j |c_j x_j|, which
is not proportional to |g| in the worst case (the terms of dS sum to zero in every
row, so dq/dk are cancelling sums) but is for independent random inputs: the
perturbations are independent with mean ~0, so their sum grows like the
root-sum-square of the terms, as g itself does (probabilistic rounding-error
analysis, Higham & Mary 2019).  Calibration: a float64/float32 NumPy emulation of
exactly these roundings over 200 random cases of this file's distribution (head
dims 1..256, scale 0.01..1.5, causal, GQA, seqlens 1..700) gave max|g - ref|
/ (u max|ref|) <= 3.8; the emulation does not model the fp32 summation order or a
GQA per-head rounding, hence C = 16, ~4x over what was seen.  The floor
(``gradient_floor``: 2^-20 scale d max|dO| max|v| max|q,k|) covers gradients that
are exactly 0 (every row sees one key, dS = 0) where the kernel leaves fp32
cancellation noise of dP - D.

Tight enough to fail on bugs: a flipped causal mask, a 5% wrong scale (fp16) or a
dropped 64-key block move the gradients by O(max|ref|), i.e. by >= 60x u max|ref|
in fp16; ``test_bound_rejects_wrong_gradients`` checks the kernel's own gradients
against such wrong references and requires the bound to fail.

Also: rows with no visible key (causal, seqlen_q > seqlen_k) give dq == 0 exactly and
contribute nothing to dk/dv; ``KernelOptions(debug_poison=True)`` fills dq/dk/dv with NaN
before the kernels run (switched on for the whole module), so an element left
unwritten is NaN; ``deterministic=True`` is bitwise reproducible; the default mode
reproduces within the bound.

Cost: the float64 reference is the expensive part, so the shapes are capped at
b*h*sq*sk*d <= 3e7 (batch and heads are cut first) and the property test runs a
quarter of the profile's examples (50 with the ``device`` profile).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from fa2cupy import testing as B
from gpu_helpers import (
    checked_calls, cupy_module as _cupy, debug_poison, fa2cupy_module, kernel_options, np_dtype as _np_dtype,
    torch_cuda as _torch)

pytestmark = pytest.mark.gpu

SEQLENS = [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 97, 383, 700]
COMMON_HEADDIMS = [32, 64, 96, 128, 160, 192, 224, 256]
ODD_HEADDIMS = [1, 8, 40, 72, 100]
HEAD_GROUPS = [(1, 1), (2, 2), (4, 4), (3, 1), (4, 1), (8, 1), (4, 2), (6, 3), (8, 2)]
WORK_LIMIT = 3 * 10**7
SHORT = {"float16": "fp16", "bfloat16": "bf16"}
PROPERTY_EXAMPLES = max(10, settings().max_examples // 4)


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


def _fa2cupy():
    return fa2cupy_module()


def make_input(rng, shape, dtype, transposed=False):
    """Random-normal CuPy array (b, s, h, d); transposed: stored (b, h, s, d), returned as a view."""
    cp = _cupy()
    b, s, h, d = shape
    store = (b, h, s, d) if transposed else shape
    x = cp.asarray(rng.standard_normal(store, dtype=np.float32).astype(_np_dtype(dtype)))
    return x.transpose(0, 2, 1, 3) if transposed else x


def _host64(x) -> np.ndarray:
    return B.to_numpy64(x)


def bound_for(dtype, scale, d, dout, q, k, v, ref_g) -> float:
    floor = B.gradient_floor(scale, d, np.abs(dout).max(), np.abs(v).max(), max(np.abs(q).max(), np.abs(k).max()))
    return B.gradient_bound(SHORT[dtype], float(np.abs(ref_g).max()) if ref_g.size else 0.0, floor)


def check_gradients(dout, q, k, v, out, grads, softmax_scale, causal, dtype, *, ref=None, window_size=(-1, -1)):
    """Assert (dq, dk, dv) (any framework) against the reference; returns (ref, host grads, bounds)."""
    dout, q, k, v, out = (_host64(x) for x in (dout, q, k, v, out))
    g = [_host64(x) for x in grads]
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    assert g[0].shape == (b, sq, h, d)
    assert g[1].shape == g[2].shape == (b, sk, hkv, d)
    for name, x in zip("qkv", g):
        assert not np.isnan(x).any(), f"d{name} has NaN: poisoned elements left unwritten (or a NaN computed)"
    if ref is None:
        ref = B.reference_gradients(dout, q, k, v, out, softmax_scale=softmax_scale, causal=causal,
                                    window_size=window_size)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    bounds = []
    for name, x, r in zip("qkv", g, ref):
        tol = bound_for(dtype, scale, d, dout, q, k, v, r)
        err = np.abs(x - r)
        worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else None
        msg = f"max|d{name}-ref|={err.max():.3e} at {worst}, max|ref|={np.abs(r).max():.3e}, tol={tol:.3e}"
        if currently_in_test_context():
            note(msg)
        assert err.max() <= tol, msg
        bounds.append(tol)
    if causal and sq > sk:   # rows i < sq - sk see no key: no gradient at all
        assert np.all(g[0][:, : sq - sk] == 0.0), "dq of rows with no visible key must be exactly 0"
    return ref, g, bounds


def _shrink(c):
    """Cap the reference's cost: batch first, then heads (keeping MQA/GQA-ness)."""
    work = lambda: c["batch"] * c["nheads"] * c["seqlen_q"] * c["seqlen_k"] * c["headdim"]  # noqa: E731
    if work() > WORK_LIMIT:
        c["batch"] = 1
    if work() > WORK_LIMIT and c["nheads"] > 2:
        c["nheads"], c["nheads_kv"] = (1, 1) if c["nheads"] == c["nheads_kv"] else (2, 1)
    return c


@st.composite
def cases(draw):
    seqlens = st.sampled_from(SEQLENS)
    headdim = draw(st.one_of(st.sampled_from(COMMON_HEADDIMS), st.sampled_from(COMMON_HEADDIMS),
                             st.sampled_from(ODD_HEADDIMS)))
    nheads, nheads_kv = draw(st.sampled_from(HEAD_GROUPS))
    return _shrink(dict(
        batch=draw(st.integers(1, 2)),
        seqlen_q=draw(seqlens),
        seqlen_k=draw(seqlens),
        nheads=nheads,
        nheads_kv=nheads_kv,
        headdim=headdim,
        causal=draw(st.booleans()),
        window_size=draw(st.one_of(st.just((-1, -1)), st.just((-1, -1)),
                                   st.tuples(*[st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, 300))] * 2))),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.01, 1.5))),
        deterministic=draw(st.booleans()),
        transposed=draw(st.sampled_from([False, False, True])),
        # head dims without a Hopper row: padded up to the Hopper kernels (default) or the mma.sync kernels (False)
        hopper_pad=draw(st.sampled_from([None, None, False])),
        seed=draw(st.integers(0, 2**32 - 1)),
    ))


def run_case(c, repeat=True):
    """Forward + backward of case dict ``c`` (CuPy arrays), checked; with ``repeat`` a second
    backward must be bit-identical (deterministic) or within the bound (default)."""
    cp = _cupy()
    fa = _fa2cupy()
    rng = np.random.default_rng(c["seed"])
    b, sq, sk = c["batch"], c["seqlen_q"], c["seqlen_k"]
    h, hkv, d, dtype = c["nheads"], c["nheads_kv"], c["headdim"], c["dtype"]
    q = make_input(rng, (b, sq, h, d), dtype, c["transposed"])
    k = make_input(rng, (b, sk, hkv, d), dtype, c["transposed"])
    v = make_input(rng, (b, sk, hkv, d), dtype, c["transposed"])
    dout = make_input(rng, (b, sq, h, d), dtype, c["transposed"])
    window = c.get("window_size", (-1, -1))
    kw = dict(softmax_scale=c["softmax_scale"], causal=c["causal"], window_size=window)
    with kernel_options(hopper_pad_headdim=c.get("hopper_pad")):
        out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        grads = fa.flash_attn_backward(dout, q, k, v, out, lse, deterministic=c["deterministic"], **kw)
    assert isinstance(grads, tuple) and len(grads) == 3
    for x, like in zip(grads, (q, k, v)):
        assert isinstance(x, cp.ndarray) and x.shape == like.shape and x.dtype == like.dtype
    ref, g1, bounds = check_gradients(dout, q, k, v, out, grads, c["softmax_scale"], c["causal"], dtype,
                                      window_size=window)
    if repeat:  # (under the same options: another kernel need not match the first bit for bit)
        with kernel_options(hopper_pad_headdim=c.get("hopper_pad")):
            again = fa.flash_attn_backward(dout, q, k, v, out, lse, deterministic=c["deterministic"], **kw)
        for name, x, y, tol in zip("qkv", grads, again, bounds):
            if c["deterministic"]:
                assert cp.array_equal(x.view(cp.uint16), y.view(cp.uint16)), f"d{name} differs between two runs"
            else:
                diff = float(np.abs(g1["qkv".index(name)] - _host64(y)).max())
                assert diff <= tol, f"d{name}: two runs differ by {diff:.3e} > {tol:.3e}"
    return ref, g1


@settings(max_examples=PROPERTY_EXAMPLES)
@given(cases())
def test_matches_reference(case):
    note(repr(case))
    run_case(case)


def _case(b, sq, sk, h, hkv, d, causal, dtype, scale=None, det=False, transposed=False, seed=None):
    return dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hkv, headdim=d, causal=causal,
                dtype=dtype, softmax_scale=scale, deterministic=det, transposed=transposed,
                seed=sq * 1000 + sk if seed is None else seed)


# Fixed cases first: quick, readable failures before Hypothesis digs.
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "b,sq,sk,h,hkv,d,causal,det",
    [
        (1, 1, 1, 1, 1, 64, False, False),      # one key: exact gradients dq = dk = 0
        (2, 128, 128, 2, 2, 64, False, False),
        (2, 128, 128, 2, 2, 128, True, True),
        (1, 65, 257, 4, 2, 96, True, False),    # sq < sk: bottom-right causal, GQA
        (1, 257, 65, 4, 1, 128, True, True),    # sq > sk: rows with no key, MQA
        (1, 97, 383, 2, 1, 256, False, False),  # d = 256
        (1, 17, 700, 2, 1, 40, True, True),     # odd head dim, long keys
        (1, 63, 63, 3, 1, 8, False, False),
        (1, 129, 127, 2, 2, 1, True, False),    # head dim 1
        (1, 100, 100, 2, 2, 100, True, False),
    ],
)
def test_fixed_cases(dtype, b, sq, sk, h, hkv, d, causal, det):
    run_case(_case(b, sq, sk, h, hkv, d, causal, dtype, det=det))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize(
    "sq,sk,d,window",
    [
        (300, 300, 64, (32, 0)),  # local causal band
        (260, 400, 128, (100, 50)),  # sq < sk, both sides limited
        (400, 150, 64, (0, 0)),  # sq > sk: the diagonal key only; rows and keys with none
        (200, 500, 96, (-1, 17)),
        (129, 129, 256, (5, -1)),
    ],
)
def test_sliding_window(dtype, causal, det, sq, sk, d, window):
    c = _case(1, sq, sk, 4, 2, d, causal, dtype, det=det)
    c["window_size"] = window
    run_case(c)


@pytest.mark.parametrize("scale", [0.01, 0.3, 1.5])
def test_softmax_scale(scale):
    run_case(_case(1, 70, 130, 4, 2, 64, True, "float16", scale=scale, seed=5))


def test_transposed_layout():
    run_case(_case(2, 129, 129, 4, 2, 96, True, "bfloat16", transposed=True, det=True))


def test_gqa_shapes_and_group_sums():
    # Every query head of a group sees the same k/v: with q heads duplicated, dk/dv of
    # the shared kv head must equal the MHA dk/dv summed over the copies.
    cp = _cupy()
    fa = _fa2cupy()
    rng = np.random.default_rng(21)
    q1 = make_input(rng, (1, 90, 1, 64), "float16")
    k, v = (make_input(rng, (1, 150, 1, 64), "float16") for _ in range(2))
    do1 = make_input(rng, (1, 90, 1, 64), "float16")
    q4, do4 = cp.repeat(q1, 4, axis=2), cp.repeat(do1, 4, axis=2)
    out, lse, _ = fa.flash_attn_func(q4, k, v, causal=True, return_attn_probs=True)
    dq, dk, dv = fa.flash_attn_backward(do4, q4, k, v, out, lse, causal=True, deterministic=True)
    assert dq.shape == (1, 90, 4, 64) and dk.shape == dv.shape == (1, 150, 1, 64)
    check_gradients(do4, q4, k, v, out, (dq, dk, dv), None, True, "float16")
    out1, lse1, _ = fa.flash_attn_func(q1, k, v, causal=True, return_attn_probs=True)
    _, dk1, dv1 = fa.flash_attn_backward(do1, q1, k, v, out1, lse1, causal=True, deterministic=True)
    for name, x4, x1 in (("dk", dk, dk1), ("dv", dv, dv1)):
        a, r = _host64(x4), 4 * _host64(x1)
        tol = B.gradient_bound("fp16", float(np.abs(r).max()), 1e-6)
        assert np.abs(a - r).max() <= tol, f"{name}: GQA group sum off by {np.abs(a - r).max():.3e}"


def test_fully_masked_rows_have_no_gradient():
    # causal with sq > sk: the first sq - sk rows see no key; their dout must not matter.
    cp = _cupy()
    fa = _fa2cupy()
    rng = np.random.default_rng(22)
    q = make_input(rng, (1, 200, 2, 64), "float16")
    k, v = (make_input(rng, (1, 70, 2, 64), "float16") for _ in range(2))
    dout = make_input(rng, (1, 200, 2, 64), "float16")
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    g1 = fa.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    dout2 = dout.copy()
    dout2[:, :130] *= cp.float16(7)          # change only the dead rows' dout
    g2 = fa.flash_attn_backward(dout2, q, k, v, out, lse, causal=True, deterministic=True)
    for x, y in zip(g1, g2):
        assert cp.array_equal(x.view(cp.uint16), y.view(cp.uint16))
    assert not cp.any(g1[0][:, :130])
    check_gradients(dout, q, k, v, out, g1, None, True, "float16")


@pytest.mark.parametrize("deterministic", [False, True])
def test_cached_fast_path_matches_reference(deterministic):
    # Repeated calls with the same metadata launch the cached plan (no checks); the poison hook needs the checked
    # path, so it is off here. Each call has new data, so an unwritten gradient (stale memory) misses its reference.
    fa = _fa2cupy()
    rng = np.random.default_rng(5)
    with debug_poison(False), checked_calls() as checked:
        for _ in range(3):
            q = make_input(rng, (2, 150, 4, 64), "bfloat16", transposed=True)
            k, v = (make_input(rng, (2, 230, 2, 64), "bfloat16") for _ in range(2))
            dout = make_input(rng, (2, 150, 4, 64), "bfloat16")
            out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
            grads = fa.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
            check_gradients(dout, q, k, v, out, grads, None, True, "bfloat16")
        assert checked.count("bwd") <= 1  # planned once (or by an earlier test), reused


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_deterministic_bitwise(dtype):
    cp = _cupy()
    fa = _fa2cupy()
    rng = np.random.default_rng(11)
    q = make_input(rng, (2, 300, 8, 128), dtype)
    k, v = (make_input(rng, (2, 500, 2, 128), dtype) for _ in range(2))
    dout = make_input(rng, (2, 300, 8, 128), dtype)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    runs = [fa.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert cp.array_equal(x.view(cp.uint16), y.view(cp.uint16))


def test_bound_rejects_wrong_gradients():
    """The bound is tight enough: the kernel's correct gradients fail it against wrong references."""
    from fa2cupy.reference import attention_ref_backward

    fa = _fa2cupy()
    rng = np.random.default_rng(31)
    dtype, (b, sq, sk, h, hkv, d) = "float16", (1, 128, 192, 4, 2, 64)
    q = make_input(rng, (b, sq, h, d), dtype)
    k, v = (make_input(rng, (b, sk, hkv, d), dtype) for _ in range(2))
    dout = make_input(rng, (b, sq, h, d), dtype)
    hd, hq, hk, hv = (_host64(x) for x in (dout, q, k, v))
    scale = d ** -0.5
    got = {}
    for causal in (True, False):
        out, lse, _ = fa.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        grads = fa.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
        check_gradients(dout, q, k, v, out, grads, None, causal, dtype)   # the right reference passes
        got[causal] = [_host64(x) for x in grads]

    def exceeds(g, ref, names="qkv"):
        return any(np.abs(g["qkv".index(n)] - ref["qkv".index(n)]).max()
                   > bound_for(dtype, scale, d, hd, hq, hk, hv, ref["qkv".index(n)]) for n in names)

    assert exceeds(got[True], attention_ref_backward(hd, hq, hk, hv, causal=False)), "causal flipped not detected"
    assert exceeds(got[True], attention_ref_backward(hd, hq, hk, hv, softmax_scale=1.05 * scale, causal=True)), \
        "a 5% wrong softmax_scale not detected"
    keep = np.r_[0:64, 128:sk]   # keys 64..127 missing: a skipped block; compare dq
    dq_missing, _, _ = attention_ref_backward(hd, hq, hk[:, keep], hv[:, keep], causal=False)
    assert exceeds(got[False], (dq_missing, None, None), "q"), "a dropped key block not detected in dq"


# ------------------------------------------------------------------ interop


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_on_non_default_stream(dtype):
    torch = _torch()
    fa = _fa2cupy()
    tdt = getattr(torch, dtype)
    dev = torch.device("cuda", torch.cuda.current_device())
    qs, kvs = (2, 150, 4, 64), (2, 230, 2, 64)
    final = [torch.randn(s, device=dev).to(tdt) for s in (qs, kvs, kvs, qs)]
    torch.cuda.synchronize()
    s = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(s):
        # Stale contents, a long sleep on s, then the real values: kernels that do not
        # run on s would read the stale (all -1) inputs.
        q, k, v, dout = (torch.full(x.shape, -1.0, device=dev, dtype=tdt) for x in final)
        torch.cuda._sleep(200_000_000)
        for dst, src in zip((q, k, v, dout), final):
            dst.copy_(src)
        out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        dq, dk, dv = fa.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
        copies = [x.clone() for x in (dq, dk, dv)]   # consumers on s must see finished results
    s.synchronize()
    for x, like in zip((dq, dk, dv), (q, k, v)):
        assert isinstance(x, torch.Tensor) and x.device == dev and x.dtype == tdt and x.shape == like.shape
    for x, c in zip((dq, dk, dv), copies):
        assert torch.equal(x, c)
    check_gradients(final[3], final[0], final[1], final[2], out, (dq, dk, dv), None, True, dtype)
