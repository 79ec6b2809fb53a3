"""Float64 NumPy reference for attention, used by the tests and ``fa2cupy check``.

No CuPy here: this runs on any machine. Conventions follow flash-attn 2.x:

* layout q ``(batch, seqlen_q, nheads, headdim)``, k/v
  ``(batch, seqlen_k, nheads_kv, headdim)``; query head ``h`` reads kv head
  ``h // (nheads // nheads_kv)`` (MQA/GQA);
* the causal mask is aligned to the bottom-right corner (flash-attn >= 2.1):
  query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``;
* a query row that sees no key gets output exactly 0 and lse ``+inf``;
* lse is ``log(sum_j exp(scale * q_i . k_j))`` in natural log, shape
  ``(batch, nheads, seqlen_q)``;
* scores are ``s = scale * q . k``, then ``softcap * tanh(s / softcap)`` when
  ``softcap > 0``, then plus the ALiBi bias ``-slope * |i + seqlen_k - seqlen_q - j|``,
  then masked (flash-attn's order);
* varlen inputs are packed ``(total_tokens, nheads, headdim)`` with ``cu_seqlens``
  offsets; their lse is ``(nheads, total_q)``.
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
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got {k.shape} and {v.shape}")
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


def _alibi_slopes(alibi_slopes, batch: int, nheads: int):
    """(batch, nheads) float64 slopes from ``(nheads,)`` or ``(batch, nheads)``, or None."""
    if alibi_slopes is None:
        return None
    slopes = np.asarray(alibi_slopes, dtype=np.float64)
    if slopes.shape == (nheads,):
        slopes = np.broadcast_to(slopes, (batch, nheads))
    if slopes.shape != (batch, nheads):
        raise ValueError(f"alibi_slopes must be ({nheads},) or ({batch}, {nheads}), got {slopes.shape}")
    return slopes


def _alibi_bias(slopes, sq: int, sk: int):
    """(hq, sq, sk) bias ``-slope * |i + sk - sq - j|`` for one batch entry's slopes (hq,)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return -slopes[:, None, None] * np.abs(i + sk - sq - j)[None]


def _probs(qb, kb, scale, mask, softcap=0.0, bias=None, with_tanh=False, lse=None):
    """Softmax probabilities and lse for one batch entry.

    qb (sq, hq, d), kb (sk, hq, d) already repeated to hq heads; bias (hq, sq, sk) or None.
    Returns p (hq, sq, sk) and lse (hq, sq); dead rows have p = 0, lse = +inf. With ``with_tanh`` also the
    softcap's tanh (hq, sq, sk) (None without a softcap), which the backward differentiates. A given ``lse``
    (hq, sq) is used instead of the rows' own: p = exp(s - lse), as the kernels' backward forms it (for keys that
    are part of those the lse was taken over, p is then that part of the whole softmax).
    """
    # matmul (BLAS) rather than einsum: the GPU tests run this at seqlen ~1000.
    s = np.matmul(qb.transpose(1, 0, 2), kb.transpose(1, 2, 0)) * scale
    t = None
    if softcap > 0:
        t = np.tanh(s / softcap)
        s = softcap * t
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = np.where(mask[None], s, -np.inf)
    if lse is not None:
        p = np.exp(s - lse[..., None])  # masked keys: exp(-inf) = 0; lse +inf (no key seen): 0
        return (p, lse, t) if with_tanh else (p, lse)
    m = s.max(axis=-1, keepdims=True)
    dead = ~np.isfinite(m)  # only -inf: the row sees no key
    m = np.where(dead, 0.0, m)  # keep exp() finite; such rows are zeroed below
    e = np.exp(s - m)  # exp(-inf) = 0 for masked keys
    denom = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(dead, 0.0, e / denom)
        lse = np.where(dead, np.inf, m + np.log(denom))[..., 0]
    if with_tanh:
        return p, lse, t
    return p, lse


def _dropped(p, bi, dropout_p, dropout_mask):
    """P o Z / (1 - p) for batch entry bi (dropout_mask (batch, heads, sq, sk) bool, True = kept), or P."""
    if dropout_mask is None:
        return p
    return np.where(np.asarray(dropout_mask)[bi], p, 0.0) / (1.0 - float(dropout_p))


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  dropout_p=0.0, dropout_mask=None):
    """Exact attention in float64.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)`` array of any float dtype
            (float16, ml_dtypes bfloat16, float32, float64); upcast to float64.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)``; nheads % nheads_kv == 0; v's head dim may differ.
        softmax_scale: multiplier of q.k; None means ``1/sqrt(headdim)``.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)`` sliding window (flash-attn semantics, -1 = no limit).
        softcap: ``> 0`` caps the scaled scores at ``softcap * tanh(s / softcap)``.
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)``: bias ``-slope * |i + seqlen_k - seqlen_q - j|``.
        dropout_p, dropout_mask: dropout with the given keep mask ``(batch, nheads, seqlen_q, seqlen_k)`` (True =
            kept): ``out = (P o Z / (1 - p)) V``; lse is that of the undropped softmax (as the kernels keep it).

    Returns:
        (out, lse): out float64 ``(batch, seqlen_q, nheads, v's headdim)``; lse float64
        ``(batch, nheads, seqlen_q)``. Rows with no visible key: out 0, lse +inf.

    Raises:
        TypeError: non-float input. ValueError: inconsistent shapes.
    """
    q, k, v, scale, group = _prepare(q, k, v, softmax_scale)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    mask = _visible(sq, sk, causal, window_size)
    slopes = _alibi_slopes(alibi_slopes, b, hq)
    out = np.empty((b, sq, hq, v.shape[3]))  # (v's head dim)
    lse = np.empty((b, hq, sq))
    # One batch entry at a time bounds the (heads, sq, sk) score tensor.
    for bi in range(b):
        kb = np.repeat(k[bi], group, axis=1)
        vb = np.repeat(v[bi], group, axis=1)
        bias = None if slopes is None else _alibi_bias(slopes[bi], sq, sk)
        p, lse[bi] = _probs(q[bi], kb, scale, mask, float(softcap), bias)
        p = _dropped(p, bi, dropout_p, dropout_mask)
        out[bi] = np.matmul(p, vb.transpose(1, 0, 2)).transpose(1, 0, 2)
    return out, lse


def attention_ref_backward(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, out=None, dropout_p=0.0, dropout_mask=None, lse=None,
                           with_magnitudes=False):
    """Analytic float64 gradients of :func:`attention_ref`'s output.

    With ``P = softmax(scale * Q K^T)`` and ``O = P V``:
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``,
    ``dQ = scale * dS K``, ``dK = scale * dS^T Q``. For MQA/GQA the kv gradients
    are summed over the query heads of each group. Rows with no visible key
    contribute nothing. With a softcap, ``dS`` is multiplied by the tanh's
    derivative ``1 - tanh^2``; the ALiBi bias has no gradient.

    Args:
        dout: ``(batch, seqlen_q, nheads, v's headdim)``, gradient of the output.
        q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes: as for :func:`attention_ref`.
        out: optional output to use in ``rowsum(dO * O)`` instead of the exact one: FlashAttention-2's backward
            takes ``out`` as an input, so with a rounded ``out`` these are the exact gradients *for that out*.
        dropout_p, dropout_mask: as for :func:`attention_ref`; then ``dV = Pd^T dO`` with ``Pd = P o Z / (1 - p)``,
            and ``dS = P o (Z o dP / (1 - p) - D)``.
        lse: optional ``(batch, nheads, seqlen_q)`` log-sum-exp to form ``P = exp(S - lse)`` from, as the kernels'
            backward does, instead of the softmax over these keys: with the lse (and ``out``) of attention over a
            larger key set, these are that attention's gradients restricted to these keys (ring attention's blocks).
        with_magnitudes: also return the magnitudes of the sums the gradients are: ``scale * |dS| |K|``,
            ``scale * |dS|^T |Q|`` and ``|P|^T |dO|`` (summed over a group's heads like the gradients). A kernel that
            rounds dS and P to the input dtype before those products errs by up to the unit roundoff times these,
            which can exceed the gradients themselves many times over where their terms cancel (say one query
            row over many keys at a small head dim).

    Returns:
        (dq, dk, dv) float64 with the shapes of q, k and v; with ``with_magnitudes``, ``(dq, dk, dv, (mq, mk, mv))``.
    """
    q, k, v, scale, group = _prepare(q, k, v, softmax_scale)
    dout = _as_f64(dout, "dout")
    if dout.shape != q.shape[:3] + v.shape[3:]:
        raise ValueError(f"dout must have q's shape with v's head dim, {q.shape[:3] + v.shape[3:]}, got {dout.shape}")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    mask = _visible(sq, sk, causal, window_size)
    slopes = _alibi_slopes(alibi_slopes, b, hq)
    dq = np.empty_like(q)
    dk = np.empty_like(k)
    dv = np.empty_like(v)
    mags = (np.empty_like(q), np.empty_like(k), np.empty_like(v)) if with_magnitudes else None
    for bi in range(b):
        kb = np.repeat(k[bi], group, axis=1)
        vb = np.repeat(v[bi], group, axis=1)
        bias = None if slopes is None else _alibi_bias(slopes[bi], sq, sk)
        p, _, t = _probs(q[bi], kb, scale, mask, float(softcap), bias, with_tanh=True,
                         lse=None if lse is None else _as_f64(lse, "lse")[bi])  # (hq, sq, sk)
        pd = _dropped(p, bi, dropout_p, dropout_mask)
        ob = np.einsum("hqk,khd->qhd", pd, vb) if out is None else _as_f64(out, "out")[bi]
        do = dout[bi]
        dvb = np.einsum("hqk,qhd->khd", pd, do)
        dp = _dropped(np.einsum("qhd,khd->hqk", do, vb), bi, dropout_p, dropout_mask)
        delta = np.einsum("qhd,qhd->hq", do, ob)[..., None]
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dq[bi] = scale * np.einsum("hqk,khd->qhd", ds, kb)
        dkb = scale * np.einsum("hqk,qhd->khd", ds, q[bi])
        # Sum the repeated heads back onto their kv head: query head h = g*group + r.
        dk[bi] = dkb.reshape(sk, hkv, group, d).sum(axis=2)
        dv[bi] = dvb.reshape(sk, hkv, group, v.shape[3]).sum(axis=2)
        if mags is not None:
            ads = np.abs(ds)
            mags[0][bi] = abs(scale) * np.einsum("hqk,khd->qhd", ads, np.abs(kb))
            mags[1][bi] = (abs(scale) * np.einsum("hqk,qhd->khd", ads, np.abs(q[bi]))).reshape(sk, hkv, group, d).sum(2)
            mags[2][bi] = np.einsum("hqk,qhd->khd", np.abs(pd), np.abs(do)).reshape(sk, hkv, group, -1).sum(axis=2)
    return (dq, dk, dv, mags) if with_magnitudes else (dq, dk, dv)


def attention_probs_ref(q, k, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Float64 softmax probabilities ``P = softmax(scale * q k^T)`` with the mask, ``(batch, nheads, seqlen_q,
    seqlen_k)``; rows with no visible key are 0. Arguments as for :func:`attention_ref` (no modifiers or dropout:
    these are the probabilities ``return_attn_probs=True`` describes before dropout)."""
    q, k, _, scale, group = _prepare(q, k, k, softmax_scale)
    b, sq, hq, _ = q.shape
    mask = _visible(sq, k.shape[1], causal, window_size)
    return np.stack([_probs(q[bi], np.repeat(k[bi], group, axis=1), scale, mask)[0] for bi in range(b)])


def _check_cu_seqlens(cu, total: int, name: str) -> np.ndarray:
    cu = np.asarray(cu, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > total:
        raise ValueError(f"{name} must start at 0, not decrease and end at most at {total}, got {cu}")
    return cu


def attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """:func:`attention_ref` over packed sequences: q ``(total_q, nheads, d)``, k/v ``(total_k, nheads_kv, d)``,
    sequence ``b`` being rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q (and likewise for k/v), each attended
    on its own (masks aligned per sequence). Returns (out ``(total_q, nheads, d)``, lse ``(nheads, total_q)``);
    rows past ``cu_seqlens_q[-1]`` are 0 and +inf."""
    q, k, v = _as_f64(q, "q"), _as_f64(k, "k"), _as_f64(v, "v")
    cu_q = _check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = _check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    batch = cu_q.size - 1
    if cu_k.size != cu_q.size:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
    slopes = _alibi_slopes(alibi_slopes, batch, q.shape[1])
    out = np.zeros(q.shape[:2] + v.shape[2:])  # (v's head dim)
    lse = np.full((q.shape[1], q.shape[0]), np.inf)
    for bi in range(batch):
        qs, ks = slice(cu_q[bi], cu_q[bi + 1]), slice(cu_k[bi], cu_k[bi + 1])
        if cu_q[bi] == cu_q[bi + 1] or cu_k[bi] == cu_k[bi + 1]:
            continue  # no queries, or no keys: out 0 and lse +inf, as initialised
        o, l = attention_ref(q[None, qs], k[None, ks], v[None, ks], softmax_scale, causal, window_size, softcap,
                             None if slopes is None else slopes[bi : bi + 1])
        out[qs], lse[:, qs] = o[0], l[0]
    return out, lse


def attention_ref_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, out=None, lse=None,
                                  with_magnitudes=False):
    """:func:`attention_ref_backward` over packed sequences (see :func:`attention_ref_varlen`; ``out`` packed like
    q, ``lse`` ``(nheads, total_q)``); rows outside every sequence get zero gradients (and magnitudes)."""
    q, k, v, dout = _as_f64(q, "q"), _as_f64(k, "k"), _as_f64(v, "v"), _as_f64(dout, "dout")
    cu_q = _check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = _check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    batch = cu_q.size - 1
    slopes = _alibi_slopes(alibi_slopes, batch, q.shape[1])
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    mags = (np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)) if with_magnitudes else None
    for bi in range(batch):
        qs, ks = slice(cu_q[bi], cu_q[bi + 1]), slice(cu_k[bi], cu_k[bi + 1])
        if cu_q[bi] == cu_q[bi + 1] or cu_k[bi] == cu_k[bi + 1]:
            continue  # nothing attends: zero gradients
        g = attention_ref_backward(dout[None, qs], q[None, qs], k[None, ks], v[None, ks], softmax_scale, causal,
                                   window_size, softcap, None if slopes is None else slopes[bi : bi + 1],
                                   None if out is None else _as_f64(out, "out")[None, qs],
                                   lse=None if lse is None else _as_f64(lse, "lse")[None, :, qs],
                                   with_magnitudes=with_magnitudes)
        dq[qs], dk[ks], dv[ks] = g[0][0], g[1][0], g[2][0]
        if mags is not None:
            mags[0][qs], mags[1][ks], mags[2][ks] = (m[0] for m in g[3])
    return (dq, dk, dv, mags) if with_magnitudes else (dq, dk, dv)


def apply_rotary_ref(x, cos, sin, positions, interleaved=True):
    """Rotary embedding (RoPE) in float64, flash-attn's convention.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)``; ``rotary_dim = 2 * cos.shape[1] <= headdim``.
        positions: int ``(batch, seqlen)``: the row of cos/sin for each token.
        interleaved: True rotates column pairs ``(2i, 2i + 1)`` by angle ``i`` (GPT-J); False pairs column ``i``
            with ``i + rotary_dim / 2`` (GPT-NeoX).

    Returns:
        float64 array like x: pair ``(a, b)`` at angle ``i`` becomes ``(a cos - b sin, a sin + b cos)``; the
        columns from rotary_dim on are unchanged.
    """
    x = _as_f64(x, "x")
    cos, sin = np.asarray(cos, dtype=np.float64), np.asarray(sin, dtype=np.float64)
    positions = np.asarray(positions)
    half = cos.shape[1]
    rotary_dim = 2 * half
    if cos.shape != sin.shape or cos.ndim != 2 or rotary_dim > x.shape[-1]:
        raise ValueError(f"cos/sin must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= {x.shape[-1]}, got "
                         f"{cos.shape} and {sin.shape}")
    if positions.shape != x.shape[:2]:
        raise ValueError(f"positions must be (batch, seqlen) = {x.shape[:2]}, got {positions.shape}")
    c = cos[positions][:, :, None, :]  # (batch, seqlen, 1, half)
    s = sin[positions][:, :, None, :]
    out = x.copy()
    if interleaved:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = a * c - b * s
        out[..., 1:rotary_dim:2] = a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = a * c - b * s
        out[..., half:rotary_dim] = a * s + b * c
    return out
