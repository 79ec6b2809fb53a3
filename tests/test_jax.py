"""fa2cupy.jax: custom_vjp over buffer_callback custom calls.

CPU tests check tracing (shapes, what the backward saves, argument errors) without running a kernel; GPU tests
(marked ``gpu``, skipped without a JAX GPU backend) check eager, jit and grad results against fa2cupy's own
entry points and the float64 reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.experimental.buffer_callback")

import fa2cupy  # noqa: E402
from fa2cupy import reference  # noqa: E402
from fa2cupy.jax import flash_attn_func, flash_attn_varlen_func  # noqa: E402


def _sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


# ============================================================================== CPU: tracing only


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_shapes_traced(dtype):
    q, k = _sds(2, 5, 4, 40, dtype=dtype), _sds(2, 7, 2, 40, dtype=dtype)
    out, lse = jax.eval_shape(lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2],
                              q, k, k)
    assert (out.shape, out.dtype) == ((2, 5, 4, 40), dtype)
    assert (lse.shape, lse.dtype) == ((2, 4, 5), jnp.float32)


def _loss(q, k, v, **kw):
    return (flash_attn_func(q, k, v, **kw).astype(jnp.float32) ** 2).sum()


def test_grad_traced_shapes():
    q, k = _sds(2, 5, 4, 64), _sds(2, 7, 2, 64)
    dq, dk, dv = jax.eval_shape(jax.grad(_loss, argnums=(0, 1, 2)), q, k, k)
    assert (dq.shape, dk.shape, dv.shape) == ((2, 5, 4, 64), (2, 7, 2, 64), (2, 7, 2, 64))
    assert dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16


def test_v_head_dim_of_its_own_traced():
    """q and k of head dim 192, v of 128: out has v's head dim, each gradient its input's shape (padded and
    varlen)."""
    q, k, v = _sds(2, 5, 4, 192), _sds(2, 7, 2, 192), _sds(2, 7, 2, 128)
    assert jax.eval_shape(lambda q, k, v: flash_attn_func(q, k, v, causal=True), q, k, v).shape == (2, 5, 4, 128)
    dq, dk, dv = jax.eval_shape(jax.grad(_loss, argnums=(0, 1, 2)), q, k, v)
    assert (dq.shape, dk.shape, dv.shape) == ((2, 5, 4, 192), (2, 7, 2, 192), (2, 7, 2, 128))
    cu = _sds(3, dtype=jnp.int32)
    out = jax.eval_shape(lambda q, k, v, cu: flash_attn_varlen_func(q, k, v, cu, cu, 4, 4), _sds(8, 4, 192),
                         _sds(8, 2, 192), _sds(8, 2, 128), cu)
    assert out.shape == (8, 4, 128)


def test_backward_reads_only_q_k_v_out_lse():
    zeros = [jnp.zeros(s, jnp.float16) for s in ((1, 9, 4, 32), (1, 3, 2, 32), (1, 3, 2, 32))]
    jaxpr = jax.make_jaxpr(jax.grad(_loss, argnums=(0, 1, 2)))(*zeros)
    text = str(jaxpr)
    assert text.count("buffer_callback[") == 2
    # The backward custom call takes dout, q, k, v, out and lse: nothing of size seqlen_q x seqlen_k.
    bwd = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("jit", "pjit")][-1].params["jaxpr"].jaxpr
    (call,) = [e for e in bwd.eqns if e.primitive.name == "buffer_callback"]
    assert [tuple(x.aval.shape) for x in call.invars] == [(1, 9, 4, 32), (1, 9, 4, 32), (1, 3, 2, 32),
                                                          (1, 3, 2, 32), (1, 9, 4, 32), (1, 4, 9)]


def test_lowers_for_jit_value_and_grad():
    q, k = _sds(1, 16, 2, 64), _sds(1, 16, 2, 64)
    text = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2))).lower(q, k, k).as_text()
    assert text.count("xla_buffer_python_") == 2


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(dropout_p=0.1), ValueError, r"^dropout_p > 0 needs dropout_rng, a JAX PRNG key"),
    (dict(dropout_p=1.0, dropout_rng=jax.random.PRNGKey(0)), ValueError, r"^dropout_p must be in \[0, 1\)"),
    (dict(window_size=(8, -2)), ValueError, r"^window_size must be \(left, right\) with each side >= 0"),
    (dict(softcap=-5.0), ValueError, r"^softcap must be a finite number >= 0"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"^alibi_slopes must have shape"),
    (dict(causal="no"), TypeError, r"^causal must be a bool"),
    (dict(softmax_scale=float("inf")), ValueError, r"^softmax_scale must be None or a finite number"),
])
def test_bad_options(kwargs, error, message):
    q = _sds(1, 4, 4, 64)
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda q: flash_attn_func(q, q, q, **kwargs), q)


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"^q has nheads=3, which is not a multiple of nheads_kv=2"):
        jax.eval_shape(lambda q, k: flash_attn_func(q, k, k), _sds(1, 4, 3, 64), _sds(1, 4, 2, 64))
    with pytest.raises(TypeError, match=r"got float32 for q"):
        jax.eval_shape(lambda q: flash_attn_func(q, q, q), _sds(1, 4, 2, 64, dtype=jnp.float32))


@pytest.mark.parametrize("varlen", [False, True])
def test_dropout_forward_callback_never_builds_probabilities(monkeypatch, varlen):
    # The custom_vjp's forward callback gets (out, lse) from fa2cupy's forward_with_lse entry points; the generic
    # flash_attn_func(return_attn_probs=True) (which with dropout may build seqlen^2 probabilities) is never called.
    # Run on NumPy stand-ins for XLA's buffers, with the stream and the copy into XLA's outputs stubbed.
    import cupy

    import fa2cupy.jax as fj
    from fa2cupy import attention

    def generic(*args, **kwargs):
        raise AssertionError("the custom_vjp forward must not call the generic forward")

    used = []

    def entry(q, *args, dropout_p=0.0, dropout_rng_state=None, **kwargs):
        used.append((dropout_p, dropout_rng_state))
        lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        return np.ones(q.shape, q.dtype), np.ones(lse_shape, np.float32)

    monkeypatch.setattr(fa2cupy, "flash_attn_func", generic)
    monkeypatch.setattr(fa2cupy, "flash_attn_varlen_func", generic)
    monkeypatch.setattr(attention, "forward_with_lse", entry)
    monkeypatch.setattr(attention, "varlen_forward_with_lse", entry)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *args: None)
    monkeypatch.setattr(fj, "_copy_into", lambda dst, src, stream: dst.__setitem__(Ellipsis, src))
    state = np.arange(4, dtype=np.uint32)
    if varlen:
        q, cu = np.zeros((6, 2, 8), np.float16), np.array([0, 2, 6], np.int32)
        extras, lse = (cu, cu, state), np.zeros((2, 6), np.float32)
    else:
        q = np.zeros((1, 6, 2, 8), np.float16)
        extras, lse = (state,), np.zeros((1, 2, 6), np.float32)
    out = np.zeros_like(q)
    opts = (0.3, True, -1, 0, 0.0, False, (4, 4) if varlen else None, 0.1, False, None)
    fj._run_forward((out, lse), q, q, q, *extras, opts)
    assert len(used) == 1 and used[0][0] == 0.1 and used[0][1] is state
    assert out.all() and lse.all()


def test_kernel_options_are_a_static_option_handed_on(monkeypatch):
    # kernel_options travel in the custom calls' static options (hashable) and reach fa2cupy's entry points.
    import cupy

    import fa2cupy.jax as fj
    from fa2cupy import attention
    from fa2cupy.options import KernelOptions

    seen = []

    def entry(q, *args, kernel_options=None, **kwargs):
        seen.append(kernel_options)
        return np.ones(q.shape, q.dtype), np.ones((q.shape[0], q.shape[2], q.shape[1]), np.float32)

    monkeypatch.setattr(attention, "forward_with_lse", entry)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *args: None)
    monkeypatch.setattr(fj, "_copy_into", lambda dst, src, stream: dst.__setitem__(Ellipsis, src))
    mma = KernelOptions(hopper_forward=False)
    q = np.zeros((1, 6, 2, 8), np.float16)
    opts = (0.3, True, -1, 0, 0.0, False, None, 0.0, False, mma)
    fj._run_forward((np.zeros_like(q), np.zeros((1, 2, 6), np.float32)), q, q, q, opts)
    assert seen == [mma]
    traced = jax.make_jaxpr(lambda q: flash_attn_func(q, q, q, kernel_options=mma))(jnp.zeros((1, 4, 2, 64),
                                                                                             jnp.float16))
    assert "buffer_callback" in str(traced)
    with pytest.raises(TypeError, match=r"^kernel_options must be a fa2cupy.KernelOptions or None, got int"):
        jax.eval_shape(lambda q: flash_attn_func(q, q, q, kernel_options=1), _sds(1, 4, 2, 64))


# ============================================================================== GPU


def _jax_gpu_unavailable():
    try:
        return None if jax.devices("gpu") else "needs a JAX GPU backend"
    except RuntimeError as exc:
        return f"needs a JAX GPU backend ({exc})"


needs_jax_gpu = pytest.mark.skipif(_jax_gpu_unavailable() is not None, reason=str(_jax_gpu_unavailable()))
gpu = pytest.mark.gpu



def _qkv(b=2, sq=128, sk=128, h=4, hkv=4, d=64, dtype=jnp.float16, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, sk, hkv, d), jnp.float32).astype(dtype)
    dout = jax.random.normal(keys[3], (b, sq, h, d), jnp.float32).astype(dtype)
    return q, k, v, dout


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _weighted(q, k, v, dout, **kw):
    return (flash_attn_func(q, k, v, **kw).astype(jnp.float32) * dout.astype(jnp.float32)).sum()


@gpu
@needs_jax_gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_forward_eager_and_jit_equal_fa2cupy(dtype, causal):
    q, k, v, _ = _qkv(sq=200, sk=333, h=6, hkv=2, d=64, dtype=dtype)
    want, want_lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    jitted = jax.jit(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2])
    out_j, lse_j = jitted(q, k, v)
    out_j2, _ = jitted(q, k, v)  # a second execution (replay of a captured command buffer, if XLA made one)
    for got in (out, out_j, out_j2):
        assert got.dtype == dtype and np.array_equal(np.asarray(got), np.asarray(want))
    for got in (lse, lse_j):
        assert np.array_equal(np.asarray(got), np.asarray(want_lse))


@gpu
@needs_jax_gpu
def test_gpu_qkvpacked_grad_is_the_stacked_unpacked_grad():
    from fa2cupy.jax import flash_attn_qkvpacked_func

    q, k, v, dout = _qkv(sq=150, sk=150, h=4, hkv=4, d=64)
    qkv = jnp.stack([q, k, v], axis=2)

    def packed_loss(qkv, dout):
        return (flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True).astype(jnp.float32)
                * dout.astype(jnp.float32)).sum()

    got = jax.jit(jax.grad(packed_loss))(qkv, dout)
    want = jax.grad(_weighted, argnums=(0, 1, 2))(q, k, v, dout, causal=True, deterministic=True)
    assert got.shape == qkv.shape
    assert np.array_equal(np.asarray(got), np.asarray(jnp.stack(want, axis=2)))


@gpu
@needs_jax_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_window_grad_under_jit_equals_flash_attn_backward(causal):
    q, k, v, dout = _qkv(sq=300, sk=420, h=4, hkv=2, d=64)
    w = (70, 30)
    grad = jax.jit(jax.grad(_weighted, argnums=(0, 1, 2)), static_argnames=("causal", "deterministic", "window_size"))
    got = grad(q, k, v, dout, causal=causal, deterministic=True, window_size=w)
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, window_size=w, return_attn_probs=True)
    want = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, window_size=w, deterministic=True)
    for g, wnt in zip(got, want):
        assert np.array_equal(np.asarray(g), np.asarray(wnt))


def _assert_close_to_reference(grads, dout, q, k, v, out, softmax_scale, causal):
    # The shared backward rule (fa2cupy.testing.gradient_errors), as for the torch wrapper.
    from fa2cupy import testing

    dtype = np.dtype(q.dtype).name
    for name, err, bound in testing.gradient_errors([_f64(g) for g in grads], _f64(dout), _f64(q), _f64(k),
                                                    _f64(v), _f64(out), dtype, softmax_scale, causal):
        assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


@gpu
@needs_jax_gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_grad_under_jit_equals_flash_attn_backward(dtype, causal):
    q, k, v, dout = _qkv(sq=200, sk=333, h=6, hkv=2, d=64, dtype=dtype)  # GQA, sq != sk
    grad = jax.jit(jax.grad(_weighted, argnums=(0, 1, 2)), static_argnames=("causal", "deterministic"))
    got = grad(q, k, v, dout, causal=causal, deterministic=True)
    got_again = grad(q, k, v, dout, causal=causal, deterministic=True)
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    want = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    for g, g2, w in zip(got, got_again, want):
        assert g.dtype == dtype
        assert np.array_equal(np.asarray(g), np.asarray(w))
        assert np.array_equal(np.asarray(g2), np.asarray(w))
    _assert_close_to_reference(got, dout, q, k, v, out, None, causal)


@gpu
@needs_jax_gpu
@pytest.mark.parametrize("sq,sk,h,hkv,d", [(1, 1, 1, 1, 8), (77, 513, 8, 1, 128), (513, 77, 4, 2, 96),
                                           (130, 130, 3, 3, 40)])
def test_gpu_value_and_grad_against_reference(sq, sk, h, hkv, d):
    q, k, v, dout = _qkv(b=1, sq=sq, sk=sk, h=h, hkv=hkv, d=d, dtype=jnp.float16, seed=sq + sk)
    scale = 0.7 / math.sqrt(d)
    f = jax.jit(jax.value_and_grad(lambda q, k, v: _weighted(q, k, v, dout, causal=True, softmax_scale=scale),
                                   argnums=(0, 1, 2)))
    value, grads = f(q, k, v)
    out64, _ = reference.attention_ref(_f64(q), _f64(k), _f64(v), scale, True)
    terms = out64 * _f64(dout)
    assert abs(float(value) - terms.sum()) <= 1e-2 * np.abs(terms).sum() + 1e-3
    out = fa2cupy.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    _assert_close_to_reference(grads, dout, q, k, v, out, scale, True)


@gpu
@needs_jax_gpu
def test_gpu_eager_grad_and_deterministic_repeats():
    q, k, v, dout = _qkv(sq=256, sk=256, h=8, hkv=2, d=128, dtype=jnp.bfloat16)
    grad = jax.grad(_weighted, argnums=(0, 1, 2))
    first = grad(q, k, v, dout, causal=True, deterministic=True)
    for _ in range(2):
        again = grad(q, k, v, dout, causal=True, deterministic=True)
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, again))


@gpu
@needs_jax_gpu
def test_gpu_lse_gets_no_gradient():
    q, k, v, _ = _qkv(sq=64, sk=64, h=2, hkv=2, d=64)
    g = jax.grad(lambda q: flash_attn_func(q, k, v, return_attn_probs=True)[1].sum())(q)
    assert not np.asarray(g).any()


# ============================================================================== softcap, ALiBi, varlen


def test_varlen_traced_shapes_and_grad():
    q, k = _sds(30, 4, 64), _sds(40, 2, 64)
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)
    out, lse = jax.eval_shape(
        lambda q, k, v, cq, ck: flash_attn_varlen_func(q, k, v, cq, ck, 17, 25, causal=True,
                                                       return_attn_probs=True)[:2], q, k, k, cu, cu)
    assert out.shape == (30, 4, 64) and lse.shape == (4, 30) and lse.dtype == jnp.float32

    def loss(q, k, v, cq, ck):
        return (flash_attn_varlen_func(q, k, v, cq, ck, 17, 25).astype(jnp.float32) ** 2).sum()

    dq, dk, dv = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, cu, cu)
    assert (dq.shape, dk.shape, dv.shape) == ((30, 4, 64), (40, 2, 64), (40, 2, 64))


def test_paged_varlen_traced_shapes_grad_and_checks():
    from fa2cupy.jax import flash_attn_varlen_func

    q, pages = _sds(30, 4, 64), _sds(9, 16, 2, 64)
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)
    table = jax.ShapeDtypeStruct((3, 4), jnp.int32)

    def loss(q, k, v, cq, ck, t):
        return (flash_attn_varlen_func(q, k, v, cq, ck, 17, 64, causal=True, block_table=t).astype(jnp.float32)
                ** 2).sum()

    dq, dk, dv = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, pages, pages, cu, cu, table)
    assert (dq.shape, dk.shape, dv.shape) == ((30, 4, 64), (9, 16, 2, 64), (9, 16, 2, 64))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, pages, pages, cu, cu, table).as_text()
    assert text.count("xla_buffer_python_") == 2
    with pytest.raises(ValueError, match=r"^max_seqlen_k = 65 exceeds what block_table can address"):
        jax.eval_shape(lambda q, k, cq, t: flash_attn_varlen_func(q, k, k, cq, cq, 17, 65, block_table=t),
                       q, pages, cu, table)


def test_alibi_traced_and_checked():
    q = _sds(2, 5, 4, 64)
    slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
    jax.eval_shape(jax.grad(lambda q, s: _loss(q, q, q, alibi_slopes=s)), q, slopes)
    with pytest.raises(ValueError, match="^alibi_slopes must have shape"):
        jax.eval_shape(lambda q, s: flash_attn_func(q, q, q, alibi_slopes=s), q, jax.ShapeDtypeStruct((3,), jnp.float32))


@gpu
@needs_jax_gpu
def test_gpu_softcap_alibi_grad_under_jit_equals_fa2cupy():
    q, k, v, dout = _qkv(sq=150, sk=190, h=4, hkv=2, d=64)
    slopes = jnp.asarray(np.linspace(0.05, 0.4, 4), jnp.float32)
    kw = dict(causal=True, softcap=3.0, deterministic=True)
    got = jax.jit(jax.grad(lambda q, k, v, s: _weighted(q, k, v, dout, alibi_slopes=s, **kw), argnums=(0, 1, 2)))(
        q, k, v, slopes)
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, causal=True,
                                          softcap=3.0)
    want = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, alibi_slopes=slopes, **kw)
    for g, wnt in zip(got, want):
        assert np.array_equal(np.asarray(g), np.asarray(wnt))


@gpu
@needs_jax_gpu
def test_gpu_varlen_grad_under_jit_against_reference():
    from fa2cupy.jax import flash_attn_varlen_func

    cu = np.array([0, 50, 50, 170], np.int32)
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q, k, v, dout = (jax.random.normal(kk, (175, 4, 64), jnp.float32).astype(jnp.float16) for kk in keys)

    def loss(q, k, v, cu):
        out = flash_attn_varlen_func(q, k, v, cu, cu, 120, 120, causal=True, deterministic=True)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, jnp.asarray(cu))
    out = flash_attn_varlen_func(q, k, v, jnp.asarray(cu), jnp.asarray(cu), 120, 120, causal=True)
    refs = reference.attention_ref_varlen_backward(_f64(dout), _f64(q), _f64(k), _f64(v), cu, cu, causal=True,
                                                   out=_f64(out))
    for g, r in zip((dq, dk, dv), refs):
        g = _f64(g)
        assert np.all(g[170:] == 0), "rows outside every sequence get zero gradients"
        assert np.abs(g[:170] - r[:170]).max() <= 16 * 2**-11 * np.abs(r).max() + 1e-3


@gpu
@needs_jax_gpu
def test_gpu_dropout_grad_under_jit_equals_fa2cupy_with_the_same_seed():
    """The JAX key's four words are the kernels' seed and offset: fa2cupy with those ints gives the same bits."""
    q, k, v, dout = _qkv(sq=130, sk=170, h=4, hkv=2, d=64)
    key = jax.random.PRNGKey(42)
    kw = dict(causal=True, deterministic=True, dropout_p=0.25)
    out = jax.jit(lambda q, k, v, key: flash_attn_func(q, k, v, dropout_rng=key, **kw))(q, k, v, key)
    grads = jax.jit(jax.grad(lambda q, k, v, key: _weighted(q, k, v, dout, dropout_rng=key, **kw),
                             argnums=(0, 1, 2)))(q, k, v, key)
    words = [int(w) for w in np.asarray(jax.random.bits(key, (4,), jnp.uint32))]
    seed, offset = words[0] | words[1] << 32, words[2] | words[3] << 32
    want, lse, _ = fa2cupy.flash_attn_func(q, k, v, return_attn_probs=True, dropout_seed=seed, dropout_offset=offset,
                                           **kw)
    assert np.array_equal(np.asarray(out), np.asarray(want))
    want_g = fa2cupy.flash_attn_backward(dout, q, k, v, want, lse, dropout_seed=seed, dropout_offset=offset, **kw)
    for g, w in zip(grads, want_g):
        assert np.array_equal(np.asarray(g), np.asarray(w))
    other = flash_attn_func(q, k, v, dropout_rng=jax.random.PRNGKey(43), **kw)
    assert not np.array_equal(np.asarray(other), np.asarray(out))
