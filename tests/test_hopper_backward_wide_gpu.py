"""The Hopper backward at the wide head dims, 192 and 256 (configs.BACKWARD_HOPPER_TABLE's rows), on a GPU of compute
capability 9.0: they must be the kernels planned (the mma.sync backward with KernelOptions(hopper_backward=False)),
and their gradients match the float64 reference on every mask, grouping and ragged length, padded and varlen,
with dq/dk/dv poisoned with NaN before each launch (an element a kernel fails to write shows up).

What these rows do differently from d = 64 and 128 (cuda/hopper/bwd_consumer_wide.cuh), and so what is checked
first here: 64-key blocks (grid over ceil(seqlen_k / 64)), both consumer warpgroups on the same keys, warpgroup 0
computing P^T and dV, warpgroup 1 dP^T, dS^T (with warpgroup 0's P^T handed over in shared memory) and dK; dQ_i by
columns (0-127 and the rest: 64 at d = 192), 64 columns a wgmma at d = 256 varlen; a one-slot Q/dO ring at d = 256;
the varlen loader's slab-at-a-time copies of 64-row K/V tiles.

Bounds, references and the poisoning are test_backward_gpu's (check_gradients, run_case) and test_varlen_mods_gpu's.
"""

from __future__ import annotations

import pytest
from hypothesis import given, note, settings

from gpu_helpers import debug_poison, kernel_options, skip_unless_hopper
from test_backward_gpu import run_case
from test_hopper_backward_gpu import hopper_cases, varlen_hopper_cases
from test_varlen_mods_gpu import run_varlen_case

pytestmark = pytest.mark.gpu

WIDE = [192, 256]


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


def _hopper_gpu():
    skip_unless_hopper("backward")


def _wide():
    """Runs the calls inside on the Hopper dK/dV kernel (whatever a test around them chose)."""
    return kernel_options(hopper_backward=True)


@pytest.mark.parametrize("d", WIDE)
def test_wide_kernel_is_the_one_planned(d):
    _hopper_gpu()
    from fa2cupy import backward, configs
    from fa2cupy.options import KernelOptions

    names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
    strides = dict.fromkeys(names, (300 * 8 * d, 8 * d, d, 1))
    shape = (1, 300, 8, d)
    mma = KernelOptions(hopper_backward=False)
    plan = backward.plan_backward(shape, shape, strides, "bfloat16", 0.1, True, False, 90, options=mma)
    assert isinstance(plan.config, configs.BwdConfig)
    plan = backward.plan_backward(shape, shape, strides, "bfloat16", 0.1, True, False, 90)
    assert plan.config is configs.BACKWARD_HOPPER_TABLE[d]
    assert plan.main.block == (384, 1, 1) and plan.main.grid == (5, 8, 1)  # 64-key blocks
    assert plan.convert is not None and plan.dq is None and plan.dq_accum_shape == (1, 8, 300, d + 8)
    plan = backward.plan_backward(shape, shape, strides, "bfloat16", 0.1, True, True, 90)
    # deterministic: the same kernel, dQ tiles added in a fixed order through turn counters per query tile, one for
    # each half of its rows (two planes), and converted after the whole kernel
    assert plan.config is configs.BACKWARD_HOPPER_TABLE[d] and plan.dq is None and plan.dq_semaphores == 8 * 5 * 2
    assert not plan.convert_counted
    plan = backward.plan_backward(shape, shape, strides, "bfloat16", 0.1, True, False, 90, varlen_totals=(300, 300))
    assert plan.config is configs.BACKWARD_HOPPER_TABLE[d] and plan.zero_tail is not None


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize(
    "b,sq,sk,h,hkv,causal,window",
    [
        (1, 64, 64, 1, 1, False, (-1, -1)),  # one block, one step: the P^T hand-over and dQ_i's column split alone
        (2, 1000, 1000, 4, 2, True, (-1, -1)),  # many steps per block (the ring's phases), GQA sums over two heads
        (1, 1000, 1000, 4, 4, False, (-1, -1)),
        (1, 700, 300, 4, 1, True, (-1, -1)),  # sq > sk: rows with no key, MQA
        (1, 300, 700, 2, 2, True, (-1, -1)),  # sq < sk: key blocks that no query sees (dK = dV = 0)
        (1, 129, 1500, 2, 1, False, (50, 50)),  # a narrow band over long keys
        (1, 201, 77, 2, 2, False, (-1, -1)),  # ragged last query step and key block
        (1, 1, 1, 1, 1, False, (-1, -1)),  # one key: dq = dk = 0
    ],
)
def test_fixed_wide_cases(d, b, sq, sk, h, hkv, causal, window):
    _hopper_gpu()
    with _wide():
        for dtype in ("float16", "bfloat16"):
            run_case(dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hkv, headdim=d, causal=causal,
                          window_size=window, dtype=dtype, softmax_scale=None, deterministic=False, transposed=False,
                          seed=sq + sk + h + d))


LENGTHS = [1, 2, 17, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 500]


@settings(deadline=None)
@given(hopper_cases(headdims=WIDE, lengths=LENGTHS))
def test_wide_backward_matches_reference(case):
    _hopper_gpu()
    note(repr(case))
    with _wide():
        run_case(case)


@settings(deadline=None)
@given(varlen_hopper_cases(headdims=WIDE, lengths=[0, 1, 17, 63, 64, 65, 127, 128, 129, 300]))
def test_wide_varlen_backward_matches_reference(case):
    _hopper_gpu()
    note(repr(case))
    with _wide():
        run_varlen_case(case)


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("softcap, alibi, causal, window, det", [
    (30.0, None, True, (-1, -1), False),  # Gemma 2's softcap
    (0.0, "batch", False, (-1, -1), True),
    (5.0, "heads", False, (90, 30), False),
])
def test_wide_modifier_rows(d, softcap, alibi, causal, window, det):
    """Softcap and ALiBi on the wide rows (warpgroup 0 forms P^T from the modified logits and hands warpgroup 1 P^T
    times the softcap's derivative), padded and varlen, GQA with the query heads a block walks in turn (ALiBi's slope
    is the step's head's), ragged lengths, deterministic or not."""
    from test_varlen_mods_gpu import run_mods_case

    _hopper_gpu()
    run_mods_case(dict(batch=2, seqlen_q=190, seqlen_k=257, nheads=6, nheads_kv=2, headdim=d, causal=causal,
                       window_size=window, softcap=softcap, alibi=alibi, dtype="bfloat16", softmax_scale=None,
                       deterministic=det, seed=d + int(softcap)))
    run_varlen_case(dict(lengths_q=[77, 300, 129], lengths_k=[77, 250, 200], nheads=6, nheads_kv=2, headdim=d,
                         causal=causal, window_size=window, softcap=softcap, alibi=alibi, extra_rows=5, slack=3,
                         dtype="bfloat16", deterministic=det, seed=d + 1 + int(softcap)))
