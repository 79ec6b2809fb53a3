"""The pipeline's cached fast path, host logic only (CPU, CUDA calls stubbed): what a repeated call hands to its
kind's launch (pointers by name, per-call values), when it must fall back to the checked path, and how a Launch
stores its per-call values. The GPU tests (tests/test_kvcache.py, test_forward_gpu.py, ...) run the same path for
real."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import fa2cupy
from fa2cupy import arrays, attention, build, decode, device_errors, kvcache, params, pipeline
from fa2cupy.options import KernelOptions


class FakeArray:
    """Stands for a device array: fast_meta is stubbed to read these two fields."""

    def __init__(self, meta, ptr):
        self.meta, self.ptr = meta, ptr


class FakePlan:
    capacity, seqlen_new, rotary_span, seqlen_ro, rotary = 100, 0, 0, 0, None

    def workspace(self, stream_ptr, framework, device):
        return 0


@pytest.fixture
def stubbed(monkeypatch):
    """fast_meta, the stream, allocation and the kernel launches stubbed; returns the list of launches (pointers by
    name, per-call values) and of checked-path calls (each with the cache key it was given)."""
    launches, checked = [], []
    monkeypatch.setattr(arrays, "fast_meta", lambda x: (x.meta, x.ptr) if isinstance(x, FakeArray) else None)
    monkeypatch.setattr(arrays, "allocator", lambda shape, dtype, framework, device: lambda: (("out", shape), 4096))
    monkeypatch.setattr(arrays, "stream_ptr_getter", lambda framework: lambda device: 7)
    for kind in (kvcache.KVCACHE, attention.FORWARD, attention.VARLEN_FORWARD, attention.BACKWARD):
        monkeypatch.setattr(kind, "launch", lambda plan, pointers, values, stream, framework, device:
                            launches.append((pointers, values, stream, plan)))
    monkeypatch.setattr(pipeline, "_checked", lambda kind, given, options, values, kernel_options, key, pointers:
                        checked.append(key) or kind.result(options)(["checked"] * 4))
    monkeypatch.setattr(pipeline.cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(device_errors, "raise_pending", lambda: None)
    monkeypatch.setattr(pipeline, "_cached_calls", {})
    return launches, checked


def _remember_last(checked, names=("out", "softmax_lse"), plan=None, values=None):
    """Remembers the last checked call's key as a checked path would, with these allocations and fixed values."""
    kind = checked[-1][0]
    pipeline._cached_calls[checked[-1]] = pipeline._CachedCall(
        plan, 0, "cupy", tuple((n, (1,), "bf16") for n in names), values,
        kind.values_check(None, plan, checked[-1][2]), kind.result(checked[-1][2]))


def test_repeated_call_launches_with_pointers_by_name(stubbed):
    launches, checked = stubbed
    q, kc, vc = FakeArray("q", 256), FakeArray("kc", 512), FakeArray("vc", 768)
    lens, table = FakeArray("lens", 1024), FakeArray("table", 2048)
    fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)
    assert len(checked) == 1 and not launches  # first call: the checked path, given the key to remember
    _remember_last(checked, ("out",), FakePlan(), (0,))  # (an array cache_seqlens: fixed_seqlen is 0, fixed)
    out = fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)
    assert out == ("out", (1,)) and len(checked) == 1
    (pointers, values, stream, _), = launches
    # Every name the launch reads is there: absent arrays (k, v, cache_batch_idx, rotary, leftpad, alibi) and
    # outputs (softmax_lse, q_rotated) are 0.
    assert pointers == dict(decode.NO_POINTERS, q=256, k_cache=512, v_cache=768, cache_seqlens=1024, block_table=2048,
                            out=4096)
    assert (values, stream) == ((0,), 7)


def test_different_metadata_or_options_miss_the_cache(stubbed):
    launches, checked = stubbed
    q, kc, vc = FakeArray("q", 256), FakeArray("kc", 512), FakeArray("vc", 768)
    fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5)
    _remember_last(checked, ("out",), FakePlan())  # (an int cache_seqlens: checked per call)
    fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, causal=True)  # another option
    fa2cupy.flash_attn_with_kvcache(FakeArray("q2", 256), kc, vc, cache_seqlens=5)  # another shape
    fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, k=FakeArray("k", 64), v=FakeArray("v", 64))
    assert not launches and len(checked) == 4
    assert len(set(checked)) == 4  # four different keys
    fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=6)  # an int cache_seqlens is checked, not keyed
    assert len(launches) == 1 and launches[0][1] == (6,)
    with pytest.raises(ValueError, match=r"cache_seqlens \+ seqlen_new must lie in \[0, 100\]"):
        fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=101)  # (checked on the fast path too)


def test_misaligned_pointer_or_other_device_takes_the_checked_path(stubbed, monkeypatch):
    launches, checked = stubbed
    kc, vc = FakeArray("kc", 512), FakeArray("vc", 768)
    fa2cupy.flash_attn_with_kvcache(FakeArray("q", 256), kc, vc)
    _remember_last(checked, ("out",), FakePlan(), (100,))
    fa2cupy.flash_attn_with_kvcache(FakeArray("q", 256 + 8), kc, vc)  # same metadata, pointer not 16-aligned
    assert not launches and len(checked) == 2 and checked[1] == checked[0]
    monkeypatch.setattr(pipeline.cupy.cuda.runtime, "getDevice", lambda: 1)
    fa2cupy.flash_attn_with_kvcache(FakeArray("q", 256), kc, vc)
    assert not launches and len(checked) == 3
    monkeypatch.setattr(pipeline.cupy.cuda.runtime, "getDevice", lambda: 0)
    fa2cupy.flash_attn_with_kvcache(FakeArray("q", 256), kc, vc)
    assert len(launches) == 1


def test_unknown_array_type_or_unhashable_option_is_not_cached(stubbed):
    launches, checked = stubbed
    kc, vc = FakeArray("kc", 512), FakeArray("vc", 768)
    fa2cupy.flash_attn_with_kvcache(np.zeros((1, 1, 4, 64)), kc, vc)
    fa2cupy.flash_attn_with_kvcache(FakeArray("q", 256), kc, vc, window_size=[3, 0])
    assert checked == [None, None] and not launches


def test_optional_arrays_are_part_of_the_key_and_pass_pointer_0_when_absent(stubbed):
    launches, checked = stubbed
    q, k, v, slopes = (FakeArray(n, p) for n, p in (("q", 256), ("k", 512), ("v", 768), ("slopes", 1024)))
    fa2cupy.flash_attn_func(q, k, v)
    _remember_last(checked)
    fa2cupy.flash_attn_func(q, k, v, alibi_slopes=slopes)  # another key: slopes present
    assert len(checked) == 2 and checked[0] != checked[1] and not launches
    _remember_last(checked)
    fa2cupy.flash_attn_func(q, k, v)
    fa2cupy.flash_attn_func(q, k, v, alibi_slopes=slopes)
    names = ("q", "k", "v", "alibi_slopes", "dropout_rng_state")
    assert [tuple(pointers[n] for n in names) for pointers, *_ in launches] == [(256, 512, 768, 0, 0),
                                                                                       (256, 512, 768, 1024, 0)]
    assert all(pointers["out"] == pointers["softmax_lse"] == 4096 for pointers, *_ in launches)  # the allocations

    cu_q, cu_k, table = FakeArray("cu_q", 1280), FakeArray("cu_k", 1536), FakeArray("table", 1792)
    fa2cupy.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, block_table=table)
    _remember_last(checked)
    fa2cupy.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, block_table=table)
    names += ("cu_seqlens_q", "cu_seqlens_k", "block_table")
    assert tuple(launches[-1][0][n] for n in names) == (256, 512, 768, 0, 0, 1280, 1536, 1792)


def test_fast_path_checks_the_per_call_dropout_values(stubbed):
    # The seed and offset are not part of the key: a repeated call checks them itself, and passes them on.
    launches, checked = stubbed
    q, k, v, lse = (FakeArray(n, p) for n, p in (("q", 256), ("k", 512), ("v", 768), ("lse", 1024)))
    fa2cupy.flash_attn_func(q, k, v, dropout_p=0.1, dropout_seed=3)
    _remember_last(checked)
    fa2cupy.flash_attn_func(q, k, v, dropout_p=0.1, dropout_seed=5, dropout_offset=8)
    assert launches[-1][1] == (5, 8)
    with pytest.raises(ValueError, match=r"^dropout_seed must be an int in \[0, 2\*\*64\)"):
        fa2cupy.flash_attn_func(q, k, v, dropout_p=0.1)
    fa2cupy.flash_attn_backward(q, q, k, v, q, lse, dropout_p=0.1, dropout_seed=1)
    _remember_last(checked, ("dq", "dk", "dv", "dsum"))
    dq, dk, dv = fa2cupy.flash_attn_backward(q, q, k, v, q, lse, dropout_p=0.1, dropout_seed=2, dropout_offset=4)
    assert launches[-1][1] == (2, 4) and launches[-1][0]["softmax_lse"] == 1024
    assert len(checked) == 2


def test_return_attn_probs_with_dropout_keeps_the_fast_path(stubbed, monkeypatch):
    # The probabilities of return_attn_probs=True are built from the caller's q, k and the kernel's lse, after the
    # (cached) forward; forward_with_lse never builds them.
    launches, checked = stubbed
    built = []
    monkeypatch.setattr(attention, "_dropped_probs", lambda q, k, lse, *args: built.append(lse) or "probs")
    q, k, v = (FakeArray(n, p) for n, p in (("q", 256), ("k", 512), ("v", 768)))
    kw = dict(dropout_p=0.1, dropout_seed=3, return_attn_probs=True)
    fa2cupy.flash_attn_func(q, k, v, **kw)
    _remember_last(checked)
    assert fa2cupy.flash_attn_func(q, k, v, **kw) == (("out", (1,)), ("out", (1,)), "probs")
    assert len(launches) == 1 and built == ["checked", ("out", (1,))]
    assert attention.forward_with_lse(q, k, v, dropout_p=0.1, dropout_seed=3) == (("out", (1,)), ("out", (1,)))
    assert len(launches) == 2 and len(built) == 2 and len(checked) == 1


def test_kernel_options_are_part_of_the_key(stubbed):
    # Two calls that differ only in their KernelOptions never share a cached plan: each is checked (and planned)
    # once, and later calls launch the plan made with their own options. Equal options are one key.
    launches, checked = stubbed
    q, k, v = (FakeArray(n, p) for n, p in (("q", 256), ("k", 512), ("v", 768)))
    mma = KernelOptions(hopper_forward=False)
    fa2cupy.flash_attn_func(q, k, v)
    _remember_last(checked, plan="planned with the defaults")
    fa2cupy.flash_attn_func(q, k, v, kernel_options=mma)
    assert len(checked) == 2 and checked[0] != checked[1] and not launches
    _remember_last(checked, plan="planned without the Hopper forward")
    fa2cupy.flash_attn_func(q, k, v, kernel_options=KernelOptions(hopper_forward=False))
    fa2cupy.flash_attn_func(q, k, v)
    fa2cupy.flash_attn_func(q, k, v, kernel_options=KernelOptions())  # the defaults, spelled out
    assert [plan for *_, plan in launches] == ["planned without the Hopper forward", "planned with the defaults",
                                               "planned with the defaults"]
    for options in (KernelOptions(tile_counter=False), KernelOptions(decode_deep_ring=True)):
        fa2cupy.flash_attn_func(q, k, v, kernel_options=options)  # any field makes another key
    assert len(checked) == 4 and len(set(checked)) == 4
    # Debug poisoning fills the outputs on the checked path: such calls never take the fast path.
    poison = KernelOptions(debug_poison=True)
    fa2cupy.flash_attn_func(q, k, v, kernel_options=poison)
    fa2cupy.flash_attn_func(q, k, v, kernel_options=poison)
    assert checked[-2:] == [None, None] and len(launches) == 3
    with pytest.raises(TypeError, match=r"^kernel_options must be a fa2cupy.KernelOptions or None, got dict"):
        fa2cupy.flash_attn_func(q, k, v, kernel_options={"hopper_forward": False})


def test_launch_writes_per_call_values_into_their_fields(monkeypatch):
    calls = []
    monkeypatch.setattr(build, "_launch_kernel", lambda *args: calls.append(args))

    class Function:
        ptr = 99

    fixed = params.MergeParams(rows=1 << 40, n=-3, headdim=64)
    launch = build.Launch(Function(), (2, 3, 1), (128, 1, 1), 4096, fixed, ("lse_out", "parts"))
    launch(5, (0xDEADBEEF000, 123))
    (fn, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra), = calls
    assert (fn, gx, gy, gz, bx, by, bz, smem, stream, extra) == (99, 2, 3, 1, 128, 1, 1, 4096, 5, 0)
    # The kernel's one parameter: the launch's struct, by address.
    struct = params.MergeParams.from_address(ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))[0])
    assert struct.lse_out == 0xDEADBEEF000 and struct.parts == 123  # the per-call values, by name
    assert (struct.rows, struct.n, struct.headdim, struct.lses, struct.out) == (1 << 40, -3, 64, 0, 0)  # fixed
    with pytest.raises(ValueError):  # per-call values are pointers and counts: never negative
        launch(5, (-1, 0))
    build.Launch(Function(), (0, 3, 1), (128, 1, 1), 0, fixed, ("parts",))(5, (1,))  # empty grid: nothing launched
    assert len(calls) == 1


def test_programmatic_launch_passes_its_config_to_cuLaunchKernelEx(monkeypatch):
    # A programmatic launch goes through cuLaunchKernelEx with a CUlaunchConfig laid out as in cuda.h (grid, block,
    # shared memory, the call's stream, one attribute: programmatic stream serialization allowed) and the same
    # parameter struct as a plain launch; a driver error raises.
    seen = []

    class Driver:
        status = 0

        def cuLaunchKernelEx(self, config_ptr, function, kernel_params, extra):
            config = build._LaunchConfig.from_address(config_ptr)
            attribute = build._LaunchAttribute.from_address(config.attrs)
            struct = params.MergeParams.from_address(ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))[0])
            seen.append(((config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.blockDimY,
                          config.blockDimZ, config.sharedMemBytes, config.hStream, config.numAttrs),
                         (attribute.id, attribute.value), function, struct.parts, struct.n, extra))
            return self.status

        def cuGetErrorName(self, status, name):
            name._obj.value = {1: b"CUDA_ERROR_INVALID_VALUE"}.get(status)
            return 0 if status == 1 else 1

    driver = Driver()
    monkeypatch.setattr(build, "_driver", lambda: driver)
    monkeypatch.setattr(build, "_launch_kernel", lambda *args: pytest.fail("plain launch"))
    assert ctypes.sizeof(build._LaunchConfig) == 56 and build._LaunchConfig.hStream.offset == 32
    assert ctypes.sizeof(build._LaunchAttribute) == 72 and build._LaunchAttribute.value.offset == 8

    class Function:
        ptr = 77

    launch = build.Launch(Function(), (4, 1, 2), (384, 1, 1), 1000, params.MergeParams(n=9), ("parts",), True)
    launch(0x1234, (0xABC0,))
    assert seen == [((4, 1, 2, 384, 1, 1, 1000, 0x1234, 1), (6, 1), 77, 0xABC0, 9, None)]
    driver.status = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
        launch(0x1234, (0xABC0,))


@pytest.mark.parametrize("kind, returned", [
    (attention.FORWARD, [(1, 130, 2, 40), (1, 2, 130)]),  # out (head dim padded 33 -> 40), softmax_lse
    (attention.BACKWARD, [(1, 130, 2, 40), (1, 70, 1, 40), (1, 70, 1, 40)]),  # dq, dk, dv
    (attention.VARLEN_FORWARD, [(130, 2, 40), (2, 130)]),
])
def test_results_slice_the_head_dim_alone(kind, returned):
    """Where the kernels ran on a padded head dim, the outputs that have one are sliced back to the caller's; the
    log-sum-exp, whose last axis is seqlen_q, is returned whole."""
    from fa2cupy import checks

    call = type("Call", (), {"shape": checks.AttnShape(1, 130, 70, 2, 1, 33, "float16"), "padded": 40,
                             "out_width": 40})()
    outs = kind.results(call, [np.zeros(s) for s in returned], {})
    expect = [s[:-1] + (33,) if s[-1] == 40 else s for s in returned]
    assert [x.shape for x in outs] == expect


def test_results_slice_v_head_dim_of_its_own():
    """With v's head dim (20) other than q's (33), both run padded to 40: out and dv come back with v's, dq and dk
    with q's."""
    from fa2cupy import checks

    call = type("Call", (), {"shape": checks.AttnShape(1, 130, 70, 2, 1, 33, "float16", 20), "padded": 40,
                             "out_width": 40})()
    out, lse = attention.FORWARD.results(call, [np.zeros((1, 130, 2, 40)), np.zeros((1, 2, 130))], {})
    assert out.shape == (1, 130, 2, 20) and lse.shape == (1, 2, 130)
    grads = attention.BACKWARD.results(call, [np.zeros((1, 130, 2, 40)), np.zeros((1, 70, 1, 40)),
                                              np.zeros((1, 70, 1, 40))], {})
    assert [g.shape for g in grads] == [(1, 130, 2, 33), (1, 70, 1, 33), (1, 70, 1, 20)]


@pytest.mark.parametrize("d, dv, padded", [(64, 64, 64), (33, 33, 40), (192, 128, 192), (60, 130, 136)])
def test_adapt_pads_each_array_to_the_kernels_head_dim(monkeypatch, d, dv, padded):
    """The forward's and backward's adapt: q and k from q's head dim, v, dout and out from v's, each zero-padded to
    the kernels' one (the larger, to a multiple of 8); arrays already at it pass through. NumPy stands in for
    CuPy (kernel_ready's padding, to_cupy, contiguous)."""
    def ready(x, headdim, width=None):
        assert x.shape[-1] == headdim
        width = pipeline.padded_headdim(headdim) if width is None else width
        return x if width == headdim else np.concatenate([x, np.zeros(x.shape[:-1] + (width - headdim,))], -1)

    monkeypatch.setattr(attention, "kernel_ready", ready)
    monkeypatch.setattr(arrays, "to_cupy", lambda x, info: x)
    monkeypatch.setattr(pipeline, "device_of", lambda info: 0)
    monkeypatch.setattr(attention, "contiguous", lambda x, info: x)  # (the backward's lse)
    x = {"q": np.ones((2, 5, 4, d), np.float16), "k": np.ones((2, 7, 2, d), np.float16),
         "v": np.ones((2, 7, 2, dv), np.float16), "dout": np.ones((2, 5, 4, dv), np.float16),
         "out": np.ones((2, 5, 4, dv), np.float16), "softmax_lse": np.zeros((2, 4, 5), np.float32)}
    infos = {n: arrays.describe(a, n) for n, a in x.items()}
    call = attention.FORWARD.check(infos, (0.0, None, True, (-1, -1), 0.0, False, False), (None, 0))
    assert call.padded == padded and call.scale == pytest.approx(d ** -0.5)
    ready_fwd = attention.FORWARD.adapt(call, {n: x[n] for n in "qkv"}, infos)
    assert {n: a.shape[-1] for n, a in ready_fwd.items()} == dict.fromkeys("qkv", padded)
    # On an H100/H200, where the Hopper forward takes the call (this short causal one from any length on), it
    # reads each array as it is, padded to a multiple of 8 alone
    attention.FORWARD.choose(call, infos, 90, KernelOptions(hopper_masked_min_seqlen=0))
    assert call.own_widths == (d != dv)
    if call.own_widths:
        ready_fwd = attention.FORWARD.adapt(call, {n: x[n] for n in "qkv"}, infos)
        own = {"q": pipeline.padded_headdim(d), "k": pipeline.padded_headdim(d), "v": pipeline.padded_headdim(dv)}
        assert {n: a.shape[-1] for n, a in ready_fwd.items()} == own
    call = attention.BACKWARD.check(infos, (None, True, (-1, -1), False, 0.0, 0.0), (None, 0))
    ready_bwd = attention.BACKWARD.adapt(call, x, infos)
    for name in ("dout", "q", "k", "v", "out"):
        a = ready_bwd[name]
        assert a.shape[-1] == padded and (a[..., x[name].shape[-1]:] == 0).all() and (a[..., :1] == 1).all()


def test_varlen_adapt_pads_v_to_the_kernels_head_dim(monkeypatch):
    """The varlen forward's and backward's adapt: packed (total, heads, d) arrays seen as one batch row, v, dout and
    out padded from v's head dim (128) to q's (192)."""
    monkeypatch.setattr(attention, "kernel_ready", lambda x, headdim, width: np.concatenate(
        [x, np.zeros(x.shape[:-1] + (width - headdim,))], -1) if width != headdim else x)
    monkeypatch.setattr(arrays, "to_cupy", lambda x, info: x)
    monkeypatch.setattr(pipeline, "device_of", lambda info: 0)
    monkeypatch.setattr(attention, "contiguous", lambda x, info: x)
    x = {"q": np.ones((9, 4, 192), np.float16), "k": np.ones((11, 2, 192), np.float16),
         "v": np.ones((11, 2, 128), np.float16), "dout": np.ones((9, 4, 128), np.float16),
         "out": np.ones((9, 4, 128), np.float16), "softmax_lse": np.zeros((4, 9), np.float32),
         "cu_seqlens_q": np.array([0, 4, 9], np.int32), "cu_seqlens_k": np.array([0, 5, 11], np.int32)}
    infos = {n: arrays.describe(a, n) for n, a in x.items()}
    call = attention.VARLEN_FORWARD.check(infos, (5, 6, 0.0, None, True, (-1, -1), 0.0, False, False), (None, 0))
    assert call.padded == 192 and call.shape.dv == 128
    ready = attention.VARLEN_FORWARD.adapt(call, {n: x[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")},
                                           infos)
    assert [ready[n].shape for n in "qkv"] == [(1, 9, 4, 192), (1, 11, 2, 192), (1, 11, 2, 192)]
    call = attention.VARLEN_BACKWARD.check(infos, (5, 6, None, True, (-1, -1), False, 0.0, 0.0), (None, 0))
    ready = attention.VARLEN_BACKWARD.adapt(call, x, infos)
    assert {n: ready[n].shape[-1] for n in ("dout", "q", "k", "v", "out")} == dict.fromkeys(
        ("dout", "q", "k", "v", "out"), 192)


def _choose(kind, check_options, arch=90, options=None, d=96, sq=512, extra=()):
    """The head dim the kernels run at after ``kind.choose`` for a padded call of head dim ``d`` (q, k, v, and the
    backward's dout, out and lse), NumPy infos: the arrays are read as they are (``kernel_width``)."""
    from fa2cupy import KernelOptions

    x = {"q": np.ones((2, sq, 4, d), np.float16), "k": np.ones((2, sq, 2, d), np.float16),
         "v": np.ones((2, sq, 2, d), np.float16), "dout": np.ones((2, sq, 4, d), np.float16),
         "out": np.ones((2, sq, 4, d), np.float16), "softmax_lse": np.zeros((2, 4, sq), np.float32)}
    x.update(extra)
    infos = {n: arrays.describe(a, n) for n, a in x.items()}
    call = kind.check(infos, check_options, (1, 0))
    kind.choose(call, infos, arch, options or KernelOptions())
    if call.kernel_width is not None:
        assert call.padded == d and call.kernel_width > d
    return call.kernel_width or call.padded


def _fwd(causal=False, softcap=0.0, dropout_p=0.0):
    return (dropout_p, None, causal, (-1, -1), softcap, False, False)


def _bwd(causal=False, softcap=0.0, dropout_p=0.0, deterministic=False):
    return (None, causal, (-1, -1), deterministic, softcap, dropout_p)


@pytest.mark.parametrize("kind, opts, kw, padded", [
    ("fwd", _fwd(), {}, 128),  # 96 -> the Hopper kernels' 128
    ("bwd", _bwd(), {}, 128),
    ("bwd", _bwd(deterministic=True), {}, 128),
    ("fwd", _fwd(), dict(d=80), 128),
    ("fwd", _fwd(), dict(d=160), 192),
    ("bwd", _bwd(causal=True), dict(d=224), 256),
    ("fwd", _fwd(), dict(d=40), 64),
    ("fwd", _fwd(), dict(d=32), 32),  # below HOPPER_PAD_MIN_HEADDIM: the mma.sync kernels at 32
    ("fwd", _fwd(), dict(d=128), 128),  # a Hopper width: nothing to pad
    ("fwd", _fwd(), dict(arch=80), 96),  # not Hopper
    ("fwd", _fwd(dropout_p=0.1), {}, 128),  # the Hopper kernels' modifier rows take dropout at 128
    ("bwd", _bwd(dropout_p=0.1), {}, 128),
    ("fwd", _fwd(causal=True, dropout_p=0.1), dict(d=224), 256),  # (padded calls: at 256 too)
    ("fwd", _fwd(dropout_p=0.1), dict(d=40), 64),  # the Hopper forward's d = 64 modifier row takes dropout
    ("bwd", _bwd(dropout_p=0.1), dict(d=40), 40),  # the Hopper backward at 64 no dropout (HOPPER_BWD_NO_DROPOUT)
    ("bwd", _bwd(softcap=5.0), dict(d=40), 64),  # (but softcap)
    ("fwd", _fwd(softcap=5.0), {}, 128),  # the Hopper forward takes softcap at 128
    ("bwd", _bwd(softcap=5.0), {}, 128),  # so does the Hopper backward (its modifier rows)
    ("bwd", _bwd(softcap=5.0), dict(d=176), 192),  # ... and at 192 (the wide rows)
    ("bwd", _bwd(softcap=5.0, dropout_p=0.1), dict(d=176), 192),  # with dropout too
    ("fwd", _fwd(softcap=5.0, dropout_p=0.1), dict(d=176), 192),
    ("fwd", _fwd(causal=True), dict(sq=64), 96),  # a short masked forward: the mma.sync forward
    ("bwd", _bwd(causal=True), dict(sq=64), 128),  # (the backward has no such rule)
])
def test_choose_pads_up_to_a_hopper_width(monkeypatch, kind, opts, kw, padded):
    """On sm_90 a head dim without a Hopper row runs at the next Hopper width up where the Hopper kernel there takes
    the call (configs.hopper_pad_width, the kinds' choose), on its arrays as they are."""
    monkeypatch.setattr(pipeline, "device_of", lambda info: 0)
    assert _choose(attention.FORWARD if kind == "fwd" else attention.BACKWARD, opts, **kw) == padded


def test_varlen_forward_reads_its_arrays_as_they_are(monkeypatch):
    """A varlen forward at a head dim between the Hopper widths runs the wider kernel on its own arrays (its ragged
    tiles' copies stop at their head dim), never on padded copies; paged K/V keep their own width."""
    monkeypatch.setattr(pipeline, "device_of", lambda info: 0)
    x = {"q": np.ones((9, 4, 96), np.float16), "k": np.ones((11, 2, 96), np.float16),
         "v": np.ones((11, 2, 96), np.float16), "cu_seqlens_q": np.array([0, 4, 9], np.int32),
         "cu_seqlens_k": np.array([0, 5, 11], np.int32)}
    infos = {n: arrays.describe(a, n) for n, a in x.items()}
    call = attention.VARLEN_FORWARD.check(infos, (5, 6, 0.0, None, False, (-1, -1), 0.0, False, False), (None, 0))
    attention.VARLEN_FORWARD.choose(call, infos, 90, attention.configs.DEFAULT)
    assert call.padded == 96 and call.kernel_width == 128
    x.update(k=np.ones((3, 16, 2, 96), np.float16), v=np.ones((3, 16, 2, 96), np.float16),
             block_table=np.zeros((2, 1), np.int32))
    infos = {n: arrays.describe(a, n) for n, a in x.items()}
    call = attention.VARLEN_FORWARD.check(infos, (5, 6, 0.0, None, False, (-1, -1), 0.0, False, False), (None, 0))
    attention.VARLEN_FORWARD.choose(call, infos, 90, attention.configs.DEFAULT)
    assert call.padded == 96 and call.kernel_width is None  # paged K/V: the pages are used in place


@pytest.mark.parametrize("d, width", [(96, 128), (176, 192), (224, None)])
def test_varlen_dropout_pads_where_the_hopper_forward_takes_it(monkeypatch, d, width):
    """A varlen dropout forward runs the Hopper forward's modifier rows at the next width up where they take varlen
    calls (128 and 192), the mma.sync forward at its own head dim where they do not (256: padded calls only).
    (Dropout runs in the window variant: max_seqlen_q at least HOPPER_MASKED_MIN_SEQLEN.)"""
    monkeypatch.setattr(pipeline, "device_of", lambda info: 0)
    x = {"q": np.ones((900, 4, d), np.float16), "k": np.ones((900, 2, d), np.float16),
         "v": np.ones((900, 2, d), np.float16), "cu_seqlens_q": np.array([0, 400, 900], np.int32),
         "cu_seqlens_k": np.array([0, 400, 900], np.int32)}
    infos = {n: arrays.describe(a, n) for n, a in x.items()}
    call = attention.VARLEN_FORWARD.check(infos, (500, 500, 0.1, None, False, (-1, -1), 0.0, False, False), (1, 0))
    attention.VARLEN_FORWARD.choose(call, infos, 90, attention.configs.DEFAULT)
    assert call.padded == d and call.kernel_width == width


def test_choose_follows_the_option(monkeypatch):
    from fa2cupy import KernelOptions

    monkeypatch.setattr(pipeline, "device_of", lambda info: 0)
    assert _choose(attention.FORWARD, _fwd(), options=KernelOptions(hopper_pad_headdim=False)) == 96
    assert _choose(attention.FORWARD, _fwd(), d=32, options=KernelOptions(hopper_pad_headdim=True)) == 64
    assert _choose(attention.FORWARD, _fwd(), options=KernelOptions(hopper_forward=False)) == 96
    assert _choose(attention.BACKWARD, _bwd(), options=KernelOptions(hopper_backward=False)) == 96
    # modifier calls (dropout among them) on the mma.sync backward with hopper_backward_mods=False
    off = KernelOptions(hopper_backward_mods=False)
    assert _choose(attention.BACKWARD, _bwd(dropout_p=0.1), options=off) == 96
    assert _choose(attention.BACKWARD, _bwd(softcap=5.0), options=off) == 96
    assert _choose(attention.FORWARD, _fwd(dropout_p=0.1), options=off) == 128  # (a backward option)
    assert _choose(attention.FORWARD, _fwd(dropout_p=0.1), options=KernelOptions(hopper_forward=False)) == 96


def test_cached_calls_slice_what_the_checked_path_slices():
    """A remembered call returns what the checked path returned: where outputs were allocated wider than the
    caller's head dims (the own-width backward's gradients), the fast path slices them too; else it hands the
    allocations over as they are."""
    from fa2cupy import checks

    shape = checks.AttnShape(1, 130, 70, 2, 1, 192, "float16", 128)
    call = type("Call", (), {"shape": shape, "padded": 192, "out_width": 128})()
    made = [np.zeros((1, 130, 2, 192)), np.zeros((1, 70, 1, 192)), np.zeros((1, 70, 1, 192)), np.zeros((1, 2, 130))]
    grads = attention.BACKWARD.cached_result(call, ())(made)
    assert [g.shape for g in grads] == [(1, 130, 2, 192), (1, 70, 1, 192), (1, 70, 1, 128)]
    out = attention.FORWARD.cached_result(call, (0.0, None, False, (-1, -1), 0.0, False, False))(
        [np.zeros((1, 130, 2, 128)), np.zeros((1, 2, 130))])
    assert out.shape == (1, 130, 2, 128)
    square = type("Call", (), {"shape": checks.AttnShape(1, 130, 70, 2, 1, 128, "float16"), "padded": 128,
                               "out_width": 128})()
    assert attention.BACKWARD.cached_result(square, ()) is attention.BACKWARD.result(())
