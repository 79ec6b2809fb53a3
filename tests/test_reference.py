"""The float64 reference against a naive per-row softmax and finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa2cupy.reference import attention_ref, attention_ref_backward


def naive_attention(q, k, v, scale=None, causal=False):
    """Textbook attention with explicit Python loops, for tiny sizes only."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, sq, hq, d))
    lse = np.zeros((b, hq, sq))
    for bi in range(b):
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    lse[bi, h, i] = math.inf
                    continue
                s = [scale * float(np.dot(q[bi, i, h], k[bi, j, g])) for j in keys]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                tot = sum(w)
                lse[bi, h, i] = m + math.log(tot)
                for wj, j in zip(w, keys):
                    out[bi, i, h] += (wj / tot) * v[bi, j, g]
    return out, lse


def _rand(rng, *shape):
    return rng.standard_normal(shape)


@st.composite
def problems(draw):
    b = draw(st.integers(1, 2))
    sq = draw(st.integers(1, 6))
    sk = draw(st.integers(1, 6))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    d = draw(st.integers(1, 5))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(-2.0, 2.0, allow_nan=False)))
    seed = draw(st.integers(0, 2**32 - 1))
    return b, sq, sk, hq, hkv, d, causal, scale, seed


@given(problems())
def test_matches_naive(problem):
    b, sq, sk, hq, hkv, d, causal, scale, seed = problem
    rng = np.random.default_rng(seed)
    q, k, v = _rand(rng, b, sq, hq, d), _rand(rng, b, sk, hkv, d), _rand(rng, b, sk, hkv, d)
    out, lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
    out_n, lse_n = naive_attention(q, k, v, scale, causal)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
    np.testing.assert_allclose(out, out_n, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_n))
    fin = np.isfinite(lse_n)
    np.testing.assert_allclose(lse[fin], lse_n[fin], rtol=1e-12, atol=1e-12)


def test_causal_bottom_right_square_is_lower_triangular():
    # sq == sk: the ordinary lower-triangular mask; row 0 sees only key 0.
    rng = np.random.default_rng(0)
    q, k, v = _rand(rng, 1, 4, 1, 3), _rand(rng, 1, 4, 1, 3), _rand(rng, 1, 4, 1, 3)
    out, lse = attention_ref(q, k, v, causal=True)
    np.testing.assert_allclose(out[0, 0, 0], v[0, 0, 0], rtol=1e-14)
    assert np.all(np.isfinite(lse))


def test_causal_bottom_right_sq_lt_sk_last_row_sees_everything():
    # sq=2, sk=5: query i sees keys j <= i + 3, so the last query sees all keys
    # and equals non-causal attention for that row.
    rng = np.random.default_rng(1)
    q, k, v = _rand(rng, 1, 2, 2, 4), _rand(rng, 1, 5, 2, 4), _rand(rng, 1, 5, 2, 4)
    out_c, lse_c = attention_ref(q, k, v, causal=True)
    out_f, lse_f = attention_ref(q, k, v, causal=False)
    np.testing.assert_allclose(out_c[:, -1], out_f[:, -1], rtol=1e-13)
    np.testing.assert_allclose(lse_c[:, :, -1], lse_f[:, :, -1], rtol=1e-13)
    # Query 0 sees keys 0..3 only: same as causal=False on the truncated keys.
    out_t, _ = attention_ref(q[:, :1], k[:, :4], v[:, :4])
    np.testing.assert_allclose(out_c[:, :1], out_t, rtol=1e-13)


def test_causal_sq_gt_sk_rows_without_keys_are_zero_and_inf():
    # sq=5, sk=2: query i sees j <= i - 3, so queries 0..2 see nothing.
    rng = np.random.default_rng(2)
    q, k, v = _rand(rng, 2, 5, 3, 4), _rand(rng, 2, 2, 3, 4), _rand(rng, 2, 2, 3, 4)
    out, lse = attention_ref(q, k, v, causal=True)
    assert np.all(out[:, :3] == 0.0)
    assert np.all(lse[:, :, :3] == np.inf)
    assert np.all(np.isfinite(lse[:, :, 3:]))
    # Query 3 sees key 0 only: its output is exactly v[:, 0].
    np.testing.assert_allclose(out[:, 3], v[:, 0], rtol=1e-14)
    np.testing.assert_allclose(lse[:, :, 3], np.einsum("bhd,bhd->bh", q[:, 3], k[:, 0]) / 2.0)


def test_gqa_equals_repeated_kv_heads():
    rng = np.random.default_rng(3)
    hq, hkv = 6, 2
    q, k, v = _rand(rng, 2, 7, hq, 8), _rand(rng, 2, 9, hkv, 8), _rand(rng, 2, 9, hkv, 8)
    kr, vr = np.repeat(k, hq // hkv, axis=2), np.repeat(v, hq // hkv, axis=2)
    for causal in (False, True):
        o1, l1 = attention_ref(q, k, v, causal=causal)
        o2, l2 = attention_ref(q, kr, vr, causal=causal)
        np.testing.assert_allclose(o1, o2, rtol=1e-14)
        np.testing.assert_allclose(l1, l2, rtol=1e-14)


def test_lse_is_log_normaliser():
    # sum_j exp(scale*s_ij - lse_i) == 1 for every row, with a large scale that
    # would overflow a naive exp (checks the max subtraction).
    rng = np.random.default_rng(4)
    q, k, v = _rand(rng, 1, 5, 2, 16) * 30, _rand(rng, 1, 6, 2, 16) * 30, _rand(rng, 1, 6, 2, 16)
    scale = 3.0
    out, lse = attention_ref(q, k, v, softmax_scale=scale)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    # Scores reach ~1e4, so s - lse carries ~1e4 * 2^-52 absolute rounding error.
    np.testing.assert_allclose(np.exp(s - lse[..., None]).sum(-1), 1.0, rtol=1e-10)


def test_low_precision_inputs_are_upcast():
    rng = np.random.default_rng(5)
    q, k, v = (_rand(rng, 1, 3, 2, 4).astype(np.float16) for _ in range(3))
    out, lse = attention_ref(q, k, v)
    out64, lse64 = attention_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, out64)
    np.testing.assert_array_equal(lse, lse64)


def test_bfloat16_inputs_are_upcast():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(6)
    q, k, v = (_rand(rng, 1, 3, 2, 4).astype(ml_dtypes.bfloat16) for _ in range(3))
    out, _ = attention_ref(q, k, v, causal=True)
    out64, _ = attention_ref(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    np.testing.assert_array_equal(out, out64)


def test_rejects_bad_shapes_and_dtypes():
    z = np.zeros((1, 2, 2, 4))
    with pytest.raises(ValueError, match="multiple"):
        attention_ref(np.zeros((1, 2, 3, 4)), z, z)
    with pytest.raises(ValueError, match="same shape"):
        attention_ref(z, z, np.zeros((1, 3, 2, 4)))
    with pytest.raises(TypeError, match="floating"):
        attention_ref(z.astype(np.int32), z, z)


def _loss(q, k, v, dout, scale, causal):
    out, _ = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
    return float(np.sum(out * dout))


@pytest.mark.parametrize(
    "sq,sk,hq,hkv,causal,scale",
    [(3, 4, 2, 2, False, None), (4, 3, 4, 2, True, 0.7), (5, 2, 3, 1, True, None), (1, 1, 1, 1, False, -0.4)],
)
def test_backward_matches_finite_differences(sq, sk, hq, hkv, causal, scale):
    rng = np.random.default_rng(7)
    d, b = 3, 2
    q, k, v = _rand(rng, b, sq, hq, d), _rand(rng, b, sk, hkv, d), _rand(rng, b, sk, hkv, d)
    dout = _rand(rng, b, sq, hq, d)
    grads = attention_ref_backward(dout, q, k, v, softmax_scale=scale, causal=causal)
    eps = 1e-6
    for which, (x, g) in enumerate(zip((q, k, v), grads)):
        assert g.shape == x.shape and g.dtype == np.float64
        num = np.empty_like(x)
        for idx in np.ndindex(x.shape):
            args = [q, k, v]
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args[which] = xp
            lp = _loss(*args, dout, scale, causal)
            args[which] = xm
            lm = _loss(*args, dout, scale, causal)
            num[idx] = (lp - lm) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


def test_backward_dead_rows_have_zero_gradient():
    rng = np.random.default_rng(8)
    q, k, v = _rand(rng, 1, 4, 1, 2), _rand(rng, 1, 2, 1, 2), _rand(rng, 1, 2, 1, 2)
    dq, _, _ = attention_ref_backward(_rand(rng, 1, 4, 1, 2), q, k, v, causal=True)
    assert np.all(dq[:, :2] == 0.0)


def test_window_mask_semantics():
    # flash-attn's sliding window, bottom-right aligned: query i sees key j iff
    # i + sk - sq - left <= j <= i + sk - sq + right; causal sets right = 0; -1 = unlimited.
    from fa2cupy.reference import _visible

    sq, sk = 4, 7  # diag = 3
    v = _visible(sq, sk, False, (1, 2))
    for i in range(sq):
        for j in range(sk):
            assert v[i, j] == (i + 3 - 1 <= j <= i + 3 + 2)
    assert np.array_equal(_visible(sq, sk, True, (-1, -1)), _visible(sq, sk, False, (-1, 0)))
    assert np.array_equal(_visible(sq, sk, True, (2, 5)), _visible(sq, sk, False, (2, 0)))
    assert _visible(sq, sk, False, (-1, -1)) is None


def test_window_reference_equals_masked_dense():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in ((1, 9, 2, 8), (1, 12, 1, 8), (1, 12, 1, 8)))
    out, lse = attention_ref(q, k, v, 0.5, window_size=(2, 1))
    diag = 12 - 9
    for h in range(2):
        for i in range(9):
            js = [j for j in range(12) if i + diag - 2 <= j <= i + diag + 1]
            s = np.array([0.5 * q[0, i, h] @ k[0, j, 0] for j in js])
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(out[0, i, h], p @ v[0, js, 0], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(lse[0, h, i], s.max() + np.log(np.exp(s - s.max()).sum()), rtol=1e-12)


# ------------------------------------------------------------------ softcap, ALiBi, varlen


def _numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        hi = f()
        x[i] = old - eps
        lo = f()
        x[i] = old
        g[i] = (hi - lo) / (2 * eps)
    return g


@pytest.mark.parametrize("softcap,alibi", [(2.0, False), (0.0, True), (1.5, True)])
def test_modifier_gradients_match_finite_differences(softcap, alibi):
    from fa2cupy.reference import attention_ref, attention_ref_backward

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal(s) for s in ((1, 5, 2, 4), (1, 6, 1, 4), (1, 6, 1, 4), (1, 5, 2, 4)))
    slopes = rng.uniform(0, 0.5, (1, 2)) if alibi else None
    kw = dict(softmax_scale=0.7, causal=True, softcap=softcap, alibi_slopes=slopes)
    loss = lambda: float((attention_ref(q, k, v, **kw)[0] * dout).sum())  # noqa: E731
    dq, dk, dv = attention_ref_backward(dout, q, k, v, **kw)
    for x, g in ((q, dq), (k, dk), (v, dv)):
        np.testing.assert_allclose(g, _numeric_grad(loss, x), rtol=1e-5, atol=1e-7)


def test_softcap_caps_and_alibi_biases():
    from fa2cupy.reference import attention_ref

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 3, 1, 8)) * 10 for _ in range(3))
    _, lse = attention_ref(q, k, v, softmax_scale=1.0, softcap=0.5)
    assert np.all(lse <= 0.5 + np.log(3) + 1e-12)  # every logit is capped at 0.5
    _, plain = attention_ref(q, k, v, softmax_scale=0.0)
    _, biased = attention_ref(q, k, v, softmax_scale=0.0, alibi_slopes=np.array([1.0]))
    # zero scores: lse = log(sum_j exp(-|i - j|)); row 0 sees distances 0, 1, 2
    assert np.allclose(biased[0, 0, 0], np.log(1 + np.exp(-1) + np.exp(-2)))
    assert np.allclose(plain, np.log(3))


def test_varlen_reference_is_per_sequence():
    from fa2cupy.reference import attention_ref, attention_ref_varlen, attention_ref_varlen_backward

    rng = np.random.default_rng(2)
    cu = np.array([0, 3, 3, 7, 8])
    q, k, v, dout = (rng.standard_normal((9, 2, 4)) for _ in range(4))  # row 8 is past the last sequence
    out, lse = attention_ref_varlen(q, k, v, cu, cu, causal=True)
    assert out.shape == (9, 2, 4) and lse.shape == (2, 9)
    assert np.all(out[8] == 0) and np.all(np.isinf(lse[:, 8]))
    for b in range(4):
        s = slice(cu[b], cu[b + 1])
        if cu[b] == cu[b + 1]:
            continue
        o, l = attention_ref(q[None, s], k[None, s], v[None, s], causal=True)
        np.testing.assert_allclose(out[s], o[0])
        np.testing.assert_allclose(lse[:, s], l[0])
    dq, dk, dv = attention_ref_varlen_backward(dout, q, k, v, cu, cu, causal=True)
    assert np.all(dq[8] == 0) and np.all(dk[8] == 0)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_magnitudes_bound_the_gradients(softcap):
    """with_magnitudes: scale |dS| |K|, scale |dS|^T |Q| and |P|^T |dO| (GQA-summed) are at least the gradients'
    magnitudes and equal them where no term is negative; the same gradients come with them; varlen per sequence."""
    from fa2cupy.reference import attention_ref_varlen_backward

    rng = np.random.default_rng(3)
    q, dout = _rand(rng, 2, 5, 4, 3), _rand(rng, 2, 5, 4, 3)
    k, v = _rand(rng, 2, 7, 2, 3), _rand(rng, 2, 7, 2, 3)
    kw = dict(softmax_scale=-0.7, causal=True, softcap=softcap)
    *grads, mags = attention_ref_backward(dout, q, k, v, with_magnitudes=True, **kw)
    for g, want, m in zip(grads, attention_ref_backward(dout, q, k, v, **kw), mags):
        np.testing.assert_array_equal(g, want)
        assert m.shape == g.shape and np.all(m >= np.abs(g) - 1e-12) and np.any(m > np.abs(g) + 1e-6)
    # all-positive v and dout: P^T dO has no negative term, its magnitude is dv itself
    _, _, dv, (_, _, mv) = attention_ref_backward(np.abs(dout), q, k, np.abs(v), with_magnitudes=True, **kw)
    np.testing.assert_allclose(mv, dv, rtol=1e-12)
    cu = np.array([0, 2, 5])
    *_, (mq, mk, mv) = attention_ref_varlen_backward(dout[0], q[0], k[0, :5], v[0, :5], cu, cu,
                                                     with_magnitudes=True, **kw)
    *_, (pq, _, _) = attention_ref_backward(dout[:1, 2:5], q[:1, 2:5], k[:1, 2:5], v[:1, 2:5], with_magnitudes=True,
                                            **kw)
    np.testing.assert_allclose(mq[2:5], pq[0])


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1))])
def test_probabilities_make_the_output(causal, window):
    from fa2cupy.reference import attention_probs_ref

    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 9, 4, 8))
    k, v = (rng.standard_normal((2, 6, 2, 8)) for _ in range(2))
    p = attention_probs_ref(q, k, 0.7, causal, window)
    out, lse = attention_ref(q, k, v, softmax_scale=0.7, causal=causal, window_size=window)
    assert p.shape == (2, 4, 9, 6) and np.all(p >= 0)
    live = np.isfinite(lse)                                  # (b, h, sq): rows that see a key sum to 1, others 0
    np.testing.assert_allclose(p.sum(-1)[live], 1.0)
    assert np.all(p[~live] == 0)
    np.testing.assert_allclose(np.einsum("bhqk,bkhd->bqhd", p, np.repeat(v, 2, axis=2)), out, atol=1e-12)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_backward_from_a_larger_key_sets_lse_splits_the_gradients(softcap):
    """With the out and lse of attention over all keys, attention_ref_backward over two halves of the keys gives
    that attention's gradients split by keys: dQ their sum, dK and dV the halves (what ring attention relies on)."""
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal(s) for s in ((2, 7, 4, 8), (2, 10, 2, 8), (2, 10, 2, 8), (2, 7, 4, 8)))
    out, lse = attention_ref(q, k, v, 0.4, softcap=softcap)
    whole = attention_ref_backward(dout, q, k, v, 0.4, softcap=softcap)
    halves = [attention_ref_backward(dout, q, k[:, part], v[:, part], 0.4, softcap=softcap, out=out, lse=lse)
              for part in (slice(0, 4), slice(4, 10))]
    np.testing.assert_allclose(halves[0][0] + halves[1][0], whole[0], rtol=1e-12, atol=1e-12)
    for i in (1, 2):
        np.testing.assert_allclose(np.concatenate([halves[0][i], halves[1][i]], axis=1), whole[i], rtol=1e-12,
                                   atol=1e-12)
