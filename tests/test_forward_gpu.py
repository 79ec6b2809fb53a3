"""Forward pass on a real GPU: properties against the float64 reference, interop, errors.

Error bound for ``out`` (fp16: u = 2^-11, bf16: u = 2^-8, unit roundoff):
the reference sees exactly the rounded inputs the kernel sees, so input rounding
is no error. Inside the kernel S = Q K^T is accumulated in fp32 and the
softmax runs in fp32; those errors are O(d * 2^-24) relative, far below u. The
two low-precision roundings are
  1. P = exp(s - m) in (0, 1] is rounded to the input dtype before the P V
     product: each weight gets a relative error <= u, so the row's output moves by
     at most u * sum_j p_j |v_j| <= u * max|v| (the normaliser l is a sum of
     the fp32 weights; if it were summed from the rounded ones the output would
     still be a convex combination off by <= 2u * max|v|);
  2. the final output is rounded to the dtype: <= u * |out| <= u * max|v|.
So |out - ref| <= 3u * max|v| + fp32 noise; we allow 4u * max|v| + 1e-6, which
is a factor ~2 tighter than any real bug (a dropped block, wrong scale or
wrong mask moves outputs by O(max|v|)).

lse is computed in fp32 from fp32 weights: allowed |lse - ref| <= 1e-3 * (1 + |ref|).
Rows that see no key (causal with seqlen_q > seqlen_k) must give out == 0 exactly
and lse == +inf, whatever the poison left there.

``KernelOptions(debug_poison=True)`` is switched on for every test here (the calls go
through gpu_helpers.fa2cupy_module): the library then fills out and lse with NaN
before the launch, so any element the kernel fails to write shows up as NaN.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from fa2cupy.reference import attention_ref
from gpu_helpers import (
    UNIT_ROUNDOFF, checked_calls, cupy_module as _cupy, debug_poison, fa2cupy_module, kernel_options,
    np_dtype as _np_dtype, torch_cuda as _torch)

pytestmark = pytest.mark.gpu


SEQLENS = [1, 2, 15, 16, 17, 63, 64, 65, 97, 127, 128, 129, 255, 256, 257, 383, 1000]
COMMON_HEADDIMS = [32, 64, 96, 128, 160, 192, 224, 256]
ODD_HEADDIMS = [1, 3, 8, 40, 72, 80, 100, 7, 33, 250]
HEAD_GROUPS = [(1, 1), (2, 2), (4, 4), (3, 1), (4, 1), (8, 1), (4, 2), (6, 3), (8, 2), (12, 4), (16, 4)]


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    # Module scope: Hypothesis rejects function-scoped fixtures around @given, and
    # the switch is the same for every example anyway.
    with debug_poison():
        yield


def _flash_attn_func():
    return fa2cupy_module().flash_attn_func




def make_input(rng, shape, dtype, transposed=False):
    """A random-normal CuPy array of ``shape`` (b, s, h, d) in ``dtype``.

    transposed: store it as (b, h, s, d) and return the (b, s, h, d) view, so
    batch/seq/head strides are not the contiguous ones.
    """
    cp = _cupy()
    b, s, h, d = shape
    store = (b, h, s, d) if transposed else shape
    host = rng.standard_normal(store, dtype=np.float32).astype(_np_dtype(dtype))
    x = cp.asarray(host)
    return x.transpose(0, 2, 1, 3) if transposed else x


def check_against_reference(q, k, v, out, lse, softmax_scale, causal, dtype, window_size=(-1, -1)):
    """Assert out/lse (CuPy) against attention_ref on the same rounded inputs."""
    cp = _cupy()
    qh, kh, vh = (cp.asnumpy(x) for x in (q, k, v))
    ref_out, ref_lse = attention_ref(qh, kh, vh, softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    out_h = cp.asnumpy(out).astype(np.float64)
    assert out_h.shape == ref_out.shape
    assert not np.isnan(out_h).any(), "out has NaN: the kernel left poisoned elements unwritten"

    u = UNIT_ROUNDOFF[dtype]
    vmax = float(np.abs(vh.astype(np.float64)).max())
    tol = 4 * u * vmax + 1e-6
    err = np.abs(out_h - ref_out)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    if currently_in_test_context():  # note() only works inside @given
        note(f"max|out-ref|={err.max():.3e} at {worst}, tol={tol:.3e}")
    assert err.max() <= tol, f"max|out-ref| = {err.max():.3e} at {worst} > {tol:.3e}"

    b, sq, h, _ = q.shape
    dead = np.isinf(ref_lse)  # (b, h, sq): rows that see no key
    if dead.any():
        dead_out = dead.transpose(0, 2, 1)  # (b, sq, h)
        assert np.all(out_h[dead_out] == 0.0), "rows with no visible key must be exactly 0"

    if lse is not None:
        assert lse.dtype == cp.float32
        assert lse.shape == (b, h, sq)
        lse_h = cp.asnumpy(lse).astype(np.float64)
        assert not np.isnan(lse_h).any(), "lse has NaN: poisoned elements left unwritten"
        assert np.all(lse_h[dead] == np.inf), "rows with no visible key must have lse == +inf"
        live = ~dead
        lerr = np.abs(lse_h[live] - ref_lse[live])
        assert np.all(lerr <= 1e-3 * (1 + np.abs(ref_lse[live]))), f"max|lse-ref| = {lerr.max():.3e}"


@st.composite
def cases(draw):
    seqlens = st.sampled_from(SEQLENS)
    headdim = draw(
        st.one_of(
            st.sampled_from(COMMON_HEADDIMS),
            st.sampled_from(COMMON_HEADDIMS),  # twice: weight the common sizes
            st.sampled_from(ODD_HEADDIMS),
            st.integers(1, 256),
        )
    )
    nheads, nheads_kv = draw(st.sampled_from(HEAD_GROUPS))
    return dict(
        batch=draw(st.integers(1, 3)),
        seqlen_q=draw(seqlens),
        seqlen_k=draw(seqlens),
        nheads=nheads,
        nheads_kv=nheads_kv,
        headdim=headdim,
        causal=draw(st.booleans()),
        # Mostly no window; otherwise each side unlimited, 0, small, or tile-sized (rows with no key included).
        window_size=draw(st.one_of(st.just((-1, -1)), st.just((-1, -1)),
                                   st.tuples(*[st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, 300))] * 2))),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        # Positive scales here; negative ones have their own test below so that a
        # failure there does not hide everything else from the search.
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.01, 1.5))),
        transposed=draw(st.sampled_from([False, False, True])),
        return_lse=draw(st.booleans()),
        # head dims without a Hopper row: padded up to the Hopper kernels (default) or the mma.sync kernels (False)
        hopper_pad=draw(st.sampled_from([None, None, False])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def run_case(c):
    cp = _cupy()
    rng = np.random.default_rng(c["seed"])
    b, sq, sk = c["batch"], c["seqlen_q"], c["seqlen_k"]
    h, hkv, d, dtype = c["nheads"], c["nheads_kv"], c["headdim"], c["dtype"]
    q = make_input(rng, (b, sq, h, d), dtype, c["transposed"])
    k = make_input(rng, (b, sk, hkv, d), dtype, c["transposed"])
    v = make_input(rng, (b, sk, hkv, d), dtype, c["transposed"])
    fn = _flash_attn_func()
    window = c.get("window_size", (-1, -1))
    with kernel_options(hopper_pad_headdim=c.get("hopper_pad")):
        res = fn(q, k, v, softmax_scale=c["softmax_scale"], causal=c["causal"], window_size=window,
                 return_attn_probs=c["return_lse"])
    if c["return_lse"]:
        assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
        out, lse = res[0], res[1]
    else:
        out, lse = res, None
    assert isinstance(out, cp.ndarray)
    assert out.shape == q.shape and out.dtype == q.dtype
    check_against_reference(q, k, v, out, lse, c["softmax_scale"], c["causal"], dtype, window)


@given(cases())
def test_matches_reference(case):
    note(repr(case))
    run_case(case)


# Fixed cases first in the run: quick, readable failures before Hypothesis digs.
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "b,sq,sk,h,hkv,d,causal",
    [
        (1, 1, 1, 1, 1, 64, False),
        (2, 128, 128, 4, 4, 64, False),
        (2, 128, 128, 4, 4, 128, True),
        (1, 65, 257, 8, 2, 96, True),  # sq < sk: bottom-right causal
        (1, 257, 65, 8, 1, 128, True),  # sq > sk: rows with no key
        (3, 97, 383, 6, 3, 256, False),
        (1, 17, 1000, 2, 1, 40, True),
        (1, 63, 63, 3, 1, 3, False),
    ],
)
def test_fixed_cases(dtype, b, sq, sk, h, hkv, d, causal):
    run_case(dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hkv, headdim=d,
                  causal=causal, dtype=dtype, softmax_scale=None, transposed=False,
                  return_lse=True, seed=sq * 1000 + sk))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "sq,sk,d,window",
    [
        (300, 300, 64, (32, 0)),  # local causal band
        (500, 700, 128, (100, 50)),  # sq < sk, both sides limited
        (700, 300, 64, (0, 0)),  # sq > sk: only the diagonal key; rows with none
        (257, 1000, 96, (-1, 17)),  # left unlimited
        (129, 129, 256, (5, -1)),  # right unlimited
        (64, 64, 32, (200, 200)),  # window wider than the sequence
        (1000, 1000, 128, (600, 0)),  # the windows of 5 of 8 query tiles are cut short at key 0
    ],
)
def test_sliding_window(dtype, causal, sq, sk, d, window):
    run_case(dict(batch=2, seqlen_q=sq, seqlen_k=sk, nheads=4, nheads_kv=2, headdim=d, causal=causal,
                  window_size=window, dtype=dtype, softmax_scale=None, transposed=False, return_lse=True,
                  seed=sq + sk + d))


@pytest.mark.parametrize("scale", [-1.0, -0.125, -0.01])
def test_negative_softmax_scale(scale):
    # flash-attn takes any float scale; a negative one flips which score is the
    # row maximum, so a kernel that tracks the max of unscaled scores gets NaN/inf.
    run_case(dict(batch=2, seqlen_q=70, seqlen_k=130, nheads=4, nheads_kv=2, headdim=64,
                  causal=True, dtype="float16", softmax_scale=scale, transposed=False,
                  return_lse=True, seed=5))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_deterministic(dtype):
    cp = _cupy()
    rng = np.random.default_rng(11)
    q = make_input(rng, (2, 300, 8, 128), dtype)
    k = make_input(rng, (2, 500, 2, 128), dtype)
    v = make_input(rng, (2, 500, 2, 128), dtype)
    fn = _flash_attn_func()
    o1, l1, _ = fn(q, k, v, causal=True, return_attn_probs=True)
    o2, l2, _ = fn(q, k, v, causal=True, return_attn_probs=True)
    assert cp.array_equal(o1.view(cp.uint16), o2.view(cp.uint16))
    assert cp.array_equal(l1.view(cp.uint32), l2.view(cp.uint32))


def test_cupy_non_default_stream():
    cp = _cupy()
    rng = np.random.default_rng(12)
    q, k, v = (make_input(rng, (1, 256, 4, 64), "float16") for _ in range(3))
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        out = _flash_attn_func()(q, k, v, causal=True)
        total = float(out.astype(cp.float32).sum())  # syncs s
    assert np.isfinite(total)
    check_against_reference(q, k, v, out, None, None, True, "float16")


# ------------------------------------------------------------------ interop


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_on_non_default_stream(dtype):
    torch = _torch()
    cp = _cupy()
    tdt = getattr(torch, dtype)
    dev = torch.device("cuda", torch.cuda.current_device())
    shape = (2, 200, 4, 64)
    final = [torch.randn(shape, device=dev).to(tdt) for _ in range(3)]
    torch.cuda.synchronize()
    s = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(s):
        # Stale contents, then a long sleep on s, then the real values: a kernel
        # that does not wait for s would read the stale (all -1) inputs.
        q, k, v = (torch.full(shape, -1.0, device=dev, dtype=tdt) for _ in range(3))
        torch.cuda._sleep(200_000_000)
        for dst, src in zip((q, k, v), final):
            dst.copy_(src)
        out, lse, none = _flash_attn_func()(q, k, v, causal=True, return_attn_probs=True)
        out_copy = out.clone()  # consumer on s must see the finished result
    s.synchronize()
    assert isinstance(out, torch.Tensor) and out.device == dev and out.dtype == tdt
    assert out.shape == q.shape and none is None
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    assert torch.equal(out, out_copy)
    as_cp = [cp.from_dlpack(t) for t in final]
    check_against_reference(*as_cp, cp.from_dlpack(out), cp.from_dlpack(lse), None, True, dtype)


def test_torch_transposed_view():
    torch = _torch()
    cp = _cupy()
    dev = torch.device("cuda", torch.cuda.current_device())
    b, h, s, d = 2, 4, 129, 96
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    out = _flash_attn_func()(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    torch.cuda.synchronize()
    check_against_reference(*(cp.from_dlpack(t) for t in (q, k, v)), cp.from_dlpack(out),
                            None, None, False, "float16")


def test_jax_arrays():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    cp = _cupy()
    jnp = jax.numpy
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (1, 130, 4, 64)
    q, k, v = (jax.device_put(jax.random.normal(kk, shape, dtype=jnp.bfloat16), gpu) for kk in keys)
    out, lse, _ = _flash_attn_func()(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.shape == shape and out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    host = [np.asarray(x) for x in (q, k, v, out, lse)]
    check_against_reference(*(cp.asarray(x) for x in host), None, True, "bfloat16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numpy_arrays(dtype):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    cp = _cupy()
    rng = np.random.default_rng(13)
    npdt = _np_dtype(dtype)
    q, k, v = (rng.standard_normal((2, 70, 2, 32), dtype=np.float32).astype(npdt) for _ in range(3))
    out, lse, _ = _flash_attn_func()(q, k, v, return_attn_probs=True)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.dtype == npdt and out.shape == q.shape
    check_against_reference(*(cp.asarray(x) for x in (q, k, v, out, lse)), None, False, dtype)


# ------------------------------------------------------------------ errors needing a GPU


def test_host_numpy_mixed_with_cupy():
    cp = _cupy()
    q = cp.ones((1, 4, 1, 8), dtype=cp.float16)
    k = np.ones((1, 4, 1, 8), dtype=np.float16)
    with pytest.raises(ValueError, match=r"^k is a host NumPy array but q is a CuPy array"):
        _flash_attn_func()(q, k, q)


def test_arrays_on_different_devices():
    cp = _cupy()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q = cp.ones((1, 4, 1, 8), dtype=cp.float16)
    with cp.cuda.Device(1):
        k = cp.ones((1, 4, 1, 8), dtype=cp.float16)
    with pytest.raises(ValueError, match=r"^k is on cuda:1 but q is on cuda:0"):
        _flash_attn_func()(q, k, q)


def test_float32_rejected():
    cp = _cupy()
    q = cp.ones((1, 4, 1, 8), dtype=cp.float32)
    with pytest.raises(TypeError, match=r"got float32 for q"):
        _flash_attn_func()(q, q, q)


@pytest.fixture
def no_poison():
    # The cached fast path is only taken when the poison hook is off (the hook needs the checked path).
    # Stale outputs still cannot pass: each call below uses new data, so an element the kernel failed to
    # write would hold the previous call's result and miss the new reference.
    with debug_poison(False):
        yield


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_cached_fast_path_matches_reference(framework, no_poison):
    cp = _cupy()
    rng = np.random.default_rng(7)
    shape, dtype = (2, 193, 4, 128), "bfloat16"
    with checked_calls() as checked:
        for call in range(3):
            q, k, v = (make_input(rng, shape, dtype, transposed=True) for _ in range(3))
            if framework == "torch":
                torch = _torch()
                out, lse, _ = _flash_attn_func()(*(torch.from_dlpack(x) for x in (q, k, v)), causal=True,
                                                return_attn_probs=True)
                assert isinstance(out, torch.Tensor)
                out, lse = cp.from_dlpack(out), cp.from_dlpack(lse)
            else:
                out, lse, _ = _flash_attn_func()(q, k, v, causal=True, return_attn_probs=True)
            cp.cuda.runtime.deviceSynchronize()
            check_against_reference(q, k, v, out, lse, None, True, dtype)
    assert checked.count("fwd") <= 1  # planned by the first call at most, reused by the later ones


def test_torch_cuda_graph_capture(no_poison):
    torch = _torch()
    cp = _cupy()
    dev = torch.device("cuda", torch.cuda.current_device())
    shape = (1, 300, 4, 64)
    static = [torch.randn(shape, device=dev, dtype=torch.float16) for _ in range(3)]
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up outside capture: compile and plan
        _flash_attn_func()(*static, causal=True)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _flash_attn_func()(*static, causal=True)
    for _ in range(2):
        fresh = [torch.randn(shape, device=dev, dtype=torch.float16) for _ in range(3)]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(*(cp.from_dlpack(t) for t in fresh), cp.from_dlpack(out), None, None, True,
                                "float16")


def test_torch_requires_grad_points_to_autograd_wrapper():
    torch = _torch()
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    with pytest.raises(TypeError, match="fa2cupy.torch.flash_attn_func"):
        _flash_attn_func()(q, q, q)
    with torch.no_grad():  # allowed: nothing to record
        assert _flash_attn_func()(q, q, q).shape == q.shape
