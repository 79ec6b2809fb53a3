"""Dropout on the Hopper kernels' modifier rows (HopperFwdTraits' and HopperBwdTraits' Mods) on a GPU of compute
capability 9.0: dropout calls plan the Hopper forward at configs.HOPPER_MODS_HEADDIMS (varlen calls not at
HOPPER_MODS_PADDED_ONLY) and the Hopper dK/dV kernel at HOPPER_BWD_MODS_HEADDIMS but HOPPER_BWD_NO_DROPOUT (varlen
calls not at HOPPER_BWD_MODS_PADDED_ONLY), head dims between the widths at the next width up; the forward's output
and lse and the backward's dq, dk and dv match the float64 reference that applies the keep mask fa2cupy.dropout_mask
reports (the Philox draw of cuda/attention/masks.cuh), alone and with softcap and ALiBi, over every mask, GQA,
negative scales, padded and varlen, with the seed and offset given as ints or in a device rng_state; and for the
same seed and offset the Hopper rows give the same bits call after call and what the mma.sync kernels give, to a
few roundings (both draw that mask), while another offset changes the answer.

Bounds, references and the NaN poisoning of outputs are test_varlen_mods_gpu's, as its dropout checks
(_check_dropout_call) take them: the reference applies the dropout probability the kernels realise (a multiple of
1/256), and the output's bound and the gradients' floor are scaled by 1 / (1 - p).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from fa2cupy import configs
from fa2cupy.reference import attention_ref, attention_ref_backward
from gpu_helpers import (UNIT_ROUNDOFF, cupy_module as _cupy, debug_poison, fa2cupy_module, kernel_options,
                         recorded_backward_plans, recorded_forward_plans)
# (imported here, not inside a Hypothesis test: importing applies @given, which Hypothesis refuses while a test runs)
from test_hopper_backward_gpu import _hopper_gpu, varlen_hopper_cases
from test_varlen_mods_gpu import _check_grads, _check_out, _host, _randn, _slopes, _varlen_inputs, mod_cases

pytestmark = pytest.mark.gpu

#: Head dims of the Hypothesis tests: the Hopper widths and two between them (run at 128 and 192).
HEADDIMS = (64, 96, 128, 160, 192, 256)
LENGTHS = [1, 17, 63, 64, 65, 128, 129, 200, 300]
VARLEN_LENGTHS = (0, 1, 17, 64, 127, 128, 129, 200, 300)
EXAMPLES = max(10, settings().max_examples // 8)


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


def _on_hopper():
    """The calls inside on the Hopper forward whatever the length of a masked call (dropout calls are masked: the
    modifier variant)."""
    _hopper_gpu()
    return kernel_options(hopper_masked_min_seqlen=0)


def _expected_rows(d: int, varlen: bool):
    """(forward row, backward row) that a dropout call of kernels' head dim ``d`` runs on with the default options
    (and any masked length): the Hopper rows at d's Hopper width where they take dropout, else None (the mma.sync
    kernels')."""
    width = configs.hopper_pad_width(90, d) or d
    forward = configs.hopper_forward_row(width, mods=True) if configs.hopper_takes_mods(width, varlen) else None
    backward = (configs.BACKWARD_HOPPER_TABLE[width] if configs.hopper_bwd_takes_mods(width, varlen, dropout=True)
                else None)
    return forward, backward


def _assert_rows(plans, row, mma_type):
    """Every plan in ``plans`` is on ``row``, or with ``row`` None on an ``mma_type`` row."""
    assert plans and all(p.config is row if row is not None else isinstance(p.config, mma_type) for p in plans), (
        row, [p.config for p in plans])


def _rng(c) -> dict:
    """Case ``c``'s dropout seed and offset as the calls take them: ints, or with ``c["rng_state"]`` a device uint32
    (4,) array (seed lo, seed hi, offset lo, offset hi)."""
    seed, offset = c["dropout_seed"], c["dropout_offset"]
    if not c["rng_state"]:
        return dict(dropout_seed=seed, dropout_offset=offset)
    low = 0xFFFFFFFF
    state = np.array([seed & low, seed >> 32, offset & low, offset >> 32], np.uint32)
    return dict(dropout_rng_state=_cupy().asarray(state))


def _same_bits(name, a, b):
    cp = _cupy()
    a, b = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
    view = cp.uint16 if a.dtype.itemsize == 2 else cp.uint32
    assert a.shape == b.shape and cp.array_equal(a.view(view), b.view(view)), f"{name} differs"


# ------------------------------------------------------------------------------------------ planning


@pytest.mark.parametrize("d", sorted(configs.FORWARD_HOPPER_TABLE))
def test_dropout_calls_plan_the_hopper_rows(d):
    """Dropout (alone, and with softcap) plans the Hopper forward's modifier rows at 64, 128, 192 and 256 (varlen:
    not 256) and the Hopper dK/dV kernel's at 128, 192 and 256 (varlen: 192 and 256; at 64 its modifier rows take
    softcap and ALiBi only); the mma.sync kernels elsewhere, and the mma.sync backward with
    KernelOptions(hopper_backward_mods=False)."""
    _hopper_gpu()
    from fa2cupy import backward, forward
    from fa2cupy.options import KernelOptions

    assert (configs.HOPPER_MODS_HEADDIMS, configs.HOPPER_MODS_PADDED_ONLY) == ((64, 128, 192, 256), (256,))
    assert (configs.HOPPER_BWD_MODS_HEADDIMS, configs.HOPPER_BWD_MODS_PADDED_ONLY) == ((64, 128, 192, 256), (128,))
    assert configs.HOPPER_BWD_NO_DROPOUT == (64,)
    shape = (1, 2048, 8, d)
    names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
    for varlen in (False, True):
        row_strides = (0 if varlen else 2048 * 8 * d, 8 * d, d, 1)
        extra = dict(varlen_totals=(2048, 2048)) if varlen else {}
        fwd_row = configs.hopper_forward_row(d, mods=True) if not (varlen and d == 256) else None
        bwd_row = configs.BACKWARD_HOPPER_TABLE[d] if d in ((192, 256) if varlen else (128, 192, 256)) else None
        for causal, mods in itertools.product((False, True), ({}, {"softcap": 5.0})):
            plan = forward.plan_forward(shape, shape, (row_strides,) * 4, "bfloat16", 0.1, causal, 90, dropout_p=0.1,
                                        **mods, **extra)
            _assert_rows([plan], fwd_row, configs.FwdConfig)
            plan = backward.plan_backward(shape, shape, dict.fromkeys(names, row_strides), "bfloat16", 0.1, causal,
                                          False, 90, dropout_p=0.1, **mods, **extra)
            _assert_rows([plan], bwd_row, configs.BwdConfig)
        plan = backward.plan_backward(shape, shape, dict.fromkeys(names, row_strides), "bfloat16", 0.1, True, True,
                                      90, dropout_p=0.1, **extra)
        _assert_rows([plan], bwd_row, configs.BwdConfig)  # deterministic: the same rows
        if bwd_row is not None:
            assert plan.dq is None  # (dQ added in turns: no dQ kernel of its own)
        plan = backward.plan_backward(shape, shape, dict.fromkeys(names, row_strides), "bfloat16", 0.1, True, False,
                                      90, dropout_p=0.1, options=KernelOptions(hopper_backward_mods=False), **extra)
        assert isinstance(plan.config, configs.BwdConfig)
        plan = forward.plan_forward(shape, shape, (row_strides,) * 4, "bfloat16", 0.1, True, 90, dropout_p=0.1,
                                    options=KernelOptions(hopper_forward=False), **extra)
        assert isinstance(plan.config, configs.FwdConfig)


@pytest.mark.parametrize("d, width", [(96, 128), (176, 192), (224, 256)])
def test_dropout_at_head_dims_between_the_widths(d, width):
    """A dropout call at a head dim without a Hopper row plans the modifier rows of the next width up, on arrays of
    its own head dim (padded calls; varlen calls where the wider rows take them)."""
    _hopper_gpu()
    from fa2cupy import backward, forward

    shape = (1, 300, 4, d)
    names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
    strides = (300 * 4 * d, 4 * d, d, 1)
    plan = forward.plan_forward(shape, shape, (strides,) * 4, "bfloat16", 0.1, True, 90, dropout_p=0.1, width=width)
    assert plan.config is configs.hopper_forward_row(width, mods=True)
    plan = backward.plan_backward(shape, shape, dict.fromkeys(names, strides), "bfloat16", 0.1, True, False, 90,
                                  dropout_p=0.1, width=width)
    assert plan.config is configs.BACKWARD_HOPPER_TABLE[width]
    varlen = (0, 4 * d, d, 1)  # (varlen: the forward's rows not at 256, the backward's not at 128)
    plan = forward.plan_forward((3, 300, 4, d), (3, 300, 4, d), (varlen,) * 4, "bfloat16", 0.1, True, 90,
                                dropout_p=0.1, varlen_totals=(700, 700), width=width)
    _assert_rows([plan], configs.hopper_forward_row(width, mods=True) if width != 256 else None, configs.FwdConfig)
    plan = backward.plan_backward((3, 300, 4, d), (3, 300, 4, d), dict.fromkeys(names, varlen), "bfloat16", 0.1,
                                  True, False, 90, dropout_p=0.1, varlen_totals=(700, 700), width=width)
    _assert_rows([plan], configs.BACKWARD_HOPPER_TABLE[width] if width != 128 else None, configs.BwdConfig)


# ------------------------------------------------------------------------------------------ against the reference


@st.composite
def dropout_cases(draw):
    """A padded case (mod_cases' keys) with dropout: softcap and ALiBi as mod_cases draws them or neither, a dropout
    probability, a fresh seed and offset (offsets past 2**32 too: their high word goes into the Philox key), given
    as ints or in a device rng_state."""
    c = draw(mod_cases(headdims=HEADDIMS, lengths=LENGTHS))
    c.pop("hopper_pad")  # (head dims between the widths run at the next one up: the default)
    if draw(st.booleans()):
        c.update(softcap=0.0, alibi=None)
    c.update(dropout_p=draw(st.sampled_from([0.1, 0.3])), dropout_seed=draw(st.integers(0, 2**64 - 1)),
             dropout_offset=draw(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))),
             rng_state=draw(st.booleans()))
    return c


@st.composite
def varlen_dropout_cases(draw):
    """A varlen case (varlen_hopper_cases' keys) with dropout, as dropout_cases."""
    c = draw(varlen_hopper_cases(headdims=HEADDIMS, lengths=VARLEN_LENGTHS, mods=draw(st.booleans())))
    c.update(dropout_p=draw(st.sampled_from([0.1, 0.3])), dropout_seed=draw(st.integers(0, 2**64 - 1)),
             dropout_offset=draw(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))),
             rng_state=draw(st.booleans()))
    return c


OUTPUTS = ("out", "lse", "dq", "dk", "dv")


def run_dropout_case(c, rows=None):
    """Padded forward and backward of dropout case ``c`` (dropout_cases' keys) against the float64 reference with
    the keep mask fa2cupy.dropout_mask reports; asserts the rows planned: ``rows`` (forward row, backward row, None
    for the mma.sync kernels'), by default _expected_rows'. Returns a dict of OUTPUTS and the input v."""
    from fa2cupy.forward import realised_dropout_p

    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(c["seed"])
    b, sq, sk, h, hkv, d, dtype = (c[n] for n in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "headdim",
                                                  "dtype"))
    q, k, v, dout = (_randn(rng, shape, dtype) for shape in ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d),
                                                             (b, sq, h, d)))
    slopes = None if c["alibi"] is None else _slopes(rng, b, h, c["alibi"] == "batch")
    p = c["dropout_p"]
    kw = dict(softmax_scale=c["softmax_scale"], causal=c["causal"], window_size=c["window_size"],
              softcap=c["softcap"], alibi_slopes=slopes, dropout_p=p)
    with _on_hopper(), recorded_forward_plans() as fwd_plans, recorded_backward_plans() as bwd_plans:
        out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw, **_rng(c))
        grads = fa.flash_attn_backward(dout, q, k, v, out, lse, deterministic=c["deterministic"], **kw, **_rng(c))
    fwd_row, bwd_row = rows or _expected_rows(d, varlen=False)
    _assert_rows(fwd_plans, fwd_row, configs.FwdConfig)
    _assert_rows(bwd_plans, bwd_row, configs.BwdConfig)

    mask = cp.asnumpy(fa.dropout_mask(b, h, sq, sk, p, c["dropout_seed"], c["dropout_offset"]))
    realised = realised_dropout_p(p)
    ref_kw = dict(kw, alibi_slopes=None if slopes is None else cp.asnumpy(slopes), dropout_p=realised,
                  dropout_mask=mask)
    qh, kh, vh, doh = (_host(x) for x in (q, k, v, dout))
    ref_out, ref_lse = attention_ref(qh, kh, vh, **ref_kw)
    for bi in range(b):
        _check_out(out[bi], lse[bi], ref_out[bi], ref_lse[bi], v * (1 / (1 - realised)), dtype)
    refs = attention_ref_backward(doh, qh, kh, vh, out=_host(out), with_magnitudes=True, **ref_kw)
    scale = 1 / math.sqrt(d) if c["softmax_scale"] is None else c["softmax_scale"]
    _check_grads(grads, refs, dtype, abs(scale) / (1 - realised), d, doh, qh, kh, vh)
    return dict(zip(OUTPUTS, (out, lse, *grads)), v=v)


def run_varlen_dropout_case(c):
    """Varlen forward and backward of dropout case ``c`` (varlen_dropout_cases' keys) against the float64 reference,
    sequence by sequence: sequence b drops what batch entry b of a padded call with the same seed and offset drops
    (fa2cupy.dropout_mask's rows and columns counted from the sequence's start); asserts the rows planned
    (_expected_rows). Returns a dict of OUTPUTS, each cut to the rows that belong to a sequence (lse: its
    columns)."""
    from fa2cupy.forward import realised_dropout_p

    fa = fa2cupy_module()
    cp = _cupy()
    x, cu_q, cu_k, slopes = _varlen_inputs(c)
    batch, h, d, dtype, p = len(c["lengths_q"]), c["nheads"], c["headdim"], c["dtype"], c["dropout_p"]
    max_q, max_k = max(c["lengths_q"]) + c["slack"], max(c["lengths_k"]) + c["slack"]
    kw = dict(causal=c["causal"], window_size=c["window_size"], softcap=c["softcap"], alibi_slopes=slopes,
              dropout_p=p)
    cu_qd, cu_kd = cp.asarray(cu_q), cp.asarray(cu_k)
    with _on_hopper(), recorded_forward_plans() as fwd_plans, recorded_backward_plans() as bwd_plans:
        out, lse, _ = fa.flash_attn_varlen_func(x["q"], x["k"], x["v"], cu_qd, cu_kd, max_q, max_k,
                                                return_attn_probs=True, **kw, **_rng(c))
        grads = fa.flash_attn_varlen_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, cu_qd, cu_kd, max_q, max_k,
                                              deterministic=c["deterministic"], **kw, **_rng(c))
    if sum(c["lengths_q"]) and sum(c["lengths_k"]):
        fwd_row, bwd_row = _expected_rows(d, varlen=True)
        _assert_rows(fwd_plans, fwd_row, configs.FwdConfig)
        _assert_rows(bwd_plans, bwd_row, configs.BwdConfig)

    mask = cp.asnumpy(fa.dropout_mask(batch, h, max(max_q, 1), max(max_k, 1), p, c["dropout_seed"],
                                      c["dropout_offset"]))
    realised = realised_dropout_p(p)
    slopes_h = None if slopes is None else cp.asnumpy(slopes)
    qh, kh, vh, doh, oh = (_host(a) for a in (x["q"], x["k"], x["v"], x["dout"], out))
    ref_out, ref_lse = np.zeros(oh.shape), np.full(lse.shape, np.inf)
    refs = [np.zeros(qh.shape), np.zeros(kh.shape), np.zeros(vh.shape)]
    mags = [np.zeros(qh.shape), np.zeros(kh.shape), np.zeros(vh.shape)]
    for bi in range(batch):
        qs, ks = slice(int(cu_q[bi]), int(cu_q[bi + 1])), slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        lq, lk = qs.stop - qs.start, ks.stop - ks.start
        if lq == 0 or lk == 0:
            continue  # no queries, or no keys: out 0, lse +inf, zero gradients
        seq_kw = dict(causal=c["causal"], window_size=c["window_size"], softcap=c["softcap"], dropout_p=realised,
                      alibi_slopes=None if slopes_h is None else slopes_h if slopes_h.ndim == 1
                      else slopes_h[bi : bi + 1], dropout_mask=mask[bi : bi + 1, :, :lq, :lk])
        o, l = attention_ref(qh[None, qs], kh[None, ks], vh[None, ks], **seq_kw)
        ref_out[qs], ref_lse[:, qs] = o[0], l[0]
        g = attention_ref_backward(doh[None, qs], qh[None, qs], kh[None, ks], vh[None, ks], out=oh[None, qs],
                                   with_magnitudes=True, **seq_kw)
        for i, rows in enumerate((qs, ks, ks)):
            refs[i][rows], mags[i][rows] = g[i][0], g[3][i][0]
    rows_q, rows_k = np.arange(int(cu_q[-1])), np.arange(int(cu_k[-1]))
    _check_out(out, lse, ref_out, ref_lse, x["v"] * (1 / (1 - realised)), dtype, rows=rows_q)
    _check_grads(grads, (*refs, tuple(mags)), dtype, 1 / math.sqrt(d) / (1 - realised), d, doh[rows_q], qh[rows_q],
                 kh[rows_k], vh[rows_k], selections=(rows_q, rows_k, rows_k))
    for g, end in zip(grads, (cu_q[-1], cu_k[-1], cu_k[-1])):  # rows past every sequence: exactly zero
        assert np.all(_host(g)[int(end):] == 0.0)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    return dict(zip(OUTPUTS, (out[:tq], lse[:, :tq], grads[0][:tq], grads[1][:tk], grads[2][:tk])))


@settings(max_examples=EXAMPLES, deadline=None)
@given(dropout_cases())
def test_padded_dropout_matches_reference(c):
    """Padded dropout calls (softcap and ALiBi too, any mask, GQA, negative scales) on the rows _expected_rows
    names, against the reference with fa2cupy.dropout_mask's mask (run_dropout_case)."""
    note(repr(c))
    run_dropout_case(c)


@settings(max_examples=EXAMPLES, deadline=None)
@given(varlen_dropout_cases())
def test_varlen_dropout_matches_reference(c):
    """Varlen dropout calls (empty and one-row sequences, rows past the last one, max_seqlen above the longest),
    sequence by sequence against the reference (run_varlen_dropout_case)."""
    note(repr(c))
    run_varlen_dropout_case(c)


# ------------------------------------------------------------------------------------------ seed and offset


def _fixed_case(d, **changes):
    """A causal GQA padded case on the Hopper rows at head dim ``d`` (sq < sk: no row without keys), these keys
    changed."""
    c = dict(batch=2, seqlen_q=257, seqlen_k=300, nheads=4, nheads_kv=2, headdim=d, causal=True,
             window_size=(-1, -1), softcap=0.0, alibi=None, dtype="float16", softmax_scale=None, deterministic=True,
             dropout_p=0.3, dropout_seed=2**63 + d, dropout_offset=2**35 + 3, rng_state=False, seed=d)
    c.update(changes)
    return c


@pytest.mark.parametrize("d", [128, 256])
def test_rng_state_gives_the_bits_of_the_int_seed_and_offset(d):
    """Seed and offset read from a device uint32 (4,) array (dropout_rng_state): forward and backward on the Hopper
    rows give the same bits as the same values given as ints (a window and ALiBi too), each against the
    reference."""
    c = _fixed_case(d, window_size=(90, 20), alibi="heads")
    first, again = run_dropout_case(c), run_dropout_case(dict(c, rng_state=True))
    for name in OUTPUTS:
        _same_bits(name, first[name], again[name])


def test_rng_state_gives_the_bits_of_the_int_seed_and_offset_varlen():
    """As above for a varlen call at d = 192 (the Hopper forward's and backward's varlen modifier rows), with a
    softcap, empty and one-row sequences, rows past the last one."""
    c = dict(lengths_q=[130, 0, 1, 257], lengths_k=[200, 3, 1, 257], nheads=4, nheads_kv=2, headdim=192, causal=True,
             window_size=(-1, -1), softcap=3.0, alibi=None, extra_rows=5, slack=9, dtype="bfloat16",
             deterministic=True, dropout_p=0.1, dropout_seed=12345, dropout_offset=2**40 + 7, rng_state=False,
             seed=192)
    first, again = run_varlen_dropout_case(c), run_varlen_dropout_case(dict(c, rng_state=True))
    for name in OUTPUTS:
        _same_bits(name, first[name], again[name])


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_dropout_over_many_items(d):
    """Padded dropout on the Hopper rows with more work items than an H200 has SMs (so that each persistent block
    takes several), items whose rows see no key (causal, 360 more queries than keys) and a last query tile whose
    second warpgroup has no rows (1060 = 8 x 128 + 36), against the reference."""
    run_dropout_case(_fixed_case(d, batch=2, seqlen_q=1060, seqlen_k=700, nheads=8, nheads_kv=4))


@pytest.mark.parametrize("d", [128, 256])
def test_hopper_rows_drop_what_the_mma_sync_kernels_drop(d):
    """The same seed and offset: the Hopper rows give the same bits call after call (deterministic backward), and
    the mma.sync kernels (KernelOptions(hopper_forward=False, hopper_backward=False)) the same output and lse to a
    few roundings and gradients within the reference's bounds (run_dropout_case), as both draw fa2cupy.dropout_mask's
    mask; another offset moves the output by far more than those roundings."""
    from fa2cupy.forward import realised_dropout_p

    cp = _cupy()
    c = _fixed_case(d)
    hopper, again = run_dropout_case(c), run_dropout_case(c)
    for name in OUTPUTS:
        _same_bits(name, hopper[name], again[name])
    with kernel_options(hopper_forward=False, hopper_backward=False):
        mma = run_dropout_case(c, rows=(None, None))
    tol = 8 * UNIT_ROUNDOFF[c["dtype"]] * float(cp.abs(hopper["v"].astype(cp.float32)).max()) / (
        1 - realised_dropout_p(c["dropout_p"])) + 1e-6

    def diff(a, b):
        return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())

    assert diff(hopper["out"], mma["out"]) <= tol, "the Hopper and mma.sync outputs differ by more than roundings"
    assert diff(hopper["lse"], mma["lse"]) <= 1e-4 * (1 + float(cp.abs(mma["lse"]).max()))
    other = run_dropout_case(dict(c, dropout_offset=c["dropout_offset"] + 1))
    assert diff(other["out"], mma["out"]) > 4 * tol, "another offset left the output as it was"
