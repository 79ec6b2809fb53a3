"""Softcap and ALiBi on the Hopper backward's modifier rows (HopperBwdTraits' Mods; every head dim, varlen not at
128) on a GPU of compute capability 9.0: they are the rows planned (with dropout too, but at 64; the mma.sync
backward with KernelOptions(hopper_backward_mods=False)), and forward and backward match the float64 reference
across masks, groupings, negative scales and ragged lengths, padded and varlen (dropout:
test_hopper_dropout_gpu.py). (A file of its own: beside the rest of test_hopper_backward_gpu.py it ran past one test
process's time in bench/dev/gpu_tests.sh.)

Bounds, references and the NaN poisoning of dq/dk/dv are test_backward_gpu's and test_varlen_mods_gpu's.
"""

from __future__ import annotations

import pytest
from hypothesis import given, note, settings

from gpu_helpers import debug_poison
from test_hopper_backward_gpu import _hopper_gpu, varlen_hopper_cases
from test_varlen_mods_gpu import mod_cases, run_mods_case, run_varlen_case

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


# ---------------------------------------------------------------------------------- softcap and ALiBi


def test_modifier_rows_are_planned_by_default():
    """Softcap and ALiBi calls plan the Hopper kernel's modifier rows at every head dim (varlen: not at 128), with
    dropout too but at configs.HOPPER_BWD_NO_DROPOUT (64), and the mma.sync backward with
    KernelOptions(hopper_backward_mods=False)."""
    _hopper_gpu()
    from fa2cupy import backward, configs
    from fa2cupy.options import KernelOptions

    off = KernelOptions(hopper_backward_mods=False)
    for d in (64, 128, 192, 256):
        strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (256 * 8 * d, 8 * d, d, 1))
        shape = (1, 256, 8, d)

        def plan(**kw):
            return backward.plan_backward(shape, shape, strides, "bfloat16", 0.1, True, False, 90, **kw)

        assert isinstance(plan(softcap=5.0, options=off).config, configs.BwdConfig)
        assert plan(softcap=5.0).config is configs.BACKWARD_HOPPER_TABLE[d]
        assert plan(alibi_batch_stride=0).config is configs.BACKWARD_HOPPER_TABLE[d]
        dropped = plan(softcap=5.0, dropout_p=0.1).config
        assert (dropped is configs.BACKWARD_HOPPER_TABLE[d] if d != 64 else isinstance(dropped, configs.BwdConfig))
        assert isinstance(plan(softcap=5.0, dropout_p=0.1, options=off).config, configs.BwdConfig)


@settings(max_examples=max(10, settings().max_examples // 4), deadline=None)
@given(mod_cases(headdims=(64, 128, 192, 256)))
def test_modifier_rows_match_reference(c):
    """Padded forward and backward with softcap and/or ALiBi (any mask, GQA, negative scales), the backward on the
    Hopper kernel's modifier rows, against the float64 reference (run_mods_case)."""
    _hopper_gpu()
    if c["softcap"] == 0.0 and c["alibi"] is None:
        c["softcap"] = 2.0
    note(repr(c))
    run_mods_case(c)


@given(varlen_hopper_cases(headdims=(64, 192, 256), mods=True))
def test_modifier_rows_match_reference_varlen(case):
    _hopper_gpu()
    note(repr(case))
    run_varlen_case(case)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_alibi_only_backward_matches_modifier_kernel(d, causal):
    """ALiBi alone runs the dK/dV kernel's ALiBi-only instantiation (HopperBwdTraits' AlibiOnly), whose arithmetic
    is the modifier kernel's: with deterministic=True (dQ added in a fixed order) the same bits as that kernel
    (KernelOptions.hopper_alibi_only=False), which test_modifier_rows_match_reference holds to the float64
    reference; per-batch slopes, ragged tiles, more keys than queries, GQA, fresh inputs and poisoned gradients."""
    _hopper_gpu()
    import numpy as np

    from fa2cupy import build, configs
    from gpu_helpers import fa2cupy_module, kernel_options, recorded_backward_plans
    from test_varlen_mods_gpu import _host, _randn, _slopes

    fa = fa2cupy_module()
    rng = np.random.default_rng()
    dtype = "bfloat16" if d in (128, 256) else "float16"
    b, sq, sk, h, hkv = 2, 130, 200, 4, 2
    q, dout = _randn(rng, (b, sq, h, d), dtype), _randn(rng, (b, sq, h, d), dtype)
    k, v = _randn(rng, (b, sk, hkv, d), dtype), _randn(rng, (b, sk, hkv, d), dtype)
    kw = dict(causal=causal, alibi_slopes=_slopes(rng, b, h, per_batch=True))
    out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    row = configs.BACKWARD_HOPPER_TABLE[d]
    grads = {}
    for alibi_only in (True, False):
        with kernel_options(hopper_alibi_only=alibi_only), recorded_backward_plans() as plans:
            grads[alibi_only] = [_host(g) for g in fa.flash_attn_backward(dout, q, k, v, out, lse,
                                                                           deterministic=True, **kw)]
        name = row.name_expression(dtype, "window", True, True, alibi_only=alibi_only)
        smem = row.smem_bytes(True, True, alibi_only=alibi_only)
        assert len(plans) == 1 and plans[0].main.smem_bytes == smem
        assert plans[0].main.function is build.get_kernel("bwd_hopper", name, smem)
    for new, general in zip(grads[True], grads[False]):
        assert not np.isnan(new).any()
        np.testing.assert_array_equal(new, general)
