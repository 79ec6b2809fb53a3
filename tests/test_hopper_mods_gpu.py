"""Softcap and ALiBi on the Hopper forward (HopperFwdTraits' Mods: the scores turned into final logits before the mask,
the softmax on them with scale 1) on a GPU of compute capability 9.0, at the head dims of
configs.HOPPER_MODS_HEADDIMS: the calls must plan the Hopper kernel there (dropout stays on the mma.sync forward, as
do the other head dims), and match the
float64 reference, padded and varlen, forward and backward (the backward, on the mma.sync kernels, recomputes
P from the Hopper forward's lse, so a forward lse in other units fails it), with outputs poisoned before each
launch. The softcap's tanh is fast_tanh (common/math.cuh) there, tanhf in the mma.sync kernels: the Hopper forward
with a softcap must also agree with the mma.sync forward to a few bf16 roundings.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from fa2cupy.configs import FORWARD_HOPPER_TABLE, HOPPER_MODS_HEADDIMS
from gpu_helpers import (UNIT_ROUNDOFF, cu_seqlens, cupy_module as _cupy, debug_poison, fa2cupy_module,
                         kernel_options, recorded_forward_plans, skip_unless_hopper)
# (imported here, not inside a Hypothesis test: importing applies @given, which Hypothesis refuses while a test runs)
from test_paged_varlen_gpu import _randn as _randn_host, paged_layout
from test_varlen_mods_gpu import _host, _randn, _slopes, run_mods_case, run_varlen_case

pytestmark = pytest.mark.gpu

HOPPER_DIMS = list(HOPPER_MODS_HEADDIMS)
LENGTHS = [1, 17, 63, 64, 65, 128, 129, 200, 300]
GROUPS = [(1, 1), (2, 2), (4, 1), (6, 3)]


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
    from fa2cupy import configs

    assert plans and all(isinstance(p.config, configs.HopperFwdConfig) for p in plans), [p.config for p in plans]


@pytest.mark.parametrize("d", sorted(FORWARD_HOPPER_TABLE))
def test_modifier_calls_plan_the_hopper_forward(d):
    skip_unless_hopper("forward")
    from fa2cupy import configs, forward

    strides = ((2048 * 8 * d, 8 * d, d, 1),) * 4
    shape = (1, 2048, 8, d)
    expected = configs.FORWARD_HOPPER_TABLE[d] if d in HOPPER_MODS_HEADDIMS else None
    for causal in (False, True):
        for mods in ({"softcap": 30.0}, {"alibi_batch_stride": 0}):
            plan = forward.plan_forward(shape, shape, strides, "bfloat16", 0.1, causal, 90, **mods)
            assert plan.config is expected if expected else isinstance(plan.config, configs.FwdConfig)
        plan = forward.plan_forward(shape, shape, strides, "bfloat16", 0.1, causal, 90, softcap=30.0, dropout_p=0.1)
        assert isinstance(plan.config, configs.FwdConfig)  # dropout: the mma.sync forward


@st.composite
def padded_cases(draw):
    h, hkv = draw(st.sampled_from(GROUPS))
    c = dict(batch=draw(st.integers(1, 2)), seqlen_q=draw(st.sampled_from(LENGTHS)),
             seqlen_k=draw(st.sampled_from(LENGTHS)), nheads=h, nheads_kv=hkv,
             headdim=draw(st.sampled_from(HOPPER_DIMS)), causal=draw(st.booleans()),
             window_size=draw(st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 80), st.integers(-1, 80)))),
             softcap=draw(st.sampled_from([0.0, 1.0, 5.0, 30.0])), alibi=draw(st.sampled_from([None, "heads", "batch"])),
             dtype=draw(st.sampled_from(["float16", "bfloat16"])),
             softmax_scale=draw(st.one_of(st.none(), st.floats(0.05, 1.5), st.floats(-1.0, -0.05))),
             deterministic=False, seed=draw(st.integers(0, 2**32 - 1)))
    if c["softcap"] == 0.0 and c["alibi"] is None:
        c["softcap"] = 2.0
    return c


@settings(deadline=None)
@given(padded_cases())
def test_padded_modifiers_match_reference(c):
    note(repr(c))
    with _on_hopper(), recorded_forward_plans() as plans:
        run_mods_case(c)
    _assert_hopper(plans)


@st.composite
def varlen_cases(draw):
    batch = draw(st.integers(1, 4))
    h, hkv = draw(st.sampled_from(GROUPS))
    lq = draw(st.lists(st.sampled_from([0] + LENGTHS), min_size=batch, max_size=batch))
    lk = lq if draw(st.booleans()) else draw(st.lists(st.sampled_from([0] + LENGTHS), min_size=batch,
                                                      max_size=batch))
    c = dict(lengths_q=lq, lengths_k=lk, nheads=h, nheads_kv=hkv, headdim=draw(st.sampled_from(HOPPER_DIMS)),
             causal=draw(st.booleans()),
             window_size=draw(st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 80), st.integers(-1, 80)))),
             softcap=draw(st.sampled_from([0.0, 3.0, 30.0])), alibi=draw(st.sampled_from([None, "heads", "batch"])),
             extra_rows=draw(st.sampled_from([0, 5])), slack=draw(st.sampled_from([0, 7])),
             dtype=draw(st.sampled_from(["float16", "bfloat16"])), deterministic=False,
             seed=draw(st.integers(0, 2**32 - 1)))
    if c["softcap"] == 0.0 and c["alibi"] is None:
        c["softcap"] = 2.0
    return c


@settings(deadline=None)
@given(varlen_cases())
def test_varlen_modifiers_match_reference(c):
    note(repr(c))
    if max(c["lengths_q"]) + c["slack"] == 0:
        c["lengths_q"][0] = 1
    with _on_hopper(), recorded_forward_plans() as plans:
        run_varlen_case(c)
    if sum(c["lengths_q"]) and sum(c["lengths_k"]):
        _assert_hopper(plans)


@pytest.mark.parametrize("d", HOPPER_DIMS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_modifiers_equal_packed(d, page_size):
    """Paged K/V with softcap and ALiBi: the same bits as packed K/V on the same (Hopper) kernel."""
    fa2cupy = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(d + page_size)
    lengths_q, lengths_k = [70, 1, 0, 130], [200, 17, 5, 129]
    k, v = (_randn_host(rng, (sum(lengths_k), 2, d), "bfloat16") for _ in range(2))
    k_pages, v_pages, table = paged_layout(rng, lengths_k, page_size, k, v)
    q = _randn_host(rng, (sum(lengths_q), 4, d), "bfloat16")
    cu_q, cu_k = cp.asarray(cu_seqlens(lengths_q)), cp.asarray(cu_seqlens(lengths_k))
    q, k, v, k_pages, v_pages, table = (cp.asarray(x) for x in (q, k, v, k_pages, v_pages, table))
    slopes = cp.asarray(rng.random(4, dtype=np.float32) * 0.2)
    kw = dict(causal=True, softcap=20.0, alibi_slopes=slopes, return_attn_probs=True)
    with _on_hopper(), recorded_forward_plans() as plans:
        out_p, lse_p, _ = fa2cupy.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 130, 200,
                                                         block_table=table, **kw)
        out, lse, _ = fa2cupy.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 130, 200, **kw)
    _assert_hopper(plans)
    rows = sum(lengths_q)
    assert not np.isnan(_host(out_p[:rows])).any(), "rows of a sequence were left unwritten"
    assert cp.array_equal(out_p[:rows].view(cp.uint16), out[:rows].view(cp.uint16))
    assert cp.array_equal(lse_p[:, :rows], lse[:, :rows])


@settings(deadline=None)
@given(st.sampled_from(HOPPER_DIMS), st.sampled_from(["float16", "bfloat16"]), st.booleans(),
       st.integers(0, 2**32 - 1))
def test_hopper_modifiers_agree_with_the_mma_sync_forward(d, dtype, alibi, seed):
    """fast_tanh (Hopper) against tanhf (mma.sync) on one causal GQA call with a softcap (and ALiBi)."""
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
