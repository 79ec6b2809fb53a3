"""Float64 NumPy reference for attention, used by the tests and ``fa2cupy check``.

No CuPy here: this runs on any machine. Conventions follow flash-attn 2.x:

* layout q ``(batch, seqlen_q, nheads, headdim)``, k/v
  ``(batch, seqlen_k, nheads_kv, headdim)``; query head ``h`` reads kv head
  ``h // (nheads // nheads_kv)`` (MQA/GQA);
* the causal mask is aligned to the bottom-right corner (flash-attn >= 2.1):
  query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``;
* a query row that sees no key gets output exactly 0 and lse ``+inf``;
* lse is ``log(sum_j exp(scale * q_i . k_j))`` in natural log, shape
  ``(batch, nheads, seqlen_q)``.
"""

from __future__ import annotations

import math

import numpy as np


def _as_f64(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    # ml_dtypes' bfloat16 has kind "V" but converts to float64 exactly.
    if a.dtype.kind not in "fV" and a.dtype.name != "bfloat16":
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    return a.astype(np.float64)


def _prepare(q, k, v, softmax_scale):
    q = _as_f64(q, "q")
    k = _as_f64(k, "k")
    v = _as_f64(v, "v")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k and v must be 4-D (batch, seqlen, heads, headdim); got {q.shape}, "
            f"{k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} must share batch and headdim with q {q.shape}")
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    return q, k, v, scale, hq // hkv


def _visible(sq: int, sk: int, causal: bool, window_size=(-1, -1)):
    """Boolean (sq, sk) mask of keys each query may see, or None for "all".

    flash-attn's sliding window: query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right, -1 meaning
    no limit on that side; causal sets right = 0."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    visible = np.ones((sq, sk), dtype=bool)
    if right >= 0:
        visible &= j <= i + (sk - sq) + right
    if left >= 0:
        visible &= j >= i + (sk - sq) - left
    return visible


def _probs(qb, kb, scale, mask):
    """Softmax probabilities and lse for one batch entry.

    qb (sq, hq, d), kb (sk, hq, d) already repeated to hq heads.
    Returns p (hq, sq, sk) and lse (hq, sq); dead rows have p = 0, lse = +inf.
    """
    # matmul (BLAS) rather than einsum: the GPU tests run this at seqlen ~1000.
    s = np.matmul(qb.transpose(1, 0, 2), kb.transpose(1, 2, 0)) * scale
    if mask is not None:
        s = np.where(mask[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    dead = ~np.isfinite(m)  # only -inf: the row sees no key
    m = np.where(dead, 0.0, m)  # keep exp() finite; such rows are zeroed below
    e = np.exp(s - m)  # exp(-inf) = 0 for masked keys
    denom = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(dead, 0.0, e / denom)
        lse = np.where(dead, np.inf, m + np.log(denom))[..., 0]
    return p, lse


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Exact attention in float64.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)`` array of any float dtype
            (float16, ml_dtypes bfloat16, float32, float64); upcast to float64.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)``; nheads % nheads_kv == 0.
        softmax_scale: multiplier of q.k; None means ``1/sqrt(headdim)``.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)`` sliding window (flash-attn semantics, -1 = no limit).

    Returns:
        (out, lse): out float64 ``(batch, seqlen_q, nheads, headdim)``; lse float64
        ``(batch, nheads, seqlen_q)``. Rows with no visible key: out 0, lse +inf.

    Raises:
        TypeError: non-float input. ValueError: inconsistent shapes.
    """
    q, k, v, scale, group = _prepare(q, k, v, softmax_scale)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    mask = _visible(sq, sk, causal, window_size)
    out = np.empty((b, sq, hq, d))
    lse = np.empty((b, hq, sq))
    # One batch entry at a time bounds the (heads, sq, sk) score tensor.
    for bi in range(b):
        kb = np.repeat(k[bi], group, axis=1)
        vb = np.repeat(v[bi], group, axis=1)
        p, lse[bi] = _probs(q[bi], kb, scale, mask)
        out[bi] = np.matmul(p, vb.transpose(1, 0, 2)).transpose(1, 0, 2)
    return out, lse


def attention_ref_backward(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Analytic float64 gradients of :func:`attention_ref`'s output.

    With ``P = softmax(scale * Q K^T)`` and ``O = P V``:
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``,
    ``dQ = scale * dS K``, ``dK = scale * dS^T Q``. For MQA/GQA the kv gradients
    are summed over the query heads of each group. Rows with no visible key
    contribute nothing.

    Args:
        dout: ``(batch, seqlen_q, nheads, headdim)``, gradient of the output.
        q, k, v, softmax_scale, causal, window_size: as for :func:`attention_ref`.

    Returns:
        (dq, dk, dv) float64 with the shapes of q, k and v.
    """
    q, k, v, scale, group = _prepare(q, k, v, softmax_scale)
    dout = _as_f64(dout, "dout")
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {q.shape}, got {dout.shape}")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    mask = _visible(sq, sk, causal, window_size)
    dq = np.empty_like(q)
    dk = np.empty_like(k)
    dv = np.empty_like(v)
    for bi in range(b):
        kb = np.repeat(k[bi], group, axis=1)
        vb = np.repeat(v[bi], group, axis=1)
        p, _ = _probs(q[bi], kb, scale, mask)  # (hq, sq, sk)
        ob = np.einsum("hqk,khd->qhd", p, vb)
        do = dout[bi]
        dvb = np.einsum("hqk,qhd->khd", p, do)
        dp = np.einsum("qhd,khd->hqk", do, vb)
        delta = np.einsum("qhd,qhd->hq", do, ob)[..., None]
        ds = p * (dp - delta)
        dq[bi] = scale * np.einsum("hqk,khd->qhd", ds, kb)
        dkb = scale * np.einsum("hqk,qhd->khd", ds, q[bi])
        # Sum the repeated heads back onto their kv head: query head h = g*group + r.
        dk[bi] = dkb.reshape(sk, hkv, group, d).sum(axis=2)
        dv[bi] = dvb.reshape(sk, hkv, group, d).sum(axis=2)
    return dq, dk, dv
