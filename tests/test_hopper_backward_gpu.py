"""The Hopper backward (cuda/hopper/bwd.cu's dK/dV kernel) on a GPU of compute capability 9.0: it is the kernel the
library plans there for padded and varlen calls without modifiers at head dims 64 and 128 (192 and 256:
test_hopper_backward_wide_gpu.py; softcap and ALiBi: test_hopper_backward_mods_gpu.py; dropout:
test_hopper_dropout_gpu.py), deterministic or not (dQ added in turns, bitwise repeatable), its gradients match the
float64 reference on every mask, grouping, length and layout it takes, and the mma.sync backward it replaces for
those calls still matches the reference on the same GPU.

Bounds, references and the NaN poisoning of dq/dk/dv are test_backward_gpu's (check_gradients, run_case).
"""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from gpu_helpers import cupy_module, debug_poison, fa2cupy_module, kernel_options, skip_unless_hopper
from test_backward_gpu import run_case
from test_varlen_mods_gpu import run_varlen_case

pytestmark = pytest.mark.gpu


def _hopper_gpu():
    skip_unless_hopper("backward")


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


def _kernel(hopper: bool):
    """Runs the calls inside with the Hopper dK/dV kernel (True) or the mma.sync one (False) where the Hopper
    kernel would be picked."""
    return kernel_options(hopper_backward=hopper)


def test_hopper_kernel_is_the_one_planned():
    _hopper_gpu()
    from fa2cupy import backward, configs

    names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
    strides = dict.fromkeys(names, (256 * 8 * 128, 8 * 128, 128, 1))
    plan = backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), strides, "bfloat16", 0.1, True, False, 90)
    assert isinstance(plan.config, configs.HopperBwdConfig)
    assert plan.main.block == (384, 1, 1) and plan.main.grid == (2, 8, 1)
    # (causal: the dK/dV kernel counts each dQ tile's additions for the early conversion, 1 x 8 x 4 counts)
    assert plan.convert is not None and plan.dq is None and plan.convert_counted and plan.dq_semaphores == 1 * 8 * 4
    plan = backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), strides, "bfloat16", 0.1, False, False, 90)
    assert plan.convert is not None and not plan.convert_counted and plan.dq_semaphores == 0
    # deterministic=True: the same kernel, its dQ additions in turns over 1 x 8 x 4 flags (no dQ kernel of its own)
    plan = backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), strides, "bfloat16", 0.1, True, True, 90)
    assert isinstance(plan.config, configs.HopperBwdConfig) and plan.dq is None and plan.convert is not None
    assert plan.dq_semaphores == 1 * 8 * 4 and plan.main.per_call[-1] == "dq_semaphore"
    plan = backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), strides, "bfloat16", 0.1, True, False, 90,
                                  softcap=5.0)
    assert isinstance(plan.config, configs.HopperBwdConfig)  # the modifier rows
    plan = backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), strides, "bfloat16", 0.1, True, False, 90,
                                  softcap=5.0, dropout_p=0.1)
    assert isinstance(plan.config, configs.HopperBwdConfig)  # dropout: the modifier rows too
    plan = backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), strides, "bfloat16", 0.1, True, False, 90,
                                  varlen_totals=(256, 256))
    assert isinstance(plan.config, configs.HopperBwdConfig) and plan.zero_tail is not None
    strides = dict.fromkeys(names, (256 * 8 * 64, 8 * 64, 64, 1))
    plan = backward.plan_backward((1, 256, 8, 64), (1, 256, 8, 64), strides, "bfloat16", 0.1, True, False, 90)
    assert isinstance(plan.config, configs.HopperBwdConfig) and plan.config.dq_by_keys
    strides = dict.fromkeys(names, (256 * 8 * 96, 8 * 96, 96, 1))
    plan = backward.plan_backward((1, 256, 8, 96), (1, 256, 8, 96), strides, "bfloat16", 0.1, True, False, 90)
    assert isinstance(plan.config, configs.BwdConfig)  # no Hopper row for d = 96


def test_arrays_tma_cannot_copy_run_the_mma_sync_backward():
    """Calls move their tiles with tensor maps (varlen calls their whole tiles), which take no negative strides:
    such a call is planned on the mma.sync backward, and its gradients match the reference."""
    _hopper_gpu()
    import numpy as np

    from fa2cupy import backward, configs
    from gpu_helpers import cupy_module
    from test_backward_gpu import check_gradients

    fa2cupy = fa2cupy_module()

    names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
    strides = dict.fromkeys(names, (256 * 8 * 128, 8 * 128, 128, 1))
    plan = backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), strides, "bfloat16", 0.1, True, False, 90)
    assert isinstance(plan.config, configs.HopperBwdConfig) and plan.tensor_maps is not None
    plan = backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), strides, "bfloat16", 0.1, True, False, 90,
                                  varlen_totals=(256, 256))
    assert isinstance(plan.config, configs.HopperBwdConfig) and plan.tensor_maps is not None
    reversed_rows = dict(strides, q=(256 * 8 * 128, -8 * 128, 128, 1))
    plan = backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), reversed_rows, "bfloat16", 0.1, True, False,
                                  90)
    assert isinstance(plan.config, configs.BwdConfig)

    cp = cupy_module()
    rng = np.random.default_rng(11)
    q, k, v, dout = (cp.asarray(rng.standard_normal((2, 300, 4, 128)), dtype=cp.float16)[:, ::-1] for _ in range(4))
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    grads = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    check_gradients(dout, q, k, v, out, grads, None, True, "float16")


@pytest.mark.parametrize("d", [64, 128])
def test_preprocess_clears_the_padded_accumulator_rows(d):
    """bwd_preprocess gives D = rowsum(dO * O) and clears every float of the Hopper kernel's dQ accumulator rows, their
    pad (d + 8 floats a row, never read) included: a 32-byte sector left partly unwritten costs the L2 a DRAM read
    before its write-back (docs/design.md)."""
    _hopper_gpu()
    import cupy
    import numpy as np

    from fa2cupy import backward

    shape = (2, 201, 3, d)  # a ragged last block of rows
    rng = cupy.random.default_rng(7)
    dout, out = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(2))
    strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), tuple(s // 2 for s in out.strides))
    plan = backward.plan_backward(shape, shape, strides, "float16", d**-0.5, True, False, 90)
    assert plan.dq_accum_shape == (2, 3, 201, d + 8)
    dsum = cupy.full(plan.dsum_shape, float("nan"), cupy.float32)
    accum = cupy.full(plan.dq_accum_shape, float("nan"), cupy.float32)
    plan.preprocess(cupy.cuda.get_current_stream().ptr, (dout.data.ptr, out.data.ptr, dsum.data.ptr, accum.data.ptr, 0))
    expected = (dout.astype(cupy.float64) * out.astype(cupy.float64)).sum(-1).transpose(0, 2, 1)
    np.testing.assert_allclose(cupy.asnumpy(dsum).reshape(2, 3, 201), cupy.asnumpy(expected), rtol=1e-5, atol=1e-4)
    assert bool((accum == 0).all()), "the accumulator rows (pad included) are not all cleared"


LENGTHS = [1, 2, 17, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 500, 700]
GROUPS = [(1, 1), (2, 2), (4, 1), (6, 3), (8, 2), (4, 4)]


@st.composite
def hopper_cases(draw, headdims=(64, 128), lengths=LENGTHS):
    """Backward cases of the Hopper kernel's head dims (the wide rows' with headdims=(192, 256))."""
    nheads, nheads_kv = draw(st.sampled_from(GROUPS))
    return dict(
        batch=draw(st.integers(1, 2)),
        seqlen_q=draw(st.sampled_from(lengths)),
        seqlen_k=draw(st.sampled_from(lengths)),
        nheads=nheads,
        nheads_kv=nheads_kv,
        headdim=draw(st.sampled_from(headdims)),
        causal=draw(st.booleans()),
        window_size=draw(st.one_of(st.just((-1, -1)),
                                   st.tuples(*[st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, 400))] * 2))),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.01, 1.5))),
        deterministic=draw(st.booleans()),  # (True: bitwise repeats, run_case)
        transposed=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@given(hopper_cases(), st.booleans())
def test_both_backward_kernels_match_reference_on_hopper(case, hopper):
    _hopper_gpu()
    note(repr(case))
    with _kernel(hopper):
        run_case(case)


@pytest.mark.parametrize("hopper", [True, False])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(
    "b,sq,sk,h,hkv,causal,window",
    [
        (2, 1000, 1000, 4, 2, True, (-1, -1)),  # many query tiles per key block, GQA sums over two heads
        (1, 1000, 1000, 4, 4, False, (-1, -1)),
        (1, 700, 300, 4, 1, True, (-1, -1)),  # sq > sk: rows with no key, MQA
        (1, 300, 700, 2, 2, True, (-1, -1)),  # sq < sk: key blocks that no query sees (dK = dV = 0)
        (1, 129, 1500, 2, 1, False, (50, 50)),  # a narrow band over long keys
        (1, 1, 1, 1, 1, False, (-1, -1)),  # one key: dq = dk = 0
    ],
)
def test_fixed_hopper_cases(hopper, d, b, sq, sk, h, hkv, causal, window):
    _hopper_gpu()
    with _kernel(hopper):
        for dtype in ("float16", "bfloat16"):
            run_case(dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hkv, headdim=d, causal=causal,
                          window_size=window, dtype=dtype, softmax_scale=None, deterministic=False, transposed=False,
                          seed=sq + sk + h))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_launch_order_chunks(d, causal):
    """The dK/dV grid launches in chunks of (kv head, batch) groups, key tile by key tile within a chunk
    (KernelOptions.hopper_bwd_chunk_blocks). One group a chunk, chunks of two groups with a short last one, and
    the default all compute every block's dK/dV: gradients match the reference and dK/dV are bitwise the same
    whatever the order (each block writes its own key tile)."""
    _hopper_gpu()
    case = dict(batch=3, seqlen_q=300, seqlen_k=300, nheads=2, nheads_kv=1, headdim=d, causal=causal,
                window_size=(-1, -1), dtype="bfloat16", softmax_scale=None, deterministic=False, transposed=False,
                seed=d + causal)
    grads = {}
    for chunk_blocks in (0, 6, None):  # (6: two groups of 3 or 5 key tiles a chunk, the last chunk one group)
        with kernel_options(hopper_bwd_chunk_blocks=chunk_blocks):
            grads[chunk_blocks] = run_case(case, repeat=False)[1]
    for chunk_blocks in (6, None):
        for name, x, y in zip("kv", grads[0][1:], grads[chunk_blocks][1:]):
            assert (x == y).all(), f"d{name} differs between launch orders 0 and {chunk_blocks}"


@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize(
    "b,sq,sk,h,hkv,causal,window",
    [
        (2, 1000, 1000, 4, 2, True, (-1, -1)),  # GQA, many key tiles adding to each query tile
        (1, 700, 900, 2, 2, False, (-1, -1)),  # no mask: every key tile adds to every query tile
        (2, 1000, 1000, 4, 2, False, (-1, -1)),  # no mask, GQA: walks rotated (each block from its own query tile)
        (1, 1100, 450, 2, 1, False, (-1, -1)),  # rotated, more query tiles than key tiles, ragged ends
        (1, 900, 500, 2, 1, True, (-1, -1)),  # sq > sk: rows that see no key
        (1, 800, 800, 2, 1, False, (150, 40)),  # a band: the turns counted from its first key tile
    ],
)
def test_deterministic_hopper_backward(d, b, sq, sk, h, hkv, causal, window):
    """deterministic=True on the Hopper dK/dV kernel: the key tiles that add to a query tile's dQ take turns, so the
    gradients match the reference and two runs agree bitwise (run_case)."""
    _hopper_gpu()
    run_case(dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hkv, headdim=d, causal=causal,
                  window_size=window, dtype="bfloat16", softmax_scale=None, deterministic=True, transposed=False,
                  seed=sq + sk + d))


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_deterministic_walks_rotate_without_a_mask(d):
    """deterministic=True without a mask: where a (kv head, batch) group's blocks fit on half the SMs, each block
    walks the query tiles from a start of its own (configs.hopper_bwd_rotates), so dQ's sum runs in another order
    than with the walks all from the first tile (an sm_count too small for the group): both match the reference and
    repeat bitwise, and they differ in dQ's last bits (the rotated order ran)."""
    _hopper_gpu()
    cp = cupy_module()
    fa = fa2cupy_module()
    import numpy as np

    from test_backward_gpu import check_gradients, make_input

    rng = np.random.default_rng(d)
    q, dout = (make_input(rng, (2, 1500, 4, d), "bfloat16") for _ in range(2))
    k, v = (make_input(rng, (2, 1200, 2, d), "bfloat16") for _ in range(2))
    out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True)
    from fa2cupy import configs

    key_tiles = -(-1200 // configs.BACKWARD_HOPPER_TABLE[d].block_n)
    runs = {}
    for sms in (132, 2 * key_tiles - 1):  # (rotated; a group more than half the SMs: not)
        with kernel_options(sm_count=sms):
            runs[sms] = [fa.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True) for _ in range(2)]
        check_gradients(dout, q, k, v, out, runs[sms][0], None, False, "bfloat16")
        for name, x, y in zip("qkv", *runs[sms]):
            assert cp.array_equal(x.view(cp.uint16), y.view(cp.uint16)), f"d{name} differs between two runs"
    rotated, straight = runs[132][0], runs[2 * key_tiles - 1][0]
    assert not cp.array_equal(rotated[0].view(cp.uint16), straight[0].view(cp.uint16)), "dQ summed in one order"


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_walks_rotate_in_calls_that_are_not_deterministic(d):
    """Calls without a mask that are not deterministic walk rotated (hopper_bwd_rotate: by default at these head
    dims without modifiers), with no turns to wait for, so however many blocks a group has (sm_count 3), with dQ
    converted early or after the kernel; and straight (False): every gradient matches the reference, and causal
    calls, which never rotate, under the same options."""
    _hopper_gpu()
    fa = fa2cupy_module()
    import numpy as np

    from test_backward_gpu import check_gradients, make_input

    rng = np.random.default_rng(d + 7)
    q, dout = (make_input(rng, (2, 1500, 4, d), "bfloat16") for _ in range(2))
    k, v = (make_input(rng, (2, 1200, 2, d), "bfloat16") for _ in range(2))
    for causal in (False, True):
        out, lse, _ = fa.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        ref = None
        for rotate, early, sms in ((True, False, None), (True, True, None), (True, False, 3), (False, False, None)):
            with kernel_options(hopper_bwd_rotate=rotate, hopper_bwd_early_convert=early, sm_count=sms,
                                debug_poison=True):
                grads = fa.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
            try:
                ref = check_gradients(dout, q, k, v, out, grads, None, causal, "bfloat16", ref=ref)[0]
            except AssertionError as e:
                raise AssertionError(f"causal={causal} rotate={rotate} early={early} sm_count={sms}: {e}") from e


@pytest.mark.parametrize("d", [64, 192])
@pytest.mark.parametrize(
    "sq,sk,causal,window",
    [(1500, 1200, False, (-1, -1)), (900, 500, True, (-1, -1)), (1000, 1000, False, (200, 30))],
)
def test_early_conversion_converts_each_tile_once_complete(d, sq, sk, causal, window):
    """hopper_bwd_early_convert: the conversion takes each dQ tile once the dK/dV kernel's count of its additions is
    complete (rows that see no key zero, under the NaN poisoning of dq), where the other waits for the whole kernel.
    Deterministic, the two give the same bits; not, both match the reference."""
    _hopper_gpu()
    cp = cupy_module()
    fa = fa2cupy_module()
    import numpy as np

    from test_backward_gpu import check_gradients, make_input

    rng = np.random.default_rng(sq + d)
    q, dout = (make_input(rng, (2, sq, 4, d), "bfloat16") for _ in range(2))
    k, v = (make_input(rng, (2, sk, 2, d), "bfloat16") for _ in range(2))
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    runs, ref = {}, None
    for early in (True, False):
        with kernel_options(hopper_bwd_early_convert=early, debug_poison=True):
            for deterministic in (True, False):
                runs[early, deterministic] = fa.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                                    window_size=window, deterministic=deterministic)
                ref = check_gradients(dout, q, k, v, out, runs[early, deterministic], None, causal, "bfloat16",
                                      ref=ref, window_size=window)[0]
    for name, x, y in zip("qkv", runs[True, True], runs[False, True]):
        assert cp.array_equal(x.view(cp.uint16), y.view(cp.uint16)), f"d{name} differs with the early conversion"


@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (192, False)])
def test_early_conversion_varlen(d, causal):
    """The early conversion in a varlen call with a sequence of keys but no query rows (its dK/dV blocks walk no
    step, its conversion blocks wait for no count), one of query rows but no keys (rows zero, waiting for nothing)
    and a one-row one: gradients match the reference converting early and late, deterministic or not, and
    deterministic runs give the same bits both ways."""
    _hopper_gpu()
    cp = cupy_module()
    fa = fa2cupy_module()
    from test_varlen_mods_gpu import _varlen_inputs

    case = dict(lengths_q=[300, 0, 1, 700, 129], lengths_k=[500, 3, 1, 700, 0], nheads=4, nheads_kv=2, headdim=d,
                causal=causal, window_size=(-1, -1), softcap=0.0, alibi=None, extra_rows=5, slack=9,
                dtype="bfloat16", deterministic=False, seed=d)
    x, cu_q, cu_k, _ = _varlen_inputs(case)
    cu_q, cu_k = cp.asarray(cu_q), cp.asarray(cu_k)
    out, lse, _ = fa.flash_attn_varlen_func(x["q"], x["k"], x["v"], cu_q, cu_k, 709, 709, causal=causal,
                                            return_attn_probs=True)
    runs = {}
    for early in (True, False):
        with kernel_options(hopper_bwd_early_convert=early, debug_poison=True):
            for deterministic in (False, True):
                run_varlen_case(dict(case, deterministic=deterministic))
            runs[early] = fa.flash_attn_varlen_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, cu_q, cu_k, 709,
                                                        709, causal=causal, deterministic=True)
    for name, a, b in zip("qkv", runs[True], runs[False]):
        assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)), f"d{name} differs with the early conversion"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 256])
def test_deterministic_hopper_backward_varlen(d, causal):
    """The turns per sequence of a varlen call (empty and one-row sequences, ragged ends; without a mask, walks
    rotated in the sequences with as many query tiles as key tiles or more): gradients match the reference and
    repeat bitwise."""
    _hopper_gpu()
    cp = cupy_module()
    fa = fa2cupy_module()
    case = dict(lengths_q=[300, 0, 1, 700], lengths_k=[500, 3, 1, 700], nheads=4, nheads_kv=2, headdim=d,
                causal=causal, window_size=(-1, -1), softcap=0.0, alibi=None, extra_rows=5, slack=9,
                dtype="bfloat16", deterministic=True, seed=d)
    run_varlen_case(case)
    from test_varlen_mods_gpu import _varlen_inputs

    x, cu_q, cu_k, _ = _varlen_inputs(case)
    cu_q, cu_k = cp.asarray(cu_q), cp.asarray(cu_k)
    out, lse, _ = fa.flash_attn_varlen_func(x["q"], x["k"], x["v"], cu_q, cu_k, 709, 709, causal=causal,
                                            return_attn_probs=True)
    runs = [fa.flash_attn_varlen_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, cu_q, cu_k, 709, 709,
                                          causal=causal, deterministic=True) for _ in range(3)]
    for name, *gs in zip("qkv", *runs):
        for g in gs[1:]:
            assert cp.array_equal(gs[0].view(cp.uint16), g.view(cp.uint16)), f"d{name} differs between runs"


@st.composite
def varlen_hopper_cases(draw, headdims=(64, 128), lengths=(0, 1, 17, 64, 127, 128, 129, 300, 500), mods=False):
    """A varlen case (test_varlen_mods_gpu.run_varlen_case's keys); with ``mods``, softcap or ALiBi or both."""
    batch = draw(st.integers(1, 4))
    lengths = st.sampled_from(lengths)
    lq = draw(st.lists(lengths, min_size=batch, max_size=batch))
    lk = lq if draw(st.booleans()) else draw(st.lists(lengths, min_size=batch, max_size=batch))
    h, hkv = draw(st.sampled_from(GROUPS))
    softcap, alibi = 0.0, None
    if mods:
        softcap, alibi = draw(st.sampled_from([0.0, 3.0, 30.0])), draw(st.sampled_from([None, "heads", "batch"]))
        softcap = 2.0 if softcap == 0.0 and alibi is None else softcap
    return dict(lengths_q=lq, lengths_k=lk, nheads=h, nheads_kv=hkv, headdim=draw(st.sampled_from(headdims)),
                causal=draw(st.booleans()),
                window_size=draw(st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 200), st.integers(-1, 200)))),
                softcap=softcap, alibi=alibi,
                extra_rows=draw(st.sampled_from([0, 5])),  # rows past cu_seqlens[-1], which nothing may read
                slack=draw(st.sampled_from([0, 9])),  # max_seqlen above the longest sequence
                dtype=draw(st.sampled_from(["float16", "bfloat16"])), deterministic=draw(st.booleans()),
                seed=draw(st.integers(0, 2**32 - 1)))


@given(varlen_hopper_cases(), st.booleans())
def test_both_backward_kernels_match_reference_on_hopper_varlen(case, hopper):
    _hopper_gpu()
    note(repr(case))
    with _kernel(hopper):
        run_varlen_case(case)


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_varlen_keeps_another_sequence_out(d):
    """Whole tiles of a varlen backward go by TMA and a sequence's last, ragged K/V block and query step by
    zero-filling copies (a slab at a time above 128 columns): infinite or NaN rows of the next sequence never reach
    this one's gradients. Head dims 192 and 256: the wide rows."""
    _hopper_gpu()
    import numpy as np

    from fa2cupy.reference import attention_ref_backward
    from gpu_helpers import cupy_module
    from test_varlen_mods_gpu import _host, _randn

    fa2cupy = fa2cupy_module()

    cp = cupy_module()
    rng = np.random.default_rng(9)
    lengths = (200, 300)  # the first sequence ends inside a key block (128 or 64 keys) and a query step
    q, k, v, dout = (_randn(rng, (sum(lengths), 4, d), "bfloat16") for _ in range(4))
    cu = cp.asarray(np.cumsum((0,) + lengths), dtype=cp.int32)
    with kernel_options(hopper_backward=True):
        out, lse, _ = fa2cupy.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                                     return_attn_probs=True)
        for x in (q, k, v, dout):
            x[lengths[0]:] = float("nan")
        dq, dk, dv = fa2cupy.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, max(lengths),
                                                        max(lengths), causal=True)
    first = slice(0, lengths[0])
    ref = attention_ref_backward(*(_host(x[first])[None] for x in (dout, q, k, v)), causal=True)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        got = _host(got[first])
        assert np.isfinite(got).all(), f"{name}: the next sequence's NaN rows reached this one's gradients"
        tol = 0.05 * float(np.abs(want[0]).max()) + 1e-3
        assert float(np.abs(got - want[0]).max()) <= tol, name


# ---------------------------------------------------------------------------------- head dims between the widths


@pytest.mark.parametrize("d, width", [(80, 128), (72, 128), (96, 128), (160, 192), (144, 192), (224, 256),
                                      (40, 64)])
def test_padded_head_dims_run_the_wider_kernels_on_unpadded_arrays(d, width):
    """A head dim without a Hopper row plans the Hopper forward and dK/dV kernel of the next width on the arrays as
    they are (their tensor maps span d columns; the dQ accumulator is the wider kernel's, its whole query tiles added
through a map of d columns), and the results match the
    reference: GQA with several heads a row, so that a column written past d would land in the next head's, with
    poisoned outputs, both masks, deterministic or not, and transposed (strided) inputs. At 72 and 144 the score
    products stop at 80 and 160 (configs.hopper_bwd_score_dim), past the arrays' own columns."""
    _hopper_gpu()
    from fa2cupy import backward, configs, forward

    names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
    strides = dict.fromkeys(names, (300 * 4 * d, 4 * d, d, 1))
    plan = backward.plan_backward((1, 300, 4, d), (1, 300, 4, d), strides, "bfloat16", 0.1, True, False, 90,
                                  width=width)
    assert plan.config is configs.BACKWARD_HOPPER_TABLE[width] and plan.dq_accum_shape == (1, 4, 300, width + 8)
    assert tuple(plan.tensor_maps._arrays[0][1]) == (d, 4, 300, 1)  # (the map spans the array's d columns)
    # (whole query tiles' dQ through a map of the accumulator's d columns, but at 256: its box would pass 256)
    accumulator = plan.tensor_maps._arrays[4]
    assert accumulator is None if width == 256 else tuple(accumulator[1]) == (d, 4 * 300)
    fplan = forward.plan_forward((1, 300, 4, d), (1, 300, 4, d), tuple(strides[n] for n in ("q", "k", "v", "out")),
                                 "bfloat16", 0.1, False, 90, width=width)
    assert fplan.config is configs.FORWARD_HOPPER_TABLE[width]
    for causal, det, transposed in ((True, False, False), (False, True, True), (True, True, False)):
        run_case(dict(batch=2, seqlen_q=333, seqlen_k=290, nheads=6, nheads_kv=2, headdim=d, causal=causal,
                      window_size=(-1, -1), dtype="bfloat16", softmax_scale=None, deterministic=det,
                      transposed=transposed, seed=d + 7 * causal + det))


@pytest.mark.parametrize("d, width", [(80, 128), (72, 128), (96, 128), (160, 192), (144, 192), (224, 256),
                                      (40, 64)])
def test_padded_head_dims_run_varlen_on_unpadded_arrays(d, width):
    """Varlen at a head dim without a Hopper row: the wider kernels on the packed arrays as they are. Their ragged
    tiles (a sequence's last, copied by cp.async) stop at d columns, the rest of the tile zero, and so do the ragged
    output rows; whole tiles go by TMA over maps of d columns. Sequences whose lengths are no multiple of a tile,
    rows past the last one, GQA with several heads a row (a column written past d lands in the next head's), both
    masks, a window with softcap, deterministic or not."""
    _hopper_gpu()
    from fa2cupy import backward, configs, forward

    names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
    strides = dict.fromkeys(names, (0, 4 * d, d, 1))
    plan = backward.plan_backward((3, 300, 4, d), (3, 300, 4, d), strides, "bfloat16", 0.1, True, False, 90,
                                  varlen_totals=(700, 700), width=width)
    assert plan.config is configs.BACKWARD_HOPPER_TABLE[width] and plan.dq_accum_shape == (4, 700, width + 8)
    accumulator = plan.tensor_maps._arrays[4]
    assert accumulator is None if width == 256 else tuple(accumulator[1]) == (d, 4 * 700)
    fplan = forward.plan_forward((3, 300, 4, d), (3, 300, 4, d), tuple(strides[n] for n in ("q", "k", "v", "out")),
                                 "bfloat16", 0.1, False, 90, varlen_totals=(700, 700), width=width)
    assert fplan.config is configs.FORWARD_HOPPER_TABLE[width]
    for causal, window, softcap, det in ((True, (-1, -1), 0.0, False), (False, (-1, -1), 0.0, True),
                                         (False, (70, 20), 3.0, False)):
        run_varlen_case(dict(lengths_q=[77, 300, 129], lengths_k=[77, 250, 200], nheads=6, nheads_kv=2, headdim=d,
                             causal=causal, window_size=window, softcap=softcap, alibi=None, extra_rows=5, slack=3,
                             dtype="bfloat16", deterministic=det, seed=d + 7 * causal + det))
