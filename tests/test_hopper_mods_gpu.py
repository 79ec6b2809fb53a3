"""Softcap and ALiBi on the Hopper forward (HopperFwdTraits' Mods: the scores turned into UnitScoreMods' values before
the mask, the softmax scaled by their unit) on a GPU of compute capability 9.0, at the head dims of
configs.HOPPER_MODS_HEADDIMS (padded calls only at HOPPER_MODS_PADDED_ONLY): the calls must plan the Hopper kernel
there (with dropout too; the other head dims and varlen calls at the padded-only ones stay on the mma.sync forward),
and match the float64 reference, padded and varlen, forward and backward (the backward recomputes P from the Hopper
forward's lse, so a forward lse in other units fails it), with outputs poisoned before each launch. Both forwards
take the softcap's tanh as fast_tanh (common/math.cuh), the Hopper one in UnitScoreMods' units: the Hopper forward
with a softcap must also agree with the mma.sync forward to a few bf16 roundings. (Dropout's checks:
test_hopper_dropout_gpu.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from fa2cupy import configs
from fa2cupy.configs import FORWARD_HOPPER_TABLE, HOPPER_MODS_HEADDIMS
from gpu_helpers import (UNIT_ROUNDOFF, cupy_module as _cupy, debug_poison, fa2cupy_module,
                         kernel_options, np_dtype, recorded_forward_plans, skip_unless_hopper)
# (imported here, not inside a Hypothesis test: importing applies @given, which Hypothesis refuses while a test runs)
from test_paged_varlen_gpu import paged_case_arrays, paged_equals_packed
from test_hopper_backward_gpu import varlen_hopper_cases
from test_varlen_mods_gpu import _randn, _slopes, mod_cases, run_mods_case, run_varlen_case

pytestmark = pytest.mark.gpu

HOPPER_DIMS = list(HOPPER_MODS_HEADDIMS)
VARLEN_DIMS = [d for d in HOPPER_MODS_HEADDIMS if configs.hopper_takes_mods(d, varlen=True)]
LENGTHS = [1, 17, 63, 64, 65, 128, 129, 200, 300]


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


def _on_hopper():
    """The calls inside on the Hopper forward whatever the length of a masked call (modifier calls are masked:
    the window variant)."""
    skip_unless_hopper("forward")
    return kernel_options(hopper_masked_min_seqlen=0)


def _assert_hopper(plans):
    assert plans and all(isinstance(p.config, configs.HopperFwdConfig) for p in plans), [p.config for p in plans]


@pytest.mark.parametrize("d", sorted(FORWARD_HOPPER_TABLE))
def test_modifier_calls_plan_the_hopper_forward(d):
    skip_unless_hopper("forward")
    from fa2cupy import forward

    strides = ((2048 * 8 * d, 8 * d, d, 1),) * 4
    shape = (1, 2048, 8, d)
    expected = configs.hopper_forward_row(d, mods=True) if d in HOPPER_MODS_HEADDIMS else None
    for causal in (False, True):
        for mods in ({"softcap": 30.0}, {"alibi_batch_stride": 0}):
            plan = forward.plan_forward(shape, shape, strides, "bfloat16", 0.1, causal, 90, **mods)
            assert plan.config is expected if expected else isinstance(plan.config, configs.FwdConfig)
        plan = forward.plan_forward(shape, shape, strides, "bfloat16", 0.1, causal, 90, softcap=30.0, dropout_p=0.1)
        assert plan.config is expected if expected else isinstance(plan.config, configs.FwdConfig)  # (dropout too)
    if expected:
        # without a mask: the unmasked modifier kernel, or with hopper_unmasked_mods=False (or with dropout) the
        # window one (softcap: ALiBi alone runs the ALiBi-only kernel, below)
        from fa2cupy import KernelOptions, build

        for unmasked, dropout_p, mask in ((True, 0.0, "none"), (False, 0.0, "window"), (True, 0.1, "window")):
            plan = forward.plan_forward(shape, shape, strides, "bfloat16", 0.1, False, 90, softcap=30.0,
                                        dropout_p=dropout_p, options=KernelOptions(hopper_unmasked_mods=unmasked))
            assert plan.launch.function is build.get_kernel(
                "fwd_hopper", expected.name_expression("bfloat16", mask, True), expected.smem_bytes), (unmasked, mask)
        # ALiBi alone at a positive scale, without a mask or causal: the ALiBi-only kernel; with softcap too, at
        # scale 0 or with hopper_alibi_only=False the modifier kernel
        for causal in (False, True):
            mask = "causal" if causal else "none"
            for kw, alibi_only in (({}, True), (dict(options=KernelOptions(hopper_alibi_only=False)), False),
                                   (dict(softcap=30.0), False), (dict(softmax_scale=0.0), False)):
                scale = kw.pop("softmax_scale", 0.1)
                plan = forward.plan_forward(shape, shape, strides, "bfloat16", scale, causal, 90,
                                            alibi_batch_stride=0, **kw)
                assert plan.launch.function is build.get_kernel(
                    "fwd_hopper", expected.name_expression("bfloat16", mask, True, alibi_only=alibi_only),
                    expected.smem_bytes), (causal, kw)
    # varlen: the Hopper forward except at the padded-only head dims
    varlen_strides = ((0, 8 * d, d, 1),) * 4
    plan = forward.plan_forward(shape, shape, varlen_strides, "bfloat16", 0.1, True, 90, softcap=30.0,
                                varlen_totals=(2048, 2048))
    assert plan.config is configs.hopper_forward_row(d, mods=True) if configs.hopper_takes_mods(d, varlen=True) else (
        isinstance(plan.config, configs.FwdConfig))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HOPPER_DIMS)
def test_alibi_only_kernel_matches_modifier_kernel_and_reference(d, causal, dtype):
    """ALiBi alone runs the ALiBi-only kernel (HopperFwdTraits::kAlibiOnly), whose arithmetic is the modifier
    kernel's: the same bits as that kernel (hopper_alibi_only=False) and the float64 reference, with per-batch
    slopes, ragged tiles and more keys than queries (the causal diagonal bottom-right)."""
    from fa2cupy import build
    from fa2cupy.reference import attention_ref
    from test_varlen_mods_gpu import _check_padded, _host

    fa = fa2cupy_module()
    rng = np.random.default_rng()
    b, sq, sk, h = 2, 130, 300, 4
    q, k, v = (_randn(rng, (b, n, h, d), dtype) for n in (sq, sk, sk))
    slopes = _slopes(rng, b, h, per_batch=True)
    kw = dict(causal=causal, alibi_slopes=slopes)
    results = {}
    for alibi_only in (True, False):
        with _on_hopper(), kernel_options(hopper_alibi_only=alibi_only), recorded_forward_plans() as plans:
            out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        row = configs.hopper_forward_row(d, mods=True)
        name = row.name_expression(dtype, "causal" if causal else "none", True, alibi_only=alibi_only)
        assert [p.launch.function for p in plans] == [build.get_kernel("fwd_hopper", name, row.smem_bytes)]
        results[alibi_only] = (out, lse)
    (out, lse), (general_out, general_lse) = results[True], results[False]
    np.testing.assert_array_equal(_host(out), _host(general_out))
    np.testing.assert_array_equal(_host(lse), _host(general_lse))
    ref_out, ref_lse = attention_ref(*(_host(x) for x in (q, k, v)), causal=causal,
                                     alibi_slopes=_cupy().asnumpy(slopes))
    _check_padded(out, lse, ref_out, ref_lse, v, dtype)


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("d", HOPPER_DIMS)
def test_softcap_fixed_max_matches_reference(d, mask):
    """bf16 softcap calls without ALiBi and softcap <= 50 take P against a fixed reference max of 0 (from d = 128:
    HopperFwdTraits::kCapFixedMax): against the float64 reference with the logits pushed to both ends of the cap
    (q scaled up), at softcap 50 (the largest such), 3 and 51 (the running max), with rows that see no key (more
    queries than keys under the causal mask; a window that leaves some rows none) and ragged tiles (tiles without a
    mask take the tanh and P in one pass, the others in two)."""
    from fa2cupy.reference import attention_ref
    from test_varlen_mods_gpu import _check_padded, _host

    fa = fa2cupy_module()
    rng = np.random.default_rng()
    b, sq, sk, h = 2, 300, 190, 4
    q = _cupy().asarray((rng.standard_normal((b, sq, h, d), dtype=np.float32) * 8).astype(np_dtype("bfloat16")))
    k, v = (_randn(rng, (b, sk, h, d), "bfloat16") for _ in range(2))
    kw = dict(causal=mask == "causal", window_size=(3, 0) if mask == "window" else (-1, -1))
    for cap in (50.0, 3.0, 51.0):
        with _on_hopper(), recorded_forward_plans() as plans:
            out, lse, _ = fa.flash_attn_func(q, k, v, softcap=cap, return_attn_probs=True, **kw)
        _assert_hopper(plans)
        ref_out, ref_lse = attention_ref(*(_host(x) for x in (q, k, v)), softcap=cap, **kw)
        assert np.isinf(ref_lse).any() or mask == "none"  # rows without a visible key are in the test
        _check_padded(out, lse, ref_out, ref_lse, v, "bfloat16")


@settings(deadline=None)
@given(mod_cases(headdims=HOPPER_DIMS, lengths=LENGTHS))
def test_padded_modifiers_match_reference(c):
    note(repr(c))
    if c["softcap"] == 0.0 and c["alibi"] is None:
        c["softcap"] = 2.0  # this test is about the modifiers
    with _on_hopper(), recorded_forward_plans() as plans:
        run_mods_case(c)
    _assert_hopper(plans)


@settings(deadline=None)
@given(varlen_hopper_cases(headdims=VARLEN_DIMS, lengths=[0] + LENGTHS, mods=True))
def test_varlen_modifiers_match_reference(c):
    note(repr(c))
    with _on_hopper(), recorded_forward_plans() as plans:
        run_varlen_case(c)
    if sum(c["lengths_q"]) and sum(c["lengths_k"]):
        _assert_hopper(plans)


@pytest.mark.parametrize("d", VARLEN_DIMS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_modifiers_equal_packed(d, page_size):
    """Paged K/V with softcap and ALiBi: the same bits as packed K/V on the same (Hopper) kernel."""
    fa2cupy = fa2cupy_module()
    lengths_q, lengths_k = [70, 1, 0, 130], [200, 17, 5, 129]
    arrays = paged_case_arrays(dict(lengths_q=lengths_q, lengths_k=lengths_k, page_size=page_size, nheads=4,
                                    nheads_kv=2, headdim=d, alibi=True, dtype="bfloat16", seed=d + page_size))
    with _on_hopper(), recorded_forward_plans() as plans:
        paged_equals_packed(fa2cupy, arrays, 130, 200, sum(lengths_q), causal=True, softcap=20.0,
                            alibi_slopes=arrays[-1])
    _assert_hopper(plans)


@settings(deadline=None)
@given(st.sampled_from(HOPPER_DIMS), st.sampled_from(["float16", "bfloat16"]), st.booleans(),
       st.integers(0, 2**32 - 1))
def test_hopper_modifiers_agree_with_the_mma_sync_forward(d, dtype, alibi, seed):
    """The Hopper forward against the mma.sync forward on one causal GQA call with a softcap (and ALiBi)."""
    skip_unless_hopper("forward")
    fa2cupy = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(seed)
    q, k, v = (_randn(rng, (2, 333, n, d), dtype) for n in (4, 2, 2))
    slopes = _slopes(rng, 2, 4, True) if alibi else None
    kw = dict(causal=True, softcap=30.0, alibi_slopes=slopes, return_attn_probs=True)
    with _on_hopper():
        out, lse, _ = fa2cupy.flash_attn_func(q, k, v, **kw)
    with kernel_options(hopper_forward=False):
        ref, ref_lse, _ = fa2cupy.flash_attn_func(q, k, v, **kw)
    tol = 8 * UNIT_ROUNDOFF[dtype] * float(cp.abs(v.astype(cp.float32)).max()) + 1e-6
    assert float(cp.abs(out.astype(cp.float32) - ref.astype(cp.float32)).max()) <= tol
    assert float(cp.abs(lse - ref_lse).max()) <= 1e-4 * (1 + float(cp.abs(ref_lse).max()))
