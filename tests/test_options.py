"""KernelOptions (CPU): checked fields, equality and hashing (they are part of the plan cache's key; that two calls
differing only in their options never share a plan is tests/test_fast_path.py's), and the planners honouring each
field that chooses a forward or backward kernel (device queries and kernel builds stubbed). The decode fields:
tests/test_decode.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fa2cupy import options
from fa2cupy.options import DEFAULT, KernelOptions


def test_defaults_are_the_shipped_choices():
    assert KernelOptions() == DEFAULT and hash(KernelOptions()) == hash(DEFAULT)
    assert DEFAULT.hopper_forward and DEFAULT.hopper_backward and DEFAULT.tile_counter and not DEFAULT.debug_poison
    assert DEFAULT.hopper_masked_min_seqlen is None and DEFAULT.sm_count is None
    assert options.resolve(None) is DEFAULT
    mma = KernelOptions(hopper_forward=False)
    assert options.resolve(mma) is mma and mma != DEFAULT and hash(mma) != hash(DEFAULT)
    assert dataclasses.replace(mma, hopper_forward=True) == DEFAULT
    assert len({DEFAULT, KernelOptions(), mma, KernelOptions(hopper_forward=False)}) == 2


def test_every_field_is_documented():
    doc = KernelOptions.__doc__
    for field in dataclasses.fields(KernelOptions):
        if field.init:
            assert f"{field.name} (" in doc, f"KernelOptions.{field.name} is not described in the docstring"


@pytest.mark.parametrize("changes,error,message", [
    (dict(hopper_forward=1), TypeError, r"^KernelOptions.hopper_forward must be True or False, got 1$"),
    (dict(debug_poison=None), TypeError, r"^KernelOptions.debug_poison must be True or False, got None$"),
    (dict(decode_deep_ring="yes"), TypeError, r"^KernelOptions.decode_deep_ring must be True or False or None"),
    (dict(hopper_masked_min_seqlen=2.0), TypeError, r"^KernelOptions.hopper_masked_min_seqlen must be an int >= 0 "
                                                    r"or None, got 2.0$"),
    (dict(hopper_masked_min_seqlen=-1), ValueError, r"^KernelOptions.hopper_masked_min_seqlen must be an int >= 0"),
    (dict(decode_warp_items_max_tiles=None), TypeError, r"^KernelOptions.decode_warp_items_max_tiles must be an int "
                                                        r">= 0, got None$"),
    (dict(sm_count=True), TypeError, r"^KernelOptions.sm_count must be an int >= 0 or None, got True$"),
])
def test_bad_fields_are_named(changes, error, message):
    with pytest.raises(error, match=message):
        KernelOptions(**changes)


def test_resolve_and_handles():
    with pytest.raises(TypeError, match=r"^kernel_options must be a fa2cupy.KernelOptions or None, got dict$"):
        options.resolve({"hopper_forward": False})
    assert options.handle(None) == options.handle(DEFAULT) == 0
    mma = KernelOptions(hopper_forward=False)
    number = options.handle(mma)
    assert number > 0 and options.handle(KernelOptions(hopper_forward=False)) == number
    assert options.from_handle(number) == mma and options.from_handle(0) is DEFAULT


@pytest.fixture
def planner(monkeypatch):
    """plan_forward and plan_backward with device queries and kernel builds stubbed (a 132-SM GPU)."""
    import cupy

    from fa2cupy import build, device_errors

    class Function:
        ptr = 0

    monkeypatch.setattr(build, "get_kernel", lambda *args: Function())
    monkeypatch.setattr(build, "device_attribute", lambda device, name: {"MultiProcessorCount": 132}[name])
    monkeypatch.setattr(device_errors, "pointers", lambda device: (11, 12))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)


def _forward_plan(seqlen, causal, arch=90, d=128, **fields):
    from fa2cupy import forward

    strides = ((seqlen * 8 * d, 8 * d, d, 1),) * 4
    return forward.plan_forward((2, seqlen, 8, d), (2, seqlen, 8, d), strides, "bfloat16", 0.1, causal, arch,
                                options=KernelOptions(**fields))


def test_forward_planner_honours_the_options(planner):
    from fa2cupy import configs

    assert _forward_plan(2048, False).config.family == "fwd_hopper"
    assert _forward_plan(2048, False, hopper_forward=False).config.family == "fwd"
    assert _forward_plan(2048, False, arch=80).config.family == "fwd"  # (no Hopper kernel there)
    short = configs.HOPPER_MASKED_MIN_SEQLEN[128] - 1
    assert _forward_plan(short, True).config.family == "fwd"  # a short causal call: the mma.sync forward
    assert _forward_plan(short, True, hopper_masked_min_seqlen=0).config.family == "fwd_hopper"
    assert _forward_plan(4096, True, hopper_masked_min_seqlen=8192).config.family == "fwd"
    # The Hopper forward's persistent grid: one block per SM (sm_count pretends another GPU), a tile counter for
    # masked calls with more items than blocks (tile_counter False: the grid stride).
    plan = _forward_plan(2048, True)
    assert plan.launch.grid == (132, 1, 1) and plan.tile_counter
    assert _forward_plan(2048, True, sm_count=3).launch.grid == (3, 1, 1)
    assert not _forward_plan(2048, True, tile_counter=False).tile_counter
    assert not _forward_plan(2048, False).tile_counter  # (no mask: items of one length)
    # The L2 groups of heads (FwdHopperParams.heads_per_group).
    groups = [_forward_plan(2048, True, hopper_l2_group_bytes=n).launch.params.heads_per_group for n in (None, 1)]
    assert groups[0] == configs.hopper_heads_per_group(2048, 128, 1, 16) and groups[1] == 1
    # The last group's heads (FwdHopperParams.tail_heads): 64 query tiles of 16 heads, 4 per L2 group at 8k.
    tails = [_forward_plan(8192, True, hopper_tail_waves=n).launch.params.tail_heads for n in (None, 0, 1, 100)]
    assert configs.FORWARD_HOPPER_TABLE[128].tail_waves == 2 and tails == [8, 4, 4, 16]
    assert _forward_plan(2048, False).launch.params.tail_heads == 1  # (the grid stride: one head a group)


@pytest.mark.parametrize("m_blocks,heads,group,sms,waves,tail", [
    (43, 20, 2, 132, 4, 14),  # 13 heads wanted (528 items), 2 + 6 groups of 2
    (43, 20, 2, 132, 0, 2),  # the last L2 group as it falls
    (43, 21, 2, 132, 0, 1),  # (21 heads: the last group holds the one left)
    (43, 21, 2, 132, 4, 13),
    (64, 32, 4, 132, 1, 4),  # (one wave: the L2 group holds enough)
    (11, 80, 10, 132, 4, 50),  # 48 wanted, 5 groups of 10
    (11, 80, 10, 132, 100, 80),  # at most every head
    (8, 5, 1, 3, 4, 2),
])
def test_hopper_tail_heads(m_blocks, heads, group, sms, waves, tail):
    from fa2cupy import configs

    assert configs.hopper_tail_heads(m_blocks, heads, group, sms, waves) == tail
    assert (heads - tail) % group == 0 and 1 <= tail <= heads


def test_backward_planner_honours_the_options(planner):
    from fa2cupy import backward

    strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (256 * 8 * 128, 8 * 128, 128, 1))

    def family(**fields):
        return backward.plan_backward((1, 256, 8, 128), (1, 256, 8, 128), strides, "bfloat16", 0.1, True, False, 90,
                                      options=KernelOptions(**fields)).config.family

    assert family() == "bwd_hopper" and family(hopper_backward=False) == "bwd"
    assert family(hopper_forward=False) == "bwd_hopper"  # (each field chooses its own kernel)


def test_backward_planner_chunks_the_hopper_grid(planner):
    """hopper_bwd_chunk_blocks: (kv head, batch) groups per chunk of the Hopper dK/dV grid (BwdHopperParams
    .group_chunk), whole groups of at least that many blocks, at most every group."""
    from fa2cupy import backward, configs

    strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (2048 * 8 * 64, 8 * 64, 64, 1))

    def chunk(**fields):
        plan = backward.plan_backward((3, 2048, 8, 64), (3, 2048, 2, 64), strides, "bfloat16", 0.1, True, False, 90,
                                      options=KernelOptions(**fields))
        assert plan.main.grid == (16, 2, 3)  # (16 key tiles of 128, 2 kv heads, batch 3)
        return plan.main.params.group_chunk

    assert chunk() == configs.hopper_bwd_group_chunk(16, 6, 4, "causal") == min(
        6, -(-configs.HOPPER_BWD_CHUNK_BLOCKS // 16))  # (causal GQA: chunks by default)
    assert configs.hopper_bwd_group_chunk(16, 6, 1, "causal") == 1  # (without GQA, or without a causal mask, not)
    assert configs.hopper_bwd_group_chunk(16, 6, 4, "none") == configs.hopper_bwd_group_chunk(16, 6, 4, "window") == 1
    assert chunk(hopper_bwd_chunk_blocks=0) == 1 and chunk(hopper_bwd_chunk_blocks=1) == 1
    assert chunk(hopper_bwd_chunk_blocks=17) == 2 and chunk(hopper_bwd_chunk_blocks=10**6) == 6


@pytest.mark.parametrize("varlen", [False, True])
def test_kinds_plan_at_the_width_choose_picked(planner, monkeypatch, varlen):
    """A head dim between the Hopper widths (96) plans the Hopper forward and dK/dV kernel of the next width (128)
    through each kind's plan, padded and varlen: choose's kernel_width reaches the planners."""
    from fa2cupy import arrays, attention, configs, pipeline

    monkeypatch.setattr(pipeline, "device_of", lambda info: 0)
    # (NumPy stands in for CuPy in adapt: the arrays are at their head dim already)
    monkeypatch.setattr(attention, "kernel_ready", lambda x, headdim, width=None: x)
    monkeypatch.setattr(arrays, "to_cupy", lambda x, info: x)
    monkeypatch.setattr(attention, "contiguous", lambda x, info: x)
    h, d = 4, 96
    if varlen:
        x = {"q": np.ones((9, h, d), np.float16), "k": np.ones((11, 2, d), np.float16),
             "v": np.ones((11, 2, d), np.float16), "dout": np.ones((9, h, d), np.float16),
             "out": np.ones((9, h, d), np.float16), "softmax_lse": np.zeros((h, 9), np.float32),
             "cu_seqlens_q": np.array([0, 4, 9], np.int32), "cu_seqlens_k": np.array([0, 5, 11], np.int32)}
        kinds = ((attention.VARLEN_FORWARD, (5, 6, 0.0, None, False, (-1, -1), 0.0, False, False), (None, 0)),
                 (attention.VARLEN_BACKWARD, (5, 6, None, False, (-1, -1), False, 0.0, 0.0), (1, 0)))
    else:
        x = {"q": np.ones((2, 300, h, d), np.float16), "k": np.ones((2, 300, 2, d), np.float16),
             "v": np.ones((2, 300, 2, d), np.float16), "dout": np.ones((2, 300, h, d), np.float16),
             "out": np.ones((2, 300, h, d), np.float16), "softmax_lse": np.zeros((2, h, 300), np.float32)}
        kinds = ((attention.FORWARD, (0.0, None, False, (-1, -1), 0.0, False, False), (None, 0)),
                 (attention.BACKWARD, (None, False, (-1, -1), False, 0.0, 0.0), (1, 0)))
    for kind, check_options, values in kinds:
        named = {n: x[n] for n in kind.arrays if n in x}
        infos = {n: arrays.describe(a, n) for n, a in named.items()}
        call = kind.check(infos, check_options, values)
        kind.choose(call, infos, 90, DEFAULT)
        assert call.kernel_width == 128
        plan = kind.plan(call, kind.adapt(call, named, infos), 90, 0, DEFAULT)
        table = configs.FORWARD_HOPPER_TABLE if kind in (attention.FORWARD, attention.VARLEN_FORWARD) \
            else configs.BACKWARD_HOPPER_TABLE
        assert plan.config is table[128], (kind, plan.config)


def test_planner_rotates_the_walks_where_they_may(planner):
    """deterministic=True without a mask on the Hopper dK/dV kernel: BwdHopperParams.dq_rotate lets each block walk
    the query tiles from a start of its own (cuda/hopper/bwd_traits.cuh), only where a launch chunk's blocks take
    at most half the SMs (sm_count); calls that are not deterministic rotate whatever the SMs, by default without
    score modifiers or at the wide head dims (hopper_bwd_rotate=True: always); with a mask, or with
    hopper_bwd_rotate=False, never."""
    from fa2cupy import backward, configs

    def rotate(causal=False, deterministic=True, d=64, softcap=0.0, **fields):
        strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (2048 * 8 * d, 8 * d, d, 1))
        plan = backward.plan_backward((3, 2048, 8, d), (3, 2048, 2, d), strides, "bfloat16", 0.1, causal,
                                      deterministic, 90, softcap=softcap, options=KernelOptions(**fields))
        assert plan.main.params.deterministic == deterministic
        assert d != 64 or plan.main.grid[0] == 16
        return plan.main.params.dq_rotate

    assert rotate(sm_count=132) == 1 and rotate(sm_count=32) == 1
    assert rotate(sm_count=31) == 0  # (16 blocks a group: more than half of 31 SMs)
    assert rotate(sm_count=64, hopper_bwd_chunk_blocks=17) == 1  # (two groups a chunk: 32 blocks)
    assert rotate(sm_count=63, hopper_bwd_chunk_blocks=17) == 0
    assert rotate(causal=True, sm_count=132) == 0 and rotate(causal=True, deterministic=False) == 0
    assert rotate(deterministic=False, sm_count=132) == 1 and rotate(deterministic=False, sm_count=3) == 1
    assert rotate(hopper_bwd_rotate=False) == 0 and rotate(deterministic=False, hopper_bwd_rotate=False) == 0
    assert rotate(sm_count=31, hopper_bwd_rotate=True) == 0  # (turns still need the group on the GPU)
    for d, by_default in ((64, 0), (128, 0), (192, 1), (256, 1)):  # (the modifier kernels: the wide ones)
        assert rotate(deterministic=False, d=d, softcap=30.0) == by_default
        assert rotate(deterministic=False, d=d, softcap=30.0, hopper_bwd_rotate=True) == 1
        assert rotate(deterministic=False, d=d) == 1
    assert configs.hopper_bwd_rotates(66, 132) and not configs.hopper_bwd_rotates(67, 132)
    assert configs.hopper_bwd_rotates(500, 132, deterministic=False)
    assert not configs.hopper_bwd_rotates(0, 132)


def test_hopper_backward_counts_each_dq_tile_for_an_early_conversion(planner):
    """hopper_bwd_early_convert: the Hopper dK/dV kernel counts the completed dQ additions of each (batch, head,
    query tile of block_m rows) in ints zeroed per call (the turn flags when deterministic), and the conversion
    takes them as dq_arrivals with the kernel's tile sizes, to convert each tile once its count is complete (True);
    False: counts only when deterministic, and the conversion waits for the whole kernel; None (the default): early
    for masked calls, and unmasked ones from configs.HOPPER_BWD_EARLY_CONVERT_MIN_SEQLEN query rows on, varlen
    calls by their max_seqlen_q as padded ones by their length; not on the wide rows (head dims 192, 256) unless
    asked for."""
    from fa2cupy import backward, configs

    def plan(seqlen, causal, deterministic, early):
        strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (seqlen * 8 * 64, 8 * 64, 64, 1))
        return backward.plan_backward((3, seqlen, 8, 64), (3, seqlen, 2, 64), strides, "bfloat16", 0.1, causal,
                                      deterministic, 90, options=KernelOptions(hopper_bwd_early_convert=early))

    config = configs.BACKWARD_HOPPER_TABLE[64]
    long = configs.HOPPER_BWD_EARLY_CONVERT_MIN_SEQLEN
    assert 4096 < long <= 8192
    for seqlen, causal, default in ((2000, True, True), (2000, False, False), (long, False, True),
                                    (long - 1, False, False)):
        for deterministic in (False, True):
            for early in (True, False, None):
                built = plan(seqlen, causal, deterministic, early)
                counted = default if early is None else early
                assert built.config is config and built.convert_counted == counted
                counts = 3 * 8 * -(-seqlen // config.block_m) if counted or deterministic else 0
                assert built.dq_semaphores == counts
                assert (built.main.per_call[-1] == "dq_semaphore") == (counts > 0)
                assert ("dq_arrivals" in built.convert.per_call) == counted
                assert (built.convert.params.arrival_block_m, built.convert.params.arrival_block_n) == (
                    (config.block_m, config.block_n) if counted else (0, 0))
    # varlen calls as padded ones, by max_seqlen_q (the counts: an int per batch row, head and tile of it)
    strides = dict.fromkeys(("q", "dout", "out", "dq"), (0, 8 * 64, 64, 1))
    strides.update(dict.fromkeys(("k", "v", "dk", "dv"), (0, 2 * 64, 64, 1)))
    for max_q, causal, early, counted in ((2000, True, None, True), (2000, False, None, False),
                                          (long, False, None, True), (2000, False, True, True),
                                          (2000, True, False, False)):
        built = backward.plan_backward((3, max_q, 8, 64), (3, max_q, 2, 64), strides, "bfloat16", 0.1, causal, False,
                                       90, varlen_totals=(5000, 5000),
                                       options=KernelOptions(hopper_bwd_early_convert=early))
        assert built.config is config and built.convert_counted == counted
        assert built.dq_semaphores == (3 * 8 * -(-max_q // config.block_m) if counted else 0)
    # the wide rows convert after the whole kernel unless asked for the early conversion
    for d in (192, 256):
        strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (9000 * 8 * d, 8 * d, d, 1))
        for causal, early in ((True, None), (False, None), (True, False), (False, True)):
            built = backward.plan_backward((1, 9000, 8, d), (1, 9000, 8, d), strides, "bfloat16", 0.1, causal, False,
                                           90, options=KernelOptions(hopper_bwd_early_convert=early))
            wide = configs.BACKWARD_HOPPER_TABLE[d]
            assert built.config is wide and wide.wide and built.convert_counted == bool(early)
            # deterministic: a plane of turn flags per half of the tiles' rows (with or without modifiers; calls
            # with dropout use the first), converted after the whole kernel even when asked for the early conversion
            for softcap, dropout_p in ((0.0, 0.0), (5.0, 0.0), (5.0, 0.1)):
                built = backward.plan_backward((1, 9000, 8, d), (1, 9000, 8, d), strides, "bfloat16", 0.1, causal,
                                               True, 90, softcap=softcap, dropout_p=dropout_p,
                                               options=KernelOptions(hopper_bwd_early_convert=early))
                assert built.dq_semaphores == 8 * -(-9000 // wide.block_m) * 2
                assert not built.convert_counted
    # the mma.sync backward neither counts nor converts early
    strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (2000 * 8 * 64, 8 * 64, 64, 1))
    built = backward.plan_backward((3, 2000, 8, 64), (3, 2000, 2, 64), strides, "bfloat16", 0.1, True, False, 80)
    assert built.dq_semaphores == 0 and not built.convert_counted and "dq_arrivals" not in built.convert.per_call


def test_backward_planner_trims_the_score_products_of_narrower_calls(planner, monkeypatch):
    """A call narrower than its Hopper row (padded_call_width) gets the row's instantiation whose S^T and dP^T stop at
    configs.hopper_bwd_score_dim; calls at the row's own head dim, with modifiers, or on the mma.sync backward keep
    their names."""
    from fa2cupy import backward, build, configs

    names = []
    monkeypatch.setattr(build, "get_kernel", lambda family, name, smem: names.append(name) or type("F", (), {"ptr": 0}))

    def name(d, width=None, arch=90, varlen=False, **kw):
        strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (0 if varlen else 600 * 4 * d, 4 * d,
                                                                                  d, 1))
        backward.plan_backward((2, 300, 4, d), (2, 300, 4, d), strides, "bfloat16", 0.1, False, False, arch,
                               width=width, varlen_totals=(600, 600) if varlen else None, **kw)
        return next(n for n in reversed(names) if "dkdv" in n)

    assert name(80, 128).endswith("fa2::kMaskNone, false, false, 80>>")
    assert name(72, 128, varlen=True).endswith("fa2::kMaskNone, true, false, 80>>")
    assert name(88, 128).endswith(", false, false, 96>>") and name(144, 192).endswith(", false, false, 160>>")
    assert name(128) == configs.BACKWARD_HOPPER_TABLE[128].name_expression("bfloat16", "none")
    assert name(104, 128) == configs.BACKWARD_HOPPER_TABLE[128].name_expression("bfloat16", "none")
    assert name(80, 128, varlen=True, window_size=(32, 0)) == configs.BACKWARD_HOPPER_TABLE[128].name_expression(
        "bfloat16", "window", varlen=True)  # (no such instantiation of the varlen window kernel at 128)
    assert name(80, 128, softcap=5.0) == configs.BACKWARD_HOPPER_TABLE[128].name_expression("bfloat16", "window",
                                                                                            mods=True)
    assert name(80, arch=80).startswith("fa2::bwd_dkdv<fa2::BwdTraits<")  # (the mma.sync backward)


def test_hopper_backward_launches_programmatically_unless_told_not_to(planner):
    """hopper_bwd_programmatic (default True): the Hopper dK/dV kernel and the dQ conversion after it launch with
    programmatic stream serialization (their kernels wait for the one before: cuda/sm90/grid_dependencies.cuh); the
    preprocess, first of the call, never does, nor the mma.sync backward's launches."""
    from fa2cupy import backward

    strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (2048 * 8 * 64, 8 * 64, 64, 1))

    def programmatic(**fields):
        plan = backward.plan_backward((3, 2048, 8, 64), (3, 2048, 2, 64), strides, "bfloat16", 0.1, True, False, 90,
                                      options=KernelOptions(**fields))
        return tuple(launch._config is not None for launch in (plan.preprocess, plan.main, plan.convert))

    assert programmatic() == (False, True, True)
    assert programmatic(hopper_bwd_programmatic=False) == (False, False, False)
    assert programmatic(hopper_backward=False) == (False, False, False)


def _forward_call(d, dv, causal=False, seqlen=2048):
    """A checked flash_attn_func call (attention.FORWARD's) of cupy arrays q, k (d) and v (dv)."""
    from fa2cupy.arrays import ArrayInfo
    from fa2cupy.attention import FORWARD

    def info(name, shape):
        return ArrayInfo(name, "cupy", shape, "bfloat16", tuple(int(np.prod(shape[i + 1:])) for i in range(4)),
                         ("cuda", 0))

    infos = {"q": info("q", (2, seqlen, 8, d)), "k": info("k", (2, seqlen, 8, d)), "v": info("v", (2, seqlen, 8, dv))}
    return FORWARD, infos, FORWARD.check(infos, (0.0, None, causal, (-1, -1), 0.0, False, False), (None, 0))


@pytest.mark.parametrize("d,dv,width", [(192, 128, 192), (64, 128, 128), (128, 64, 128), (80, 96, 128)])
def test_forward_reads_v_at_its_own_head_dim_on_hopper(d, dv, width):
    # Where the Hopper forward takes the call at the wider head dim, q, k and v are read as they are (no padded
    # copy) and the output has v's head dim; elsewhere (other GPUs, the mma.sync forward chosen, varlen) all are
    # padded to one head dim.
    kind, infos, call = _forward_call(d, dv)
    kind.choose(call, infos, 90, DEFAULT)
    assert call.own_widths and call.kernel_width == width and call.out_width == dv
    assert call.dims("v") == (dv, dv) and call.dims("q") == (d, d) and kind._out_shape(call)[3] == dv
    for arch, opts in ((80, DEFAULT), (90, KernelOptions(hopper_forward=False))):
        kind, infos, call = _forward_call(d, dv)
        kind.choose(call, infos, arch, opts)
        assert not call.own_widths and call.out_width == call.padded == max(d, dv)
        assert call.dims("v") == (dv, max(d, dv))
    kind, infos, call = _forward_call(d, d)
    kind.choose(call, infos, 90, DEFAULT)
    assert not call.own_widths  # (one head dim: nothing to tell apart)


def test_forward_plan_maps_v_and_out_at_their_head_dim(planner):
    from fa2cupy import forward, pipeline

    q, v = (2, 2048, 8, 192), (2, 2048, 8, 128)
    strides = tuple(pipeline.c_strides(s) for s in (q, q, v, v))
    plan = forward.plan_forward(q, q, strides, "bfloat16", 0.1, True, 90, width=192, headdim_v=128)
    assert plan.config.family == "fwd_hopper"
    dims = [tuple(entry[1]) for entry in plan.tensor_maps._arrays]  # (each map's (rank, dims, ...) as encoded)
    assert dims == [(192, 8, 2048, 2), (192, 8, 2048, 2), (128, 8, 2048, 2), (128, 8, 2048, 2)]
    for arch, fields in ((80, {}), (90, {"hopper_forward": False})):
        with pytest.raises(ValueError, match="headdim_v = 128 .* Hopper forward alone"):
            forward.plan_forward(q, q, strides, "bfloat16", 0.1, True, arch, width=192, headdim_v=128,
                                 options=KernelOptions(**fields))


def test_backward_reads_v_dout_and_out_at_their_head_dim_on_hopper():
    # As the forward: where the Hopper dK/dV kernel takes the call at the wider head dim, v, dout and out (or q and
    # k) are read as they are; the gradients stay at the wider one (dK and dV share the kernel's store bound) and
    # come back sliced.
    from fa2cupy.arrays import ArrayInfo
    from fa2cupy.attention import BACKWARD

    def info(name, shape, dtype="bfloat16"):
        return ArrayInfo(name, "cupy", shape, dtype, tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))),
                         ("cuda", 0))

    for d, dv in ((192, 128), (64, 128), (60, 130)):
        infos = {"dout": info("dout", (2, 2048, 8, dv)), "q": info("q", (2, 2048, 8, d)),
                 "k": info("k", (2, 2048, 8, d)), "v": info("v", (2, 2048, 8, dv)),
                 "out": info("out", (2, 2048, 8, dv)),
                 "softmax_lse": info("softmax_lse", (2, 8, 2048), "float32")}
        call = BACKWARD.check(infos, (None, False, (-1, -1), False, 0.0, 0.0), (None, 0))
        BACKWARD.choose(call, infos, 90, DEFAULT)
        assert call.own_widths and call.dims("out") == (dv, -(-dv // 8) * 8) and call.dims("k")[1] == -(-d // 8) * 8
        assert BACKWARD._allocated_width(call) == call.padded == -(-max(d, dv) // 8) * 8
        call = BACKWARD.check(infos, (None, False, (-1, -1), False, 0.0, 0.0), (None, 0))
        BACKWARD.choose(call, infos, 90, KernelOptions(hopper_backward=False))
        assert not call.own_widths


def test_backward_plan_at_v_head_dim(planner):
    from fa2cupy import backward, pipeline

    q, v = (2, 2048, 8, 192), (2, 2048, 8, 128)
    strides = {n: pipeline.c_strides(q) for n in ("q", "k", "dq", "dk", "dv")}
    strides.update({n: pipeline.c_strides(v) for n in ("v", "dout", "out")})
    plan = backward.plan_backward(q, q, strides, "bfloat16", 0.1, True, False, 90, width=192, headdim_v=128)
    assert plan.config.family == "bwd_hopper"
    dims = [tuple(entry[1]) for entry in plan.tensor_maps._arrays if entry is not None]
    assert dims[:4] == [(192, 8, 2048, 2), (192, 8, 2048, 2), (128, 8, 2048, 2), (128, 8, 2048, 2)]  # q k v dout
    # the preprocess reads dout and out at 128 columns; the kernel stores and the conversion writes 192
    assert plan.preprocess.params.headdim == 128 and plan.preprocess.params.lanes == 16
    assert plan.main.params.bwd.headdim == 192 and plan.convert.params.headdim == 192
    q64 = (2, 2048, 8, 64)
    strides.update({n: pipeline.c_strides(q64) for n in ("q", "k")},
                   **{n: pipeline.c_strides(v) for n in ("dq", "dk", "dv")})
    plan = backward.plan_backward(q64, q64, strides, "bfloat16", 0.1, False, False, 90, width=128, headdim_v=128)
    assert plan.config.headdim == 128 and plan.main.params.bwd.headdim == 128 and plan.preprocess.params.headdim == 128
    with pytest.raises(ValueError, match="headdim_v = 128 .* Hopper dK/dV kernel alone"):
        backward.plan_backward(q64, q64, strides, "bfloat16", 0.1, False, False, 90, width=128, headdim_v=128,
                               options=KernelOptions(hopper_backward=False))


def test_backward_kernel_at_v_head_dim(planner, monkeypatch):
    # The 192 row's kernel at v's own head dim (HopperBwdTraits' VDim) for padded calls without modifiers whose q is
    # wider than the row's narrower score products; the row's own otherwise.
    from fa2cupy import backward, build, pipeline

    names = []
    monkeypatch.setattr(build, "get_kernel", lambda family, name, *rest: names.append(name) or object())

    def kernel(d, dv, **kw):
        q, v = (2, 2048, 8, d), (2, 2048, 8, dv)
        strides = {n: pipeline.c_strides(q) for n in ("q", "k", "dq", "dk")}
        strides.update({n: pipeline.c_strides(v) for n in ("v", "dout", "out")}, dv=pipeline.c_strides(q))
        names.clear()
        backward.plan_backward(q, q, strides, "bfloat16", 0.1, kw.pop("causal", False), False, 90,
                               width=192 if d <= 192 else None, headdim_v=dv, **kw)
        return next(n for n in names if n.startswith("fa2::bwd_dkdv_hopper"))

    assert kernel(192, 128).endswith("kMaskNone, false, false, 192, false, 128>>")
    assert kernel(184, 64, causal=True).endswith("kMaskCausal, false, false, 192, false, 128>>")
    assert kernel(192, 136).endswith("kMaskNone>>")  # (wider than 128: the row's)
    assert kernel(160, 128).endswith("kMaskNone, false, false, 160>>")  # (the narrower score products instead)
    assert kernel(192, 128, softcap=5.0).endswith("kMaskWindow, false, true>>")  # (modifiers: the row's)
    from fa2cupy import configs

    with pytest.raises(ValueError, match="v head dims"):
        configs.BACKWARD_HOPPER_TABLE[192].name_expression("bfloat16", "none", mods=True, v_dim=128)
    with pytest.raises(ValueError, match="v head dims"):
        configs.BACKWARD_HOPPER_TABLE[128].name_expression("bfloat16", "none", v_dim=64)


def test_varlen_forward_at_own_widths():
    # Varlen calls read each array at its own head dim where both lie in a wide Hopper row's last 64-column pass
    # (DeepSeek's 192 / 128), and pad otherwise; the backward only where v is the narrower.
    from fa2cupy import configs
    from fa2cupy.arrays import ArrayInfo
    from fa2cupy.attention import VARLEN_BACKWARD, VARLEN_FORWARD

    assert configs.hopper_varlen_own_widths(192, 192, 128) and configs.hopper_varlen_own_widths(192, 136, 192)
    assert not configs.hopper_varlen_own_widths(192, 192, 120) and not configs.hopper_varlen_own_widths(128, 128, 64)
    assert configs.hopper_varlen_own_widths(256, 256, 192) and not configs.hopper_varlen_own_widths(256, 256, 128)

    def info(name, shape, dtype="bfloat16"):
        return ArrayInfo(name, "cupy", shape, dtype, tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))),
                         ("cuda", 0))

    for d, dv, own in ((192, 128, True), (184, 128, True), (128, 64, False), (192, 64, False)):
        infos = {"q": info("q", (4096, 8, d)), "k": info("k", (4096, 8, d)), "v": info("v", (4096, 8, dv)),
                 "cu_seqlens_q": info("cu_seqlens_q", (3,), "int32"),
                 "cu_seqlens_k": info("cu_seqlens_k", (3,), "int32")}
        call = VARLEN_FORWARD.check(infos, (2048, 2048, 0.0, None, False, (-1, -1), 0.0, False, False), (None, 0))
        VARLEN_FORWARD.choose(call, infos, 90, DEFAULT)
        assert call.own_widths == own, (d, dv)
        if own:
            assert call.out_width == dv and call.dims("q")[1] == d
    infos = {"dout": info("dout", (4096, 8, 128)), "q": info("q", (4096, 8, 192)), "k": info("k", (4096, 8, 192)),
             "v": info("v", (4096, 8, 128)), "out": info("out", (4096, 8, 128)),
             "softmax_lse": info("softmax_lse", (8, 4096), "float32"),
             "cu_seqlens_q": info("cu_seqlens_q", (3,), "int32"), "cu_seqlens_k": info("cu_seqlens_k", (3,), "int32")}
    call = VARLEN_BACKWARD.check(infos, (2048, 2048, None, False, (-1, -1), False, 0.0, 0.0), (None, 0))
    VARLEN_BACKWARD.choose(call, infos, 90, DEFAULT)
    assert call.own_widths and call.dims("v") == (128, 128) and call.dims("q") == (192, 192)
    for name in ("dout", "v", "out"):
        infos[name] = info(name, infos[name].shape[:2] + (192,))
    for name in ("q", "k"):
        infos[name] = info(name, infos[name].shape[:2] + (136,))
    call = VARLEN_BACKWARD.check(infos, (2048, 2048, None, False, (-1, -1), False, 0.0, 0.0), (None, 0))
    VARLEN_BACKWARD.choose(call, infos, 90, DEFAULT)
    assert not call.own_widths  # (v wider than q: the dV stores stop at q's head dim)


def test_varlen_forward_plan_at_v_head_dim(planner):
    from fa2cupy import forward

    q = (1, 2048, 8, 192)  # (v and out at 128)
    strides = ((0, 8 * 192, 192, 1), (0, 8 * 192, 192, 1), (0, 8 * 128, 128, 1), (0, 8 * 128, 128, 1))
    plan = forward.plan_forward(q, q, strides, "bfloat16", 0.1, False, 90, varlen_totals=(4096, 4096),
                                headdim_v=128)
    fixed = plan.launch.params.fwd
    assert plan.config.family == "fwd_hopper" and fixed.headdim == 192 and fixed.headdim_v == 128
    q64 = (1, 2048, 8, 128)  # (v at 64: its own width on the 128 row, not in a wide row's last pass)
    strides = ((0, 8 * 128, 128, 1), (0, 8 * 128, 128, 1), (0, 8 * 64, 64, 1), (0, 8 * 64, 64, 1))
    with pytest.raises(ValueError, match="headdim_v = 64 .* Hopper forward alone"):
        forward.plan_forward(q64, q64, strides, "bfloat16", 0.1, False, 90, varlen_totals=(4096, 4096), headdim_v=64)


def test_forward_kernel_at_v_head_dim(planner, monkeypatch):
    # The 192 row's forward at v's own head dim 128 (HopperFwdTraits' HeadDimV) for padded and varlen calls without
    # modifiers whose v is at most 128 wide; the row's own otherwise.
    from fa2cupy import build, configs, forward, pipeline

    names = []
    monkeypatch.setattr(build, "get_kernel", lambda family, name, *rest: names.append(name) or object())

    def kernel(d, dv, varlen=False, **kw):
        q, v = (1 if varlen else 2, 2048, 8, d), (1 if varlen else 2, 2048, 8, dv)
        strides = [(0, 8 * x[3], x[3], 1) if varlen else pipeline.c_strides(x) for x in (q, q, v, v)]
        names.clear()
        plan = forward.plan_forward(q, q, tuple(strides), "bfloat16", 0.1, kw.pop("causal", False), 90,
                                    width=None if varlen else 192, headdim_v=dv,
                                    varlen_totals=(4096, 4096) if varlen else None, **kw)
        assert plan.launch.smem_bytes == plan.config.smem_bytes
        return next(n for n in names if n.startswith("fa2::flash_fwd_hopper"))

    assert kernel(192, 128).endswith("kMaskNone, false, false, false, false, 128>>")
    assert kernel(184, 64, causal=True).endswith("kMaskCausal, false, false, false, false, 128>>")
    assert kernel(192, 128, varlen=True, causal=True).endswith("kMaskCausal, true, false, false, false, 128>>")
    assert kernel(192, 128, window_size=(100, 0)).endswith("kMaskWindow, false, false, false, false, 128>>")
    assert kernel(192, 136).endswith("kMaskNone>>")  # (wider than 128: the row's)
    assert kernel(192, 128, softcap=5.0).endswith("kMaskNone, false, false, true>>")  # (modifiers: the row's)
    assert kernel(192, 128, dropout_p=0.1).endswith("kMaskWindow, false, false, true>>")  # (dropout: window)
    row = configs.FORWARD_HOPPER_TABLE[192]
    narrow = configs.hopper_fwd_v_config(row, 128, False, False)
    assert narrow.headdim_v == 128 and narrow.consumer_wgs == 3 and narrow.block_m == 192
    assert kernel(192, 128).startswith("fa2::flash_fwd_hopper<fa2::HopperFwdTraits<192, 64, 3, 4, 1, 3,")
    # (varlen window calls: v's head dim on the row's two warpgroups)
    assert configs.hopper_fwd_v_config(row, 128, False, False, "window", True) == dataclasses.replace(row, v_dim=128)
    assert kernel(192, 128, varlen=True, window_size=(50, 50)).startswith(
        "fa2::flash_fwd_hopper<fa2::HopperFwdTraits<192, 64, 2, 3, 2, 2,")
    assert configs.hopper_fwd_v_config(configs.FORWARD_HOPPER_TABLE[128], 64, False, False).v_dim is None
    with pytest.raises(ValueError, match="v head dims"):
        narrow.name_expression("bfloat16", "window", mods=True)
    with pytest.raises(ValueError, match="v head dims"):
        narrow.name_expression("bfloat16", "none", varlen=True, paged=True)


def test_varlen_backward_plan_at_v_head_dim(planner, monkeypatch):
    from fa2cupy import backward, build

    names = []
    monkeypatch.setattr(build, "get_kernel", lambda family, name, *rest: names.append(name) or object())
    q = (1, 2048, 8, 192)  # (v, dout and out at 128)
    strides = {n: (0, 8 * 192, 192, 1) for n in ("q", "k", "dq", "dk", "dv")}
    strides.update({n: (0, 8 * 128, 128, 1) for n in ("v", "dout", "out")})
    plan = backward.plan_backward(q, q, strides, "bfloat16", 0.1, True, False, 90, varlen_totals=(4096, 4096),
                                  headdim_v=128)
    assert plan.config.family == "bwd_hopper"
    assert any(n.endswith("kMaskCausal, true, false, 192, false, 128>>") for n in names), names  # (VDim, varlen)
    assert plan.main.params.bwd.headdim == 192 and plan.main.params.bwd.headdim_v == 128
    assert plan.preprocess.params.headdim == 128
    q136 = (1, 2048, 8, 136)  # (v, dout and out at 192)
    strides = {n: (0, 8 * 136, 136, 1) for n in ("q", "k")}
    strides.update({n: (0, 8 * 192, 192, 1) for n in ("v", "dout", "out", "dq", "dk", "dv")})
    with pytest.raises(ValueError, match="headdim_v = 192 .* Hopper dK/dV kernel alone"):
        backward.plan_backward(q136, q136, strides, "bfloat16", 0.1, True, False, 90, varlen_totals=(4096, 4096),
                               width=192, headdim_v=192)
