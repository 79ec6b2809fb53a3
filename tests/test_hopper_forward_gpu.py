"""The Hopper forward (cuda/hopper/fwd.cu) on a GPU of compute capability 9.0: it is the kernel the library picks
there, it matches the float64 reference on every mask, grouping, length and stride pattern it takes, padded and
varlen, and the mma.sync forward it replaces for those calls still matches the reference on the same GPU.

Bounds and the NaN poisoning of outputs are those of test_forward_gpu (check_against_reference).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from fa2cupy import configs
from fa2cupy.options import KernelOptions
from fa2cupy.reference import attention_ref
from gpu_helpers import (cupy_module as _cupy, debug_poison, fa2cupy_module, kernel_options, recorded_forward_plans,
                         skip_unless_hopper)
from test_forward_gpu import run_case
# (imported here, not inside a Hypothesis test: importing it applies @given, which Hypothesis refuses while a test
# runs, as a nested @given)
from test_varlen_mods_gpu import _check_out, _check_padded, _host, _randn, _slopes

pytestmark = pytest.mark.gpu


def _hopper_gpu():
    skip_unless_hopper("forward")


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


def _kernel(hopper: bool, **options):
    """Runs the calls inside on the Hopper kernel (True: whatever the length of a masked call) or on the mma.sync
    forward (False), with these other KernelOptions fields."""
    return kernel_options(hopper_forward=hopper, hopper_masked_min_seqlen=0, **options)


def test_hopper_kernel_is_the_one():
    _hopper_gpu()
    from fa2cupy import configs, forward

    strides = ((64 * 8 * 128, 8 * 128, 128, 1),) * 4
    plan = forward.plan_forward((1, 64, 8, 128), (1, 64, 8, 128), strides, "bfloat16", 0.1, False, 90)
    assert isinstance(plan.config, configs.HopperFwdConfig)
    assert plan.launch.block == (384, 1, 1) and plan.launch.grid[1:] == (1, 1)
    plan = forward.plan_forward((1, 64, 8, 128), (1, 64, 8, 128), strides, "bfloat16", 0.1, True, 90)
    assert isinstance(plan.config, configs.FwdConfig)  # a short causal call: the mma.sync kernel is faster there
    strides = ((2048 * 8 * 128, 8 * 128, 128, 1),) * 4
    plan = forward.plan_forward((1, 2048, 8, 128), (1, 2048, 8, 128), strides, "bfloat16", 0.1, True, 90)
    assert isinstance(plan.config, configs.HopperFwdConfig)
    plan = forward.plan_forward((1, 64, 8, 96), (1, 64, 8, 96), strides, "bfloat16", 0.1, True, 90)
    assert isinstance(plan.config, configs.FwdConfig)  # no Hopper row for d = 96
    plan = forward.plan_forward((1, 2048, 8, 128), (1, 2048, 8, 128), strides, "bfloat16", 0.1, True, 90,
                                dropout_p=0.1)
    assert isinstance(plan.config, configs.HopperFwdConfig)  # dropout on the Hopper kernel's modifier rows
    plan = forward.plan_forward((1, 2048, 8, 128), (1, 2048, 8, 128), strides, "bfloat16", 0.1, True, 90,
                                softcap=5.0)
    assert isinstance(plan.config, configs.HopperFwdConfig)  # softcap (and ALiBi) on the Hopper kernel
    plan = forward.plan_forward((1, 64, 8, 128), (1, 64, 8, 128), strides, "bfloat16", 0.1, True, 90,
                                options=KernelOptions(hopper_masked_min_seqlen=0))
    assert isinstance(plan.config, configs.HopperFwdConfig)  # a short causal call, when the options say so
    plan = forward.plan_forward((1, 64, 8, 128), (1, 64, 8, 128), strides, "bfloat16", 0.1, False, 90,
                                options=KernelOptions(hopper_forward=False))
    assert isinstance(plan.config, configs.FwdConfig)


def test_arrays_tma_cannot_copy_run_the_mma_sync_forward():
    """Padded calls move their tiles with tensor maps, which take no negative strides: such a call is planned on
    the mma.sync forward, and its answer matches the reference (reversed rows of q, k, v and out alike)."""
    _hopper_gpu()
    cp = _cupy()
    from fa2cupy import configs, forward
    from test_forward_gpu import check_against_reference

    strides = ((64 * 8 * 128, 8 * 128, 128, 1),) * 4
    plan = forward.plan_forward((1, 64, 8, 128), (1, 64, 8, 128), strides, "bfloat16", 0.1, False, 90)
    assert isinstance(plan.config, configs.HopperFwdConfig) and plan.tensor_maps is not None
    reversed_rows = ((64 * 8 * 128, -8 * 128, 128, 1),) * 4
    plan = forward.plan_forward((1, 64, 8, 128), (1, 64, 8, 128), reversed_rows, "bfloat16", 0.1, False, 90)
    assert isinstance(plan.config, configs.FwdConfig) and plan.tensor_maps is None

    fa2cupy = fa2cupy_module()
    rng = np.random.default_rng(7)
    q, k, v = (cp.asarray(rng.standard_normal((2, 300, 4, 128)), dtype=cp.float16)[:, ::-1] for _ in range(3))
    out = fa2cupy.flash_attn_func(q, k, v, causal=True)
    check_against_reference(q, k, v, out, None, None, True, "float16", (-1, -1))


# (work items of 128 query rows at d=128, of 192 at d=64: three consumer warpgroups)
LENGTHS = [1, 2, 17, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 383, 385, 500, 1000, 1025]
GROUPS = [(1, 1), (2, 2), (4, 1), (6, 3), (8, 2), (16, 4)]


@st.composite
def hopper_cases(draw, headdims=(64, 128), lengths=LENGTHS):
    """Forward cases of the Hopper kernel's head dims (the wide rows' with headdims=(192, 256))."""
    nheads, nheads_kv = draw(st.sampled_from(GROUPS))
    return dict(
        batch=draw(st.integers(1, 3)),
        seqlen_q=draw(st.sampled_from(lengths)),
        seqlen_k=draw(st.sampled_from(lengths)),
        nheads=nheads,
        nheads_kv=nheads_kv,
        headdim=draw(st.sampled_from(headdims)),
        causal=draw(st.booleans()),
        window_size=draw(st.one_of(st.just((-1, -1)),
                                   st.tuples(*[st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, 600))] * 2))),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.01, 1.5))),
        transposed=draw(st.booleans()),
        return_lse=True,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@given(hopper_cases(), st.booleans())
def test_both_forward_kernels_match_reference_on_hopper(case, hopper):
    _hopper_gpu()
    note(repr(case))
    with _kernel(hopper):
        run_case(case)


@pytest.mark.parametrize("hopper", [True, False])
@pytest.mark.parametrize(
    "b,sq,sk,h,hkv,d,causal,window",
    [
        (4, 2000, 2000, 8, 2, 128, True, (-1, -1)),  # 512 work items: every block walks several, longest first
        (4, 2000, 2000, 8, 8, 64, False, (-1, -1)),
        (1, 3000, 3000, 4, 4, 128, True, (1000, 0)),  # a band: warpgroups pass over tiles the other computes
        (2, 700, 300, 4, 1, 64, True, (-1, -1)),  # sq > sk: rows and whole query tiles with no key
        (1, 129, 4000, 2, 2, 128, False, (50, 50)),  # a narrow band over long keys
        (1, 1, 1, 1, 1, 64, False, (-1, -1)),  # one item, one row
        (2, 1000, 1000, 4, 2, 64, False, (600, 0)),  # a band at d=64: three warpgroups, the third passing over
        (1, 450, 450, 2, 2, 64, True, (-1, -1)),  # a ragged last item with no rows for its third warpgroup
    ],
)
def test_fixed_hopper_cases(hopper, b, sq, sk, h, hkv, d, causal, window):
    _hopper_gpu()
    with _kernel(hopper):
        for dtype in ("float16", "bfloat16"):
            run_case(dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hkv, headdim=d, causal=causal,
                          window_size=window, dtype=dtype, softmax_scale=None, transposed=False, return_lse=True,
                          seed=sq + sk + d))


@st.composite
def varlen_hopper_cases(draw):
    batch = draw(st.integers(1, 5))
    lengths = st.sampled_from([0, 1, 17, 64, 127, 128, 129, 300, 700])
    lq = draw(st.lists(lengths, min_size=batch, max_size=batch))
    lk = lq if draw(st.booleans()) else draw(st.lists(lengths, min_size=batch, max_size=batch))
    h, hkv = draw(st.sampled_from(GROUPS))
    return dict(lengths_q=lq, lengths_k=lk, nheads=h, nheads_kv=hkv, headdim=draw(st.sampled_from([64, 128])),
                causal=draw(st.booleans()),
                window_size=draw(st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 200), st.integers(-1, 200)))),
                slack=draw(st.sampled_from([0, 9])),  # max_seqlen above the longest sequence
                dtype=draw(st.sampled_from(["float16", "bfloat16"])), seed=draw(st.integers(0, 2**32 - 1)))


@given(varlen_hopper_cases(), st.booleans())
def test_varlen_matches_reference_on_both_kernels(c, hopper):
    _hopper_gpu()
    note(repr(c))
    from fa2cupy.reference import attention_ref_varlen
    from gpu_helpers import cu_seqlens

    fa2cupy = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(c["seed"])
    cu_q, cu_k = cu_seqlens(c["lengths_q"]), cu_seqlens(c["lengths_k"])
    tq, tk = max(int(cu_q[-1]), 1), max(int(cu_k[-1]), 1)
    h, hkv, d, dtype = c["nheads"], c["nheads_kv"], c["headdim"], c["dtype"]
    q, k, v = (_randn(rng, shape, dtype) for shape in ((tq, h, d), (tk, hkv, d), (tk, hkv, d)))
    kw = dict(causal=c["causal"], window_size=c["window_size"])
    with _kernel(hopper):
        out, lse, _ = fa2cupy.flash_attn_varlen_func(q, k, v, cp.asarray(cu_q), cp.asarray(cu_k),
                                                     max(c["lengths_q"]) + c["slack"],
                                                     max(c["lengths_k"]) + c["slack"], return_attn_probs=True, **kw)
    ref_out, ref_lse = attention_ref_varlen(_host(q), _host(k), _host(v), cu_q, cu_k, **kw)
    _check_out(out, lse, ref_out, ref_lse, v, dtype, rows=np.arange(int(cu_q[-1])))


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_varlen_keeps_another_sequence_out(d):
    """Whole K/V tiles of a varlen call go by TMA and a sequence's last, ragged tile by zero-filling copies (a slab
    at a time above 128 columns): an infinite or NaN row of the next sequence never reaches this one's output (P = 0
    there, and 0 * inf is NaN). Head dims 192 and 256: the wide rows."""
    _hopper_gpu()
    from fa2cupy.reference import attention_ref

    fa2cupy = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(5)
    lengths = (200, 300)  # the first sequence ends inside a key tile (128 or 64 keys), the second's rows follow
    q, k, v = (_randn(rng, (sum(lengths), 4, d), "bfloat16") for _ in range(3))
    k[lengths[0]:] = float("inf")
    v[lengths[0]:] = float("nan")
    cu = cp.asarray(np.cumsum((0,) + lengths), dtype=cp.int32)
    with _kernel(True):
        out = fa2cupy.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    first = slice(0, lengths[0])
    ref = attention_ref(*(_host(x[first])[None] for x in (q, k, v)), causal=True)[0][0]
    got = _host(out[first])
    assert np.isfinite(got).all(), "the next sequence's inf / NaN rows reached this one's output"
    tol = 4 * 2.0 ** -8 * float(np.abs(_host(v[first])).max()) + 1e-6
    assert float(np.abs(got - ref).max()) <= tol


@pytest.mark.parametrize("sms", [3, None])
@pytest.mark.parametrize(
    "b,s,h,hkv,d,causal,window,group_bytes,tail_waves",
    [
        # (more work items than the H100's 132 SMs in each, so that the real GPU takes the counter too; the last
        # group's heads, configs.hopper_tail_heads, at 132 blocks / at 3)
        (3, 1000, 6, 3, 128, True, (-1, -1), 1, 0),  # groups of one kv head's 2 query heads (9 groups of 2)
        (3, 1000, 6, 3, 128, True, (-1, -1), 1, None),  # the same, the last group all 18 heads / 2
        (3, 2000, 5, 5, 64, True, (-1, -1), 3 * 2000 * 64 * 4, 1),  # groups of 3 heads, the last 12 / 3
        (3, 2000, 5, 5, 64, True, (-1, -1), 3 * 2000 * 64 * 4, 20),  # the last group 15 / 6
        (2, 1500, 8, 2, 128, False, (300, 0), 16 << 20, None),  # a band, all 16 heads in one group
        (3, 2200, 4, 4, 64, True, (40, 7), 1, None),
    ],
)
def test_tile_counter_matches_grid_stride_bitwise(sms, b, s, h, hkv, d, causal, window, group_bytes, tail_waves):
    """Blocks that take masked work items from the tile counter (longest first within L2 groups, and a last group
    of its own size) compute each item exactly as blocks walking the grid stride do: the same bits, and the float64
    reference's answer."""
    _hopper_gpu()
    from test_forward_gpu import check_against_reference, make_input

    fa2cupy = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(s + h + d)
    q, k, v = (make_input(rng, (b, s, n, d), "bfloat16") for n in (h, hkv, hkv))
    results = {}
    for counter in (False, True):
        with _kernel(True, sm_count=sms, tile_counter=counter, hopper_l2_group_bytes=group_bytes,
                     hopper_tail_waves=tail_waves), \
                recorded_forward_plans() as plans:  # (poisoned calls: planned every time)
            results[counter] = fa2cupy.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                                       return_attn_probs=True)[:2]
        assert [p.tile_counter for p in plans] == [counter]
    for stride_part, counter_part in zip(*results.values()):
        assert cp.array_equal(stride_part, counter_part)
    out, lse = results[True]
    check_against_reference(q, k, v, out, lse, None, causal, "bfloat16", window_size=window)


def test_tile_counter_under_torch_cuda_graph():
    """A CUDA graph captures the counter's zeroing with the launch: every replay hands out all work items."""
    _hopper_gpu()
    torch = pytest.importorskip("torch")
    from fa2cupy import pipeline
    from test_forward_gpu import check_against_reference

    fa2cupy = fa2cupy_module()
    cp = _cupy()
    dev = torch.device("cuda", torch.cuda.current_device())
    shape = (2, 2048, 8, 128)  # 256 causal work items: more than the SMs, so the plan takes the counter
    static = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    pipeline.forget_plans()  # (so that the warm-up call plans, and the plan it makes can be looked at)
    with _kernel(True), debug_poison(False), recorded_forward_plans() as plans:  # (the fast path, as users run it)
        with torch.cuda.stream(side):  # warm-up outside capture: compile and plan
            fa2cupy.flash_attn_func(*static, causal=True)
        assert [p.tile_counter for p in plans] == [True]
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fa2cupy.flash_attn_func(*static, causal=True)
        for _ in range(2):
            fresh = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(3)]
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check_against_reference(*(cp.from_dlpack(t) for t in fresh), cp.from_dlpack(out), None, None, True,
                                    "bfloat16")


@pytest.mark.parametrize("sms", [3, None])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (200, 0))])
def test_tile_counter_matches_grid_stride_varlen(sms, causal, window):
    """Varlen with the tile counter: items past a sequence's end (here most of the short sequences') are passed
    over by the producer alone, and every real item is computed as under the grid stride."""
    _hopper_gpu()
    from fa2cupy.reference import attention_ref_varlen
    from gpu_helpers import cu_seqlens

    fa2cupy = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(7)
    lengths = [1500, 0, 1, 130, 700, 2100, 64, 900]
    cu = cp.asarray(cu_seqlens(lengths))
    total = sum(lengths)
    q, k, v = (_randn(rng, (total, n, 64), "bfloat16") for n in (8, 2, 2))
    results = {}
    for counter in (False, True):
        with _kernel(True, sm_count=sms, tile_counter=counter), recorded_forward_plans() as plans:
            results[counter] = fa2cupy.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                              causal=causal, window_size=window,
                                                              return_attn_probs=True)[:2]
        assert [p.tile_counter for p in plans] == [counter]
    for stride_part, counter_part in zip(*results.values()):  # (every row belongs to a sequence)
        assert cp.array_equal(stride_part, counter_part)
    ref_out, ref_lse = attention_ref_varlen(_host(q), _host(k), _host(v), cu_seqlens(lengths), cu_seqlens(lengths),
                                            causal=causal, window_size=window)
    _check_out(*results[True], ref_out, ref_lse, v, "bfloat16")



@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("mod", ["none", "softcap", "alibi"])
@pytest.mark.parametrize("causal", [False, True])
def test_climbing_row_maxima(d, mod, causal):
    """Keys whose scores spread more and more along the sequence (scale 4 / sqrt(d)): each row's max climbs over
    many tiles, by less and by more than the 2^8 the forward lets P run up to before it rescales the output
    (OnlineSoftmax::probabilities_lazy), on the Hopper forward, against the float64 reference (output and lse)."""
    _hopper_gpu()
    if mod != "none" and not configs.hopper_takes_mods(d, varlen=False):
        pytest.skip(f"modifiers run on the mma.sync forward at d = {d}")
    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(d * 10 + causal)
    b, sq, sk, h = 1, 192, 1100, 2
    q, k, v = (_randn(rng, (b, n, h, d), "bfloat16") for n in (sq, sk, sk))
    ramp = cp.asarray(np.linspace(0.25, 4.0, sk, dtype=np.float32))[None, :, None, None]
    k = (k.astype(cp.float32) * ramp).astype(k.dtype)
    slopes = _slopes(rng, b, h, False) if mod == "alibi" else None
    kw = dict(softmax_scale=4 / d ** 0.5, causal=causal, softcap=50.0 if mod == "softcap" else 0.0)
    with _kernel(True), recorded_forward_plans() as plans:
        out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, alibi_slopes=slopes, **kw)
    assert plans and all(isinstance(p.config, configs.HopperFwdConfig) for p in plans)
    ref_out, ref_lse = attention_ref(_host(q), _host(k), _host(v),
                                     alibi_slopes=None if slopes is None else _host(slopes), **kw)
    _check_padded(out, lse, ref_out, ref_lse, v, "bfloat16")


@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [100, 320])
def test_alibi_far_from_the_diagonal(d, causal, seqlen_q):
    """ALiBi on keys up to 2.6k from the diagonal and on both sides of it, with slopes up to 1: the part of the bias
    constant along a row, which the Hopper forward leaves to the softmax on tiles that lie on one side of the
    diagonal (UnitScoreMods::apply, RowBias), reaches thousands where the scores themselves are a few units; every tile
    kind (one-sided either way, crossing) in one call, against the float64 reference (output and lse)."""
    _hopper_gpu()
    if not configs.hopper_takes_mods(d, varlen=False):
        pytest.skip(f"modifiers run on the mma.sync forward at d = {d}")
    fa = fa2cupy_module()
    cp = _cupy()
    rng = np.random.default_rng(d + 7 * causal + seqlen_q)
    # causal: keys 2.6k long, the diagonal at their end (every tile on its left); non-causal: 2.6k queries whose
    # diagonal runs from far left of the keys into them (tiles on either side, and crossing it)
    sq, sk = (seqlen_q, 2600) if causal else (2600, 4 * seqlen_q)
    q, k, v = (_randn(rng, (1, n, 3, d), "bfloat16") for n in (sq, sk, sk))
    slopes = cp.asarray(np.array([1.0, 0.05, 0.002], np.float32))
    kw = dict(causal=causal)
    with _kernel(True), recorded_forward_plans() as plans:
        out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, alibi_slopes=slopes, **kw)
    assert plans and all(isinstance(p.config, configs.HopperFwdConfig) for p in plans)
    ref_out, ref_lse = attention_ref(_host(q), _host(k), _host(v), alibi_slopes=_host(slopes), **kw)
    _check_padded(out, lse, ref_out, ref_lse, v, "bfloat16")
