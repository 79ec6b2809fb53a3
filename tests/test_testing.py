"""CPU tests of fa2cupy.testing: the bounds' values, the reference gradients for a given out, the bound against a
model of the kernel's roundings, and the assertions' verdicts and messages."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest

from fa2cupy import arrays
from fa2cupy import testing as T
from fa2cupy.reference import attention_ref, attention_ref_varlen
from source_tree import python_without_cupy


def test_imports_without_cupy():
    res = python_without_cupy("import numpy as np, fa2cupy.testing as T; "
                              "print(T.out_bound('bf16', 2.0), T.to_numpy64(np.ones(2, np.float16)).dtype)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(2 ** -6), "float64"]


# ----------------------------------------------------------------------------- dtypes, host copies


def test_dtype_name_spellings():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for fp16 in ("fp16", "float16", "half", "FP16", "torch.float16", np.float16, np.dtype("float16")):
        assert T.dtype_name(fp16) == "fp16" and T.unit_roundoff(fp16) == 2.0 ** -11
    for bf16 in ("bf16", "bfloat16", "torch.bfloat16", ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)):
        assert T.dtype_name(bf16) == "bf16" and T.unit_roundoff(bf16) == 2.0 ** -8
    assert T.UNIT_ROUNDOFF["float16"] == T.UNIT_ROUNDOFF["fp16"] and T.UNIT_ROUNDOFF["bfloat16"] == 2.0 ** -8
    for bad in ("fp32", np.float32, "int8", None):
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            T.dtype_name(bad)


def test_dtype_name_of_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert T.dtype_name(torch.float16) == "fp16" and T.dtype_name(torch.bfloat16) == "bf16"
    with pytest.raises(ValueError, match="torch.float32"):
        T.dtype_name(torch.float32)


def test_to_numpy64_numpy_input():
    x = np.arange(6, dtype=np.float16).reshape(2, 3)
    out = T.to_numpy64(x)
    assert out.dtype == np.float64 and out.shape == (2, 3)


def test_to_numpy64_bfloat16_and_frameworks():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([1.0, -2.5, 3.0e38, np.inf], np.float32)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(T.to_numpy64(x.astype(ml_dtypes.bfloat16)), want)
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(T.to_numpy64(torch.from_numpy(x).to(torch.bfloat16)), want)
    with pytest.raises(TypeError, match="cannot convert"):
        T.to_numpy64(object())


def test_to_numpy64_jax():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.asarray([1.0, 2.0, 3.0], dtype=jnp.bfloat16)
    out = T.to_numpy64(x)
    assert out.dtype == np.float64 and out.tolist() == [1.0, 2.0, 3.0]


# ----------------------------------------------------------------------------- bounds


def test_out_and_lse_bounds():
    assert T.out_bound("bf16", 0.5) == 2 ** -7
    assert T.out_bound("float16", 4.0) == 4 * 2 ** -10
    np.testing.assert_allclose(T.lse_bound(np.array([0.5, -20.0])), [1e-3, 2e-2])


def test_gradient_bound_and_floor():
    assert T.gradient_bound("fp16", 2.0) == 16 * 2 ** -11 * 2.0
    assert T.gradient_bound("bfloat16", 1.0, 1e-6) == 16 * 2 ** -8 + 1e-6
    assert T.gradient_bound("bf16", 0.0) == 0.0
    assert T.gradient_floor(0.125, 64, 4.0, 4.0, 4.0) == 2 ** -20 * 0.125 * 64 * 64
    assert T.gradient_floor(-0.5, 8, 1, 1, 1) == T.gradient_floor(0.5, 8, 1, 1, 1)
    with pytest.raises(ValueError):
        T.gradient_bound("fp32", 1.0)


def _round(x, dtype):
    """float32 values rounded to fp16 / bf16 (nearest even), as float64."""
    x = np.asarray(x, np.float32)
    if T.dtype_name(dtype) == "fp16":
        return x.astype(np.float16).astype(np.float64)
    return arrays.bf16_bits_to_float(np, arrays.bf16_bits(np, x)).astype(np.float64)


def _rounded(rng, shape, dtype):
    return _round(rng.standard_normal(shape, dtype=np.float32), dtype)


def _direct_gradients(dout, q, k, v, out, scale, causal):
    """Float64 gradients with D = rowsum(dout * out) for the given out, one head at a time."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    vis = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq) if causal else np.ones((sq, sk), bool)
    for bi in range(b):
        for hi in range(h):
            kh, vh, qh, do = k[bi, :, hi // g], v[bi, :, hi // g], q[bi, :, hi], dout[bi, :, hi]
            s = np.where(vis, scale * qh @ kh.T, -np.inf)
            m = s.max(1, keepdims=True)
            live = np.isfinite(m)
            e = np.exp(s - np.where(live, m, 0))
            p = np.where(live, e / np.where(live, e.sum(1, keepdims=True), 1), 0)
            D = (do * out[bi, :, hi]).sum(1, keepdims=True)
            ds = p * (do @ vh.T - D)
            dq[bi, :, hi] = scale * ds @ kh
            dk[bi, :, hi // g] += scale * ds.T @ qh
            dv[bi, :, hi // g] += p.T @ do
    return dq, dk, dv


@pytest.mark.parametrize("causal,sq,sk,scale", [(False, 7, 11, None), (True, 13, 6, 0.9), (True, 5, 9, 1.4)])
def test_reference_gradients_use_the_given_out(causal, sq, sk, scale):
    from fa2cupy.reference import attention_ref

    rng = np.random.default_rng(sq)
    b, h, hkv, d = 2, 4, 2, 8
    q, dout = (_rounded(rng, (b, sq, h, d), "bf16") for _ in range(2))
    k, v = (_rounded(rng, (b, sk, hkv, d), "bf16") for _ in range(2))
    exact, _ = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
    out = _round(exact, "bf16")      # a rounded "kernel" out
    got = T.reference_gradients(dout, q, k, v, out, softmax_scale=scale, causal=causal)
    want = _direct_gradients(dout, q, k, v, out, d ** -0.5 if scale is None else scale, causal)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    # With the exact out there is nothing to correct: attention_ref_backward itself.
    from fa2cupy.reference import attention_ref_backward

    for g, w in zip(T.reference_gradients(dout, q, k, v, exact, scale, causal),
                    attention_ref_backward(dout, q, k, v, scale, causal)):
        np.testing.assert_array_equal(g, w)


def _emulate_kernel(dout, q, k, v, scale, causal, dtype):
    """NumPy model of the FA2 backward's roundings: out from P rounded to dtype then rounded;
    P -> dtype before dV; dS -> dtype before dQ/dK; fp32 accumulators; outputs -> dtype."""
    def rnd(x):
        return _round(x, dtype)

    def f32(x):
        return np.asarray(x, np.float32).astype(np.float64)

    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    vis = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq) if causal else np.ones((sq, sk), bool)
    out = np.zeros_like(q)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for bi in range(b):
        for hi in range(h):
            kh, vh, qh, do = k[bi, :, hi // g], v[bi, :, hi // g], q[bi, :, hi], dout[bi, :, hi]
            s = f32(np.where(vis, scale * qh @ kh.T, -np.inf))
            m = s.max(1, keepdims=True)
            live = np.isfinite(m)
            e = f32(np.exp(s - np.where(live, m, 0)))
            den = np.where(live, e.sum(1, keepdims=True), 1)
            lse = f32(np.where(live, m, 0) + np.log(den))
            o = np.where(live, rnd(rnd(e) @ vh / den), 0)
            out[bi, :, hi] = o
            p = f32(np.where(live, np.exp(s - lse), 0))
            D = f32((do * o).sum(1, keepdims=True))
            ds = rnd(p * (f32(do @ vh.T) - D))
            dq[bi, :, hi] = rnd(scale * ds @ kh)
            dk[bi, :, hi // g] += f32(scale * ds.T @ qh)
            dv[bi, :, hi // g] += f32(rnd(p).T @ do)
    return out, (dq, rnd(dk), rnd(dv))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("seed", range(4))
def test_gradient_bound_covers_emulated_kernel_and_rejects_wrong_mask(dtype, seed):
    """The bound holds for a model of the kernel's roundings, and a flipped causal mask breaks it."""
    from fa2cupy.reference import attention_ref_backward

    rng = np.random.default_rng(seed)
    sq, sk, d = [(1, 40, 40), (33, 17, 72), (64, 65, 8), (20, 20, 128)][seed]
    scale = [1.2, None, 0.5, 0.05][seed]
    b, h, hkv = 1, 4, 2
    q, dout = (_rounded(rng, (b, sq, h, d), dtype) for _ in range(2))
    k, v = (_rounded(rng, (b, sk, hkv, d), dtype) for _ in range(2))
    sc = d ** -0.5 if scale is None else scale
    out, got = _emulate_kernel(dout, q, k, v, sc, True, dtype)
    ref = T.reference_gradients(dout, q, k, v, out, softmax_scale=scale, causal=True)
    floor = T.gradient_floor(sc, d, np.abs(dout).max(), np.abs(v).max(), max(np.abs(q).max(), np.abs(k).max()))
    for g, r in zip(got, ref):
        err = np.abs(g - r).max()
        assert err <= T.gradient_bound(dtype, np.abs(r).max(), floor) / 2     # room to spare
    if sq > 1:   # with one query the bottom-right causal mask sees every key: nothing flips
        wrong = attention_ref_backward(dout, q, k, v, softmax_scale=scale, causal=False)
        assert any(np.abs(g - w).max() > T.gradient_bound(dtype, np.abs(w).max(), floor) for g, w in zip(got, wrong))


# ----------------------------------------------------------------------------- forward assertions


def _forward_case(causal=True, sq=9, sk=5, dtype="fp16"):
    rng = np.random.default_rng(sq * sk)
    q = _rounded(rng, (2, sq, 4, 16), dtype)
    k, v = (_rounded(rng, (2, sk, 2, 16), dtype) for _ in range(2))
    return attention_ref(q, k, v, causal=causal)


def test_assert_attention_close_passes_the_reference_and_zeroed_dead_rows():
    ref_out, ref_lse = _forward_case()                    # causal, sq > sk: 4 rows per head see no key
    assert np.isinf(ref_lse).sum() == 2 * 4 * 4
    T.assert_attention_close(ref_out, ref_out, "fp16", lse=ref_lse, ref_lse=ref_lse)
    e = T.attention_errors(ref_out, ref_out, "bf16", lse=ref_lse, ref_lse=ref_lse)
    assert e.passed and e.out_err == 0.0 and e.lse_ratio == 0.0 and e.masked_rows == 2 * 4 * 4
    assert e.out_bound == T.out_bound("bf16", np.abs(ref_out).max())
    nearly = ref_out + 0.9 * T.out_bound("fp16", np.abs(ref_out).max())
    T.assert_attention_close(nearly, ref_out, "float16")   # just inside the bound
    T.assert_attention_close(ref_out, ref_out, "fp16")     # without lse


def test_assert_attention_close_reports_where_and_by_how_much():
    ref_out, ref_lse = _forward_case()
    bad = ref_out.copy()
    bad[1, 7, 2, 3] += 0.01                               # 2^-10 * max(1, max|ref|) is ~1e-3
    with pytest.raises(AssertionError, match=r"max\|out - ref_out\| = 1\.0+e-02 at index \(1, 7, 2, 3\) exceeds"):
        T.assert_attention_close(bad, ref_out, "fp16", lse=ref_lse, ref_lse=ref_lse)
    lse = ref_lse.copy()
    lse[0, 1, 8] += 0.1
    with pytest.raises(AssertionError, match=r"lse - ref_lse\| is .* times its bound .* at index \(0, 1, 8\)"):
        T.assert_attention_close(ref_out, ref_out, "fp16", lse=lse, ref_lse=ref_lse)
    lse[0, 1, 8] = np.nan
    assert T.attention_errors(ref_out, ref_out, "fp16", lse=lse, ref_lse=ref_lse).lse_ratio == math.inf
    dead = ref_out.copy()
    dead[0, 0, 0, 0] = np.nan                             # a row that sees no key must be 0, not NaN
    e = T.attention_errors(dead, ref_out, "fp16", lse=ref_lse, ref_lse=ref_lse)
    assert not e.passed and e.out_err == math.inf
    with pytest.raises(AssertionError, match="attention output not close"):
        T.assert_attention_close(dead, ref_out, "fp16", lse=ref_lse, ref_lse=ref_lse)


def test_attention_errors_varlen_layout_and_argument_errors():
    rng = np.random.default_rng(3)
    cu = np.array([0, 3, 10], np.int32)
    q = _rounded(rng, (10, 2, 8), "bf16")
    k = _rounded(rng, (6, 2, 8), "bf16")
    v = _rounded(rng, (6, 2, 8), "bf16")
    cu_k = np.array([0, 1, 6], np.int32)
    out, lse = attention_ref_varlen(q, k, v, cu, cu_k, causal=True)    # 2 rows of each sequence see no key
    e = T.attention_errors(out, out, "bf16", lse=lse, ref_lse=lse)
    assert e.passed and e.masked_rows == 2 * 2 * 2
    bad = out.copy()
    bad[4, 1, 0] += 0.1
    assert T.attention_errors(bad, out, "bf16", lse=lse, ref_lse=lse).out_worst == (4, 1, 0)
    with pytest.raises(ValueError, match="shape"):
        T.attention_errors(out[:5], out, "bf16")
    with pytest.raises(ValueError, match="both lse and ref_lse"):
        T.attention_errors(out, out, "bf16", lse=lse)
    with pytest.raises(ValueError, match="pass dtype="):
        T.attention_errors(out, out)                       # float64 arrays do not say the inputs' dtype
    half = out.astype(np.float16)
    assert T.attention_errors(half, out).out_bound == T.out_bound("fp16", np.abs(out).max())


# ----------------------------------------------------------------------------- gradient assertions


def test_assert_gradients_close():
    rng = np.random.default_rng(5)
    q, dout = (_rounded(rng, (1, 12, 4, 16), "fp16") for _ in range(2))
    k, v = (_rounded(rng, (1, 7, 2, 16), "fp16") for _ in range(2))
    out = _round(attention_ref(q, k, v, causal=True)[0], "fp16")
    ref = T.reference_gradients(dout, q, k, v, out, causal=True)
    T.assert_gradients_close(ref, dout, q, k, v, out, "fp16", causal=True)
    T.assert_gradients_close([g.astype(np.float16) for g in ref], dout, q.astype(np.float16), k, v, out, causal=True)
    wrong = T.reference_gradients(dout, q, k, v, out, causal=False)   # the mask flipped
    with pytest.raises(AssertionError, match=r"max\|dq - ref\| = .* exceeds the bound"):
        T.assert_gradients_close(wrong, dout, q, k, v, out, "fp16", causal=True)
    errors = T.gradient_errors([ref[0], ref[1], np.full_like(ref[2], np.nan)], dout, q, k, v, out, "fp16",
                               causal=True, ref_grads=ref)
    assert [(name, err) for name, err, _ in errors] == [("dq", 0.0), ("dk", 0.0), ("dv", math.inf)]
    with pytest.raises(ValueError, match="dv has shape"):
        T.gradient_errors([ref[0], ref[1], ref[2][:, :3]], dout, q, k, v, out, "fp16", ref_grads=ref)


# ----------------------------------------------------------------------------- why there is no GPU


@pytest.mark.parametrize("error,driver,runtime,said", [
    ("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version", 0, 12090,
     "no GPU or no CUDA driver found (the NVIDIA driver's library, libcuda, is not installed)"),
    ("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version", 12040, 13000,
     "the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0 this CuPy was built for: update the driver, "
     "or install the CuPy for the driver's CUDA (pip install 'fa2cupy[cuda12]'"),
    ("cudaErrorNoDevice: no CUDA-capable device is detected\nsecond line", 12040, 12090,
     "no CUDA GPU found: the NVIDIA driver sees no device (cudaErrorNoDevice; see CUDA_VISIBLE_DEVICES)"),
    ("cudaErrorUnknown: unknown error\nsecond line", 12040, 12090,
     "no usable CUDA GPU (cudaErrorUnknown: unknown error second line)"),
])
def test_gpu_unavailable_reason_in_plain_words(monkeypatch, error, driver, runtime, said):
    cupy = pytest.importorskip("cupy")

    def device_count():
        raise RuntimeError(error)

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", device_count)
    monkeypatch.setattr(cupy.cuda.runtime, "driverGetVersion", lambda: driver)
    monkeypatch.setattr(cupy.cuda.runtime, "runtimeGetVersion", lambda: runtime)
    reason = T.gpu_unavailable_reason()
    assert reason.startswith(said) and "\n" not in reason


def test_gpu_unavailable_reason_no_device_and_no_cupy(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 0)
    assert T.gpu_unavailable_reason() == "no CUDA GPU found: the NVIDIA driver reports no device (see " \
                                         "CUDA_VISIBLE_DEVICES)"
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    assert T.gpu_unavailable_reason() is None
    res = python_without_cupy("import fa2cupy.testing as T; print(T.gpu_unavailable_reason())")
    assert res.stdout.startswith("CuPy is not installed; install it with pip install 'fa2cupy[cuda12]'"), res.stderr


def _docstring_example() -> str:
    return textwrap.dedent(T.__doc__.split("::\n", 1)[1])


def test_docstring_example_is_python():
    code = compile(_docstring_example(), "fa2cupy.testing example", "exec")
    assert {"assert_attention_close", "assert_gradients_close"} <= set(code.co_names)


@pytest.mark.gpu
def test_docstring_example_runs_as_written():
    exec(_docstring_example(), {})
