"""Varlen sequences and the score modifiers (softcap, ALiBi) on a real GPU, forward and backward.

Compared against the float64 reference (``attention_ref``/``attention_ref_varlen`` and their backward) on exactly
the rounded inputs the kernels see, with the bounds of tests/test_forward_gpu.py (out: 4u max|v| + 1e-6; lse:
1e-3 (1 + |ref|)) and tests/test_backward_gpu.py (16u max|ref_g| + floor). The backward reference is taken *for
the out the kernel was given* (``attention_ref_backward(..., out=out)``), the same exact correction
test_backward_gpu applies. Softcap's tanh and the ALiBi bias are fp32 in the kernels: O(2^-24 |logit|) error,
far below u.

Also: a varlen call equals the padded call of each sequence on its own bitwise (same tiles, same arithmetic);
rows past ``cu_seqlens[-1]`` are not written (they stay poisoned and are not compared); cu_seqlens values that do
not fit the arrays are reported by the kernels as a ValueError naming them, and nothing plausible is returned.
Every output is poisoned with NaN before the launch (``KernelOptions(debug_poison=True)``, through the helpers).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from fa2cupy import testing as B
from fa2cupy.reference import (
    attention_ref,
    attention_ref_backward,
    attention_ref_varlen,
    attention_ref_varlen_backward,
)
from gpu_helpers import (  # noqa: F401 -- poison_forward_and_backward is an autouse fixture
    UNIT_ROUNDOFF, checked_calls, cu_seqlens, cupy_module as _cupy, debug_poison, fa2cupy_module, kernel_options,
    np_dtype as _np_dtype, poison_forward_and_backward, skip_unless_hopper, torch_cuda as _torch)

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 2, 15, 16, 17, 63, 64, 65, 128, 129, 200, 300]
HEADDIMS = [32, 64, 96, 128, 40, 160, 256]
HEAD_GROUPS = [(1, 1), (2, 2), (4, 1), (6, 3), (8, 2)]
SHORT = {"float16": "fp16", "bfloat16": "bf16"}
EXAMPLES = max(10, settings().max_examples // 4)


def _randn(rng, shape, dtype):
    return _cupy().asarray(rng.standard_normal(shape, dtype=np.float32).astype(_np_dtype(dtype)))


def _host(x) -> np.ndarray:
    return B.to_numpy64(x)


def _check_out(out, lse, ref_out, ref_lse, v, dtype, rows=None):
    """out/lse against the reference; ``rows`` (varlen) selects the rows that belong to a sequence."""
    out_h, lse_h = _host(out), _host(lse)
    if rows is not None:
        out_h, ref_out = out_h[rows], ref_out[rows]
        lse_h, ref_lse = lse_h[:, rows], ref_lse[:, rows]
    assert not np.isnan(out_h).any(), "out has NaN: rows of a sequence were left unwritten"
    tol = 4 * UNIT_ROUNDOFF[dtype] * float(np.abs(_host(v)).max()) + 1e-6
    err = np.abs(out_h - ref_out)
    msg = f"max|out-ref|={err.max() if err.size else 0:.3e} tol={tol:.3e}"
    if currently_in_test_context():
        note(msg)
    assert err.size == 0 or err.max() <= tol, msg
    dead = np.isinf(ref_lse)
    assert np.all(lse_h[dead] == np.inf), "rows with no visible key must have lse +inf"
    live = ~dead
    assert np.all(np.abs(lse_h[live] - ref_lse[live]) <= 1e-3 * (1 + np.abs(ref_lse[live])))


def _check_grads(grads, refs, dtype, scale, d, dout, q, k, v, selections=(None, None, None)):
    """dq, dk, dv against ``refs``: the reference's (dq, dk, dv), or with its magnitudes (``with_magnitudes``),
    whose unit roundoff is added to each bound: the kernels round dS and P to the input dtype before the products
    that make the gradients, which cancel to far less than their terms in some cases (one query row over many keys
    at a small head dim: max|dq| 128 times below its terms' sum)."""
    amax = lambda x: float(np.abs(x).max(initial=0.0))  # noqa: E731 -- sequences may all be empty
    floor = B.gradient_floor(scale, d, amax(dout), amax(v), max(amax(q), amax(k)))
    mags = refs[3] if len(refs) == 4 else (None, None, None)
    for name, g, ref, mag, rows in zip(("dq", "dk", "dv"), grads, refs[:3], mags, selections):
        g = _host(g)
        if rows is not None:
            g, ref = g[rows], ref[rows]
            mag = None if mag is None else mag[rows]
        assert not np.isnan(g).any(), f"{name} has NaN: rows of a sequence were left unwritten"
        rounding = 0.0 if mag is None else B.unit_roundoff(dtype) * amax(mag)
        tol = B.gradient_bound(SHORT[dtype], float(np.abs(ref).max()) if ref.size else 0.0, floor + rounding)
        err = float(np.abs(g - ref).max()) if g.size else 0.0
        msg = f"max|{name}-ref|={err:.3e} max|ref|={np.abs(ref).max() if ref.size else 0:.3e} tol={tol:.3e}"
        if currently_in_test_context():
            note(msg)
        assert err <= tol, msg


def _slopes(rng, batch, nheads, per_batch):
    shape = (batch, nheads) if per_batch else (nheads,)
    return _cupy().asarray(rng.uniform(0.0, 0.5, shape).astype(np.float32))


# ------------------------------------------------------------------------------------------ padded, modifiers


@st.composite
def mod_cases(draw, headdims=HEADDIMS, lengths=LENGTHS[1:]):
    h, hkv = draw(st.sampled_from(HEAD_GROUPS))
    return dict(
        batch=draw(st.integers(1, 2)), seqlen_q=draw(st.sampled_from(lengths)),
        seqlen_k=draw(st.sampled_from(lengths)), nheads=h, nheads_kv=hkv, headdim=draw(st.sampled_from(headdims)),
        causal=draw(st.booleans()),
        window_size=draw(st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 80), st.integers(-1, 80)))),
        softcap=draw(st.sampled_from([0.0, 0.0, 1.0, 5.0, 30.0])),
        alibi=draw(st.sampled_from([None, "heads", "batch"])),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.05, 1.5), st.floats(-1.0, -0.05))),
        deterministic=draw(st.booleans()),
        # head dims without a Hopper row: padded up to the Hopper kernels (default) or the mma.sync kernels (False)
        hopper_pad=draw(st.sampled_from([None, None, False])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=EXAMPLES, deadline=None)
@given(mod_cases())
def test_softcap_alibi_forward_backward(c):
    if c["softcap"] == 0.0 and c["alibi"] is None:
        c["softcap"] = 2.0  # this test is about the modifiers
    run_mods_case(c)


def run_mods_case(c):
    """Padded forward and backward of case dict ``c`` (mod_cases' keys; optionally ``headdim_v``, v's head dim where
    it differs from q's) against the float64 reference."""
    with kernel_options(hopper_pad_headdim=c.get("hopper_pad")):
        _run_mods_case(c)


def _run_mods_case(c):
    fa = fa2cupy_module()
    rng = np.random.default_rng(c["seed"])
    b, sq, sk, h, hkv, d, dtype = (c[n] for n in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "headdim",
                                                  "dtype"))
    dv = c.get("headdim_v", d)
    q, k, v = _randn(rng, (b, sq, h, d), dtype), _randn(rng, (b, sk, hkv, d), dtype), _randn(rng, (b, sk, hkv, dv),
                                                                                             dtype)
    dout = _randn(rng, (b, sq, h, dv), dtype)
    slopes = None if c["alibi"] is None else _slopes(rng, b, h, c["alibi"] == "batch")
    kw = dict(softmax_scale=c["softmax_scale"], causal=c["causal"], window_size=c["window_size"],
              softcap=c["softcap"], alibi_slopes=slopes)
    out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert out.shape == dout.shape
    ref_kw = dict(kw, alibi_slopes=None if slopes is None else _cupy().asnumpy(slopes))
    qh, kh, vh, doh = (_host(x) for x in (q, k, v, dout))
    ref_out, ref_lse = attention_ref(qh, kh, vh, **ref_kw)
    _check_padded(out, lse, ref_out, ref_lse, v, dtype)
    grads = fa.flash_attn_backward(dout, q, k, v, out, lse, deterministic=c["deterministic"], **kw)
    refs = attention_ref_backward(doh, qh, kh, vh, out=_host(out), with_magnitudes=True, **ref_kw)
    scale = 1 / math.sqrt(d) if c["softmax_scale"] is None else c["softmax_scale"]
    _check_grads(grads, refs, dtype, abs(scale), max(d, dv), doh, qh, kh, vh)


def _check_padded(out, lse, ref_out, ref_lse, v, dtype):
    """Padded layout: lse (b, h, sq) checked per batch entry through the varlen-shaped checker."""
    for bi in range(out.shape[0]):
        _check_out(out[bi], lse[bi], ref_out[bi], ref_lse[bi], v, dtype)


def test_softcap_bounds_the_logits():
    """A large score with a small cap: the probabilities must follow the capped logits, not the raw ones."""
    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(1)
    q = _randn(rng, (1, 64, 2, 64), "float16") * 4
    k = _randn(rng, (1, 96, 2, 64), "float16") * 4
    v = _randn(rng, (1, 96, 2, 64), "float16")
    out, lse, _ = fa.flash_attn_func(q, k, v, softcap=1.0, return_attn_probs=True)
    ref_out, ref_lse = attention_ref(cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v), softcap=1.0)
    _check_padded(out, lse, ref_out, ref_lse, v, "float16")
    plain, _ = attention_ref(cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v))
    assert np.abs(plain - ref_out).max() > 0.1  # the cap changes the answer: the test can fail


# ------------------------------------------------------------------------------------------ varlen


@st.composite
def varlen_cases(draw):
    batch = draw(st.integers(1, 4))
    h, hkv = draw(st.sampled_from(HEAD_GROUPS))
    lq = draw(st.lists(st.sampled_from(LENGTHS), min_size=batch, max_size=batch))
    same = draw(st.booleans())
    lk = lq if same else draw(st.lists(st.sampled_from(LENGTHS), min_size=batch, max_size=batch))
    return dict(
        lengths_q=lq, lengths_k=lk, nheads=h, nheads_kv=hkv, headdim=draw(st.sampled_from(HEADDIMS)),
        causal=draw(st.booleans()),
        window_size=draw(st.one_of(st.just((-1, -1)), st.just((-1, -1)),
                                   st.tuples(st.integers(-1, 80), st.integers(-1, 80)))),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 3.0])),
        alibi=draw(st.sampled_from([None, None, "heads", "batch"])),
        extra_rows=draw(st.sampled_from([0, 0, 5])),  # rows past cu_seqlens[-1], which nothing may read
        slack=draw(st.sampled_from([0, 0, 7])),  # max_seqlen larger than the longest sequence
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        deterministic=draw(st.booleans()),
        # head dims without a Hopper row: padded up to the Hopper kernels (default) or the mma.sync kernels (False)
        hopper_pad=draw(st.sampled_from([None, None, False])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _varlen_inputs(c):
    rng = np.random.default_rng(c["seed"])
    h, hkv, d, dtype = c["nheads"], c["nheads_kv"], c["headdim"], c["dtype"]
    dv = c.get("headdim_v", d)  # (v's head dim, and the output's)
    cu_q, cu_k = cu_seqlens(c["lengths_q"]), cu_seqlens(c["lengths_k"])
    tq, tk = int(cu_q[-1]) + c["extra_rows"], int(cu_k[-1]) + c["extra_rows"]
    tq, tk = max(tq, 1), max(tk, 1)
    arrays = dict(q=_randn(rng, (tq, h, d), dtype), k=_randn(rng, (tk, hkv, d), dtype),
                  v=_randn(rng, (tk, hkv, dv), dtype), dout=_randn(rng, (tq, h, dv), dtype))
    slopes = None if c["alibi"] is None else _slopes(rng, len(c["lengths_q"]), h, c["alibi"] == "batch")
    return arrays, cu_q, cu_k, slopes


@settings(max_examples=EXAMPLES, deadline=None)
@given(varlen_cases())
def test_varlen_forward_backward(c):
    run_varlen_case(c)


def run_varlen_case(c):
    """Varlen forward and backward of case dict ``c`` (varlen_cases' keys; optionally ``headdim_v``, v's head dim)
    against the float64 reference."""
    with kernel_options(hopper_pad_headdim=c.get("hopper_pad")):
        _run_varlen_case(c)


def _run_varlen_case(c):
    fa = fa2cupy_module()
    cp = _cupy()
    x, cu_q, cu_k, slopes = _varlen_inputs(c)
    max_q, max_k = max(c["lengths_q"]) + c["slack"], max(c["lengths_k"]) + c["slack"]
    kw = dict(causal=c["causal"], window_size=c["window_size"], softcap=c["softcap"], alibi_slopes=slopes)
    out, lse, _ = fa.flash_attn_varlen_func(x["q"], x["k"], x["v"], cp.asarray(cu_q), cp.asarray(cu_k), max_q, max_k,
                                            return_attn_probs=True, **kw)
    assert out.shape == x["dout"].shape and lse.shape == (c["nheads"], x["q"].shape[0])
    ref_kw = dict(kw, alibi_slopes=None if slopes is None else cp.asnumpy(slopes))
    qh, kh, vh, doh = (_host(x[n]) for n in ("q", "k", "v", "dout"))
    ref_out, ref_lse = attention_ref_varlen(qh, kh, vh, cu_q, cu_k, **ref_kw)
    rows_q, rows_k = np.arange(int(cu_q[-1])), np.arange(int(cu_k[-1]))
    _check_out(out, lse, ref_out, ref_lse, x["v"], c["dtype"], rows=rows_q)

    grads = fa.flash_attn_varlen_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, cp.asarray(cu_q),
                                          cp.asarray(cu_k), max_q, max_k, deterministic=c["deterministic"], **kw)
    refs = attention_ref_varlen_backward(doh, qh, kh, vh, cu_q, cu_k, out=_host(out), with_magnitudes=True, **ref_kw)
    _check_grads(grads, refs, c["dtype"], 1 / math.sqrt(c["headdim"]), max(c["headdim"], vh.shape[-1]), doh[rows_q],
                 qh[rows_q], kh[rows_k], vh[rows_k], selections=(rows_q, rows_k, rows_k))
    for g, end in zip(grads, (cu_q[-1], cu_k[-1], cu_k[-1])):  # rows past every sequence: exactly zero
        assert np.all(_host(g)[int(end):] == 0.0)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_varlen_cached_fast_path(framework):
    """Repeated varlen calls with the same metadata take the cached fast path (plan reused, no checks): it must honour
    new cu_seqlens values (they live on the GPU) and still zero the gradient rows past the last sequence, which here
    land in fresh, unpoisoned memory. Each call has new data, so a stale output cannot match its reference."""
    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(11)
    h, hkv, d, total = 4, 2, 64, 300
    with debug_poison(False), checked_calls() as checked:
        for lengths in ([100, 0, 150], [30, 200, 5], [1, 1, 250]):
            cu = cu_seqlens(lengths)  # the same shape each time; the rows past cu[-1] change
            q, k, v, dout = (_randn(rng, (total, n, d), "float16") for n in (h, hkv, hkv, h))
            cu_d = cp.asarray(cu)
            args = (q, k, v, dout, cu_d)
            if framework == "torch":
                torch = _torch()
                args = tuple(torch.from_dlpack(x) for x in args)
            tq, tk, tv, tdo, tcu = args
            out, lse, _ = fa.flash_attn_varlen_func(tq, tk, tv, tcu, tcu, 250, 250, causal=True,
                                                    return_attn_probs=True)
            grads = fa.flash_attn_varlen_backward(tdo, tq, tk, tv, out, lse, tcu, tcu, 250, 250, causal=True)
            rows = np.arange(int(cu[-1]))
            qh, kh, vh, doh = (_host(x) for x in (q, k, v, dout))
            ref_out, ref_lse = attention_ref_varlen(qh, kh, vh, cu, cu, causal=True)
            _check_out(out, lse, ref_out, ref_lse, v, "float16", rows=rows)
            refs = attention_ref_varlen_backward(doh, qh, kh, vh, cu, cu, causal=True, out=_host(out))
            _check_grads(grads, refs, "float16", 1 / math.sqrt(d), d, doh[rows], qh[rows], kh[rows], vh[rows],
                         selections=(rows, rows, rows))
            for g in grads:
                assert np.all(_host(g)[int(cu[-1]):] == 0.0), "rows past the last sequence must be zero"
        # one forward and one backward plan (made by the first call, or an earlier test), reused by the later calls
        assert checked.count("varlen_fwd") <= 1 and checked.count("varlen_bwd") <= 1


@pytest.mark.parametrize("hopper", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_padded_bitwise(causal, hopper):
    """Each sequence of a varlen call gives bitwise what a batch-1 call on that sequence alone gives, on one forward
    kernel (the masked calls' length rule would otherwise put the short sequences' own calls on the other one)."""
    if hopper:
        skip_unless_hopper("forward")
    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(7)
    lengths = [130, 0, 1, 257, 64]
    cu = cu_seqlens(lengths)
    q, k, v = (_randn(rng, (int(cu[-1]), 4, 128), "bfloat16") for _ in range(3))
    with kernel_options(hopper_forward=hopper, hopper_masked_min_seqlen=0):
        out = fa.flash_attn_varlen_func(q, k, v, cp.asarray(cu), cp.asarray(cu), max(lengths), max(lengths),
                                        causal=causal)
        for b, n in enumerate(lengths):
            if n == 0:
                continue
            s = slice(int(cu[b]), int(cu[b + 1]))
            alone = fa.flash_attn_func(q[None, s], k[None, s], v[None, s], causal=causal)
            assert cp.array_equal(out[s].view(cp.uint16), alone[0].view(cp.uint16)), f"sequence {b} differs"


@pytest.mark.parametrize("bad", ["decreasing", "past_end", "over_max", "negative"])
def test_bad_cu_seqlens_raise(bad):
    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(3)
    q, k, v = (_randn(rng, (100, 2, 64), "float16") for _ in range(3))
    cu = {"decreasing": [0, 60, 40, 100], "past_end": [0, 50, 100, 140], "over_max": [0, 10, 90, 100],
          "negative": [-8, 10, 50, 100]}[bad]
    cu = cp.asarray(np.array(cu, np.int32))
    fa.flash_attn_varlen_func(q, k, v, cu, cu, 60, 60)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fa.check_device_errors()
    fa.check_device_errors()  # reported once, then cleared
    ok = cp.asarray(np.array([0, 50, 100], np.int32))
    out = fa.flash_attn_varlen_func(q, k, v, ok, ok, 50, 50)  # a good call afterwards works
    assert not cp.isnan(out).any()


def test_varlen_packed_forms_are_views():
    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(5)
    cu = cp.asarray(cu_seqlens([33, 70]))
    qkv = _randn(rng, (103, 3, 4, 64), "float16")
    a = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 70, causal=True)
    b = fa.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 70, 70, causal=True)
    assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))
    q = _randn(rng, (103, 4, 64), "float16")
    kv = _randn(rng, (103, 2, 2, 64), "float16")
    a = fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 70, 70)
    b = fa.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, 70, 70)
    assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))


# ------------------------------------------------------------------------------------------ torch


@pytest.mark.parametrize("mods", ["softcap", "alibi", "varlen"])
def test_torch_gradients(mods):
    torch = _torch()
    fat = fa2cupy_module("torch")
    g = torch.Generator(device="cpu").manual_seed(11)
    dtype = torch.bfloat16
    if mods == "varlen":
        cu = torch.tensor([0, 37, 37, 130], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn((130, 4, 64), generator=g).to("cuda", dtype).requires_grad_() for _ in range(3))
        out = fat.flash_attn_varlen_func(q, k, v, cu, cu, 93, 93, causal=True)
        ref_out, _ = attention_ref_varlen(*(x.detach().float().cpu().numpy() for x in (q, k, v)), cu.cpu().numpy(),
                                          cu.cpu().numpy(), causal=True)
    else:
        q, k, v = (torch.randn((2, 77, 4, 64), generator=g).to("cuda", dtype).requires_grad_() for _ in range(3))
        slopes = torch.rand((2, 4), generator=g).cuda() * 0.3 if mods == "alibi" else None
        cap = 4.0 if mods == "softcap" else 0.0
        out = fat.flash_attn_func(q, k, v, causal=True, softcap=cap, alibi_slopes=slopes)
        ref_out, _ = attention_ref(*(x.detach().float().cpu().numpy() for x in (q, k, v)), causal=True, softcap=cap,
                                   alibi_slopes=None if slopes is None else slopes.cpu().numpy())
    dout = torch.randn(out.shape, generator=g).to("cuda", dtype)
    out.backward(dout)
    host = lambda t: t.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    assert np.abs(host(out) - ref_out).max() <= 4 * 2**-8 * np.abs(host(v)).max() + 1e-6
    if mods == "varlen":
        refs = attention_ref_varlen_backward(host(dout), host(q), host(k), host(v), cu.cpu().numpy(),
                                             cu.cpu().numpy(), causal=True, out=host(out))
    else:
        refs = attention_ref_backward(host(dout), host(q), host(k), host(v), causal=True, softcap=cap,
                                      alibi_slopes=None if slopes is None else slopes.cpu().numpy(), out=host(out))
    _check_grads((q.grad, k.grad, v.grad), refs, "bfloat16", 1 / 8, 64, host(dout), host(q), host(k), host(v))


# ------------------------------------------------------------------------------------------ dropout


@st.composite
def dropout_cases(draw):
    h, hkv = draw(st.sampled_from(HEAD_GROUPS))
    return dict(
        batch=draw(st.integers(1, 2)), seqlen_q=draw(st.sampled_from([1, 17, 64, 65, 130, 200])),
        seqlen_k=draw(st.sampled_from([1, 16, 63, 128, 129, 200])), nheads=h, nheads_kv=hkv,
        headdim=draw(st.sampled_from([32, 64, 128, 40])), causal=draw(st.booleans()),
        softcap=draw(st.sampled_from([0.0, 0.0, 4.0])), dropout_p=draw(st.sampled_from([0.1, 0.5, 0.9])),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])), deterministic=draw(st.booleans()),
        dropout_seed=draw(st.integers(0, 2**64 - 1)), dropout_offset=draw(st.integers(0, 2**40)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _check_dropout_call(b, sq, sk, h, hkv, d, dtype, p, causal, softcap, deterministic, dropout_seed,
                        dropout_offset, seed):
    """Output, gradients and return_attn_probs of one dropout call against the reference that applies the mask
    fa2cupy.dropout_mask reports, with the dropout probability the kernels realise (steps of 1/256)."""
    from fa2cupy.forward import realised_dropout_p

    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(seed)
    q, k, v = _randn(rng, (b, sq, h, d), dtype), _randn(rng, (b, sk, hkv, d), dtype), _randn(rng, (b, sk, hkv, d),
                                                                                             dtype)
    dout = _randn(rng, (b, sq, h, d), dtype)
    rng_kw = dict(dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    kw = dict(causal=causal, softcap=softcap)
    out, lse, probs = fa.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **kw, **rng_kw)
    mask = cp.asnumpy(fa.dropout_mask(b, h, sq, sk, p, dropout_seed, dropout_offset))
    realised = realised_dropout_p(p)
    qh, kh, vh, doh = (_host(x) for x in (q, k, v, dout))
    ref_out, ref_lse = attention_ref(qh, kh, vh, dropout_p=realised, dropout_mask=mask, **kw)
    for bi in range(b):
        _check_out(out[bi], lse[bi], ref_out[bi], ref_lse[bi], v * (1 / (1 - realised)), dtype)
    grads = fa.flash_attn_backward(dout, q, k, v, out, lse, deterministic=deterministic, dropout_p=p, **kw,
                                   **rng_kw)
    refs = attention_ref_backward(doh, qh, kh, vh, out=_host(out), dropout_p=realised, dropout_mask=mask, **kw)
    _check_grads(grads, refs, dtype, 1 / math.sqrt(d) / (1 - realised), d, doh, qh, kh, vh)
    # return_attn_probs: P o Z / (1 - p) as the output was made of (float32, recomputed from the kernel's lse)
    from fa2cupy.reference import attention_probs_ref as _probs64
    p_ref = _probs64(qh, kh, 1 / math.sqrt(d), causal) if softcap == 0 else None
    if p_ref is not None:
        expect = np.where(mask, p_ref, 0.0) / (1 - realised)
        assert np.abs(_host(probs) - expect).max() <= 1e-3 * max(1.0, float(np.abs(expect).max()))


@settings(max_examples=EXAMPLES, deadline=None)
@given(dropout_cases())
def test_dropout_matches_reference_with_the_reported_mask(c):
    """The kernels' output and gradients equal the reference that applies the mask fa2cupy.dropout_mask reports."""
    _check_dropout_call(*(c[n] for n in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "headdim", "dtype",
                                         "dropout_p", "causal", "softcap", "deterministic", "dropout_seed",
                                         "dropout_offset", "seed")))


@pytest.mark.parametrize("family, headdim", [("native", 160), ("native", 256), ("sm86", 192), ("sm86", 224)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_dropout_on_every_warp_tiling(family, headdim, deterministic, monkeypatch):
    """Dropout on the rows whose warps span 16 rows or keys, where each uses half of a Philox call (the test above
    covers the 32-row ones): the forward's 16-row warps (d >= 160), the dK/dV kernel's 16-key (d=160 on sm_90) and
    16-query warps (d=256 on sm_90, the sm86 rows' 16-row blocks at d=224), the dQ kernel's 16-key tiles (sm86 rows
    above d=128). ``sm86`` plans the call with that family's rows on this GPU."""
    from fa2cupy import configs

    if family == "sm86":
        monkeypatch.setattr(configs, "arch_family", lambda arch: "sm86")  # (poisoned calls are never cached)
    _check_dropout_call(1, 77, 100, 2, 1, headdim, "bfloat16" if headdim % 64 else "float16", 0.3,
                        headdim % 64 == 32, 0.0, deterministic, 2**63 + headdim, 2**33 + 5, headdim)


def test_dropout_keep_rate_and_reproducibility():
    from fa2cupy.forward import realised_dropout_p

    fa = fa2cupy_module()
    cp = _cupy()
    for p in (0.1, 0.3, 0.75):
        mask = fa.dropout_mask(4, 8, 512, 512, p, 1234, 0)
        n = mask.size
        rate = float(mask.mean())
        keep = round((1 - p) * 256) / 256
        assert keep == 1 - realised_dropout_p(p)
        sigma = math.sqrt(keep * (1 - keep) / n)
        assert abs(rate - keep) <= 5 * sigma, (p, rate, keep)
        assert abs(keep - (1 - p)) <= 2**-9
        # neighbours are not copies of each other (a broken counter would repeat whole blocks)
        assert float((mask[..., ::2] == mask[..., 1::2]).mean()) < 1 - 0.1 * min(p, 1 - p)
    rng = np.random.default_rng(9)
    q, k, v = (_randn(rng, (2, 100, 4, 64), "bfloat16") for _ in range(3))
    a = fa.flash_attn_func(q, k, v, dropout_p=0.2, dropout_seed=7, dropout_offset=3)
    b = fa.flash_attn_func(q, k, v, dropout_p=0.2, dropout_seed=7, dropout_offset=3)
    assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)), "same seed and offset must be bitwise equal"
    for other in (dict(dropout_seed=8, dropout_offset=3), dict(dropout_seed=7, dropout_offset=4)):
        c = fa.flash_attn_func(q, k, v, dropout_p=0.2, **other)
        assert not cp.array_equal(a.view(cp.uint16), c.view(cp.uint16))
    with pytest.raises(ValueError, match="dropout_seed"):
        fa.flash_attn_func(q, k, v, dropout_p=0.2)


def test_varlen_dropout_mask_is_per_sequence():
    """Sequence b of a varlen call drops what batch entry b of a padded call with the same seed drops."""
    from fa2cupy.forward import realised_dropout_p

    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(4)
    lengths = [70, 0, 33]
    cu = cu_seqlens(lengths)
    q, k, v = (_randn(rng, (int(cu[-1]), 2, 64), "float16") for _ in range(3))
    out = fa.flash_attn_varlen_func(q, k, v, cp.asarray(cu), cp.asarray(cu), 70, 70, dropout_p=0.4, causal=True,
                                    dropout_seed=99, dropout_offset=5)
    for bi, n in enumerate(lengths):
        if n == 0:
            continue
        s = slice(int(cu[bi]), int(cu[bi + 1]))
        mask = cp.asnumpy(fa.dropout_mask(len(lengths), 2, n, n, 0.4, 99, 5))[bi : bi + 1]
        ref, _ = attention_ref(_host(q[None, s]), _host(k[None, s]), _host(v[None, s]), causal=True,
                               dropout_p=realised_dropout_p(0.4), dropout_mask=mask)
        tol = 4 * UNIT_ROUNDOFF["float16"] * float(np.abs(_host(v)).max()) / (1 - realised_dropout_p(0.4)) + 1e-6
        assert np.abs(_host(out[s]) - ref[0]).max() <= tol


def test_torch_dropout_uses_torch_generator():
    torch = _torch()
    fa2cupy, fat = fa2cupy_module(), fa2cupy_module("torch")
    from fa2cupy.forward import realised_dropout_p

    g = torch.Generator(device="cpu").manual_seed(2)
    q, k, v = (torch.randn((2, 90, 4, 64), generator=g).to("cuda", torch.float16).requires_grad_() for _ in range(3))
    torch.manual_seed(123)
    state = torch.cuda.default_generators[0].get_state().view(torch.int64)[:2].tolist()
    out = fat.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(123)
    again = fat.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    assert torch.equal(out, again), "torch.manual_seed must reproduce the dropout"
    seed, offset = (x & (2**64 - 1) for x in state)
    mask = _cupy().asnumpy(fa2cupy.dropout_mask(2, 4, 90, 90, 0.3, seed, offset))
    host = lambda t: t.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    p = realised_dropout_p(0.3)  # the kernels' keep probability is a multiple of 1/256
    ref, _ = attention_ref(host(q), host(k), host(v), causal=True, dropout_p=p, dropout_mask=mask)
    assert np.abs(host(out) - ref).max() <= 4 * 2**-11 * np.abs(host(v)).max() / (1 - p) + 1e-6
    dout = torch.randn(out.shape, generator=g).to("cuda", torch.float16)
    out.backward(dout)
    refs = attention_ref_backward(host(dout), host(q), host(k), host(v), causal=True, out=host(out), dropout_p=p,
                                  dropout_mask=mask)
    _check_grads((q.grad, k.grad, v.grad), refs, "float16", 1 / 8 / (1 - p), 64, host(dout), host(q), host(k), host(v))
