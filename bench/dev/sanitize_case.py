"""A few small forward and backward cases for compute-sanitizer (memcheck / racecheck).

    compute-sanitizer --tool memcheck  python3 bench/dev/sanitize_case.py
    compute-sanitizer --tool racecheck python3 bench/dev/sanitize_case.py
    (from the repository root, after ``pip install -e .``: the harness is the installed package ``fa2cupy_bench``)

Small on purpose (the sanitizers slow kernels down by orders of magnitude) but
covering the edges: partial tiles, causal with sq != sk (fully masked rows),
head dims 40 and 256, GQA/MQA, a single query.  Uses CuPy arrays only (no torch,
less noise under the sanitizer).  Each output is also checked against the float64
reference with the ``fa2cupy check`` bounds; exit status 1 on a mismatch.

The forward cases run the forward only; BWD_CASES run forward + backward
(``flash_attn_backward``, dq/dk/dv against the reference with
``fa2cupy.testing.gradient_bound``), in both deterministic modes; DECODE_CASES run
``flash_attn_with_kvcache`` (append, split-KV with the last-block merge, paged and
contiguous, causal) against ``flash_attn_func`` over each row's keys; decode_deep runs them again with the deep
ring (d=128 on sm_90), decode_walk with both rings on a pretend 2-SM GPU, where each decode block walks several
work items, decode_warp with one split and warps that stream whole items (both rings, 1 and 2 pretend SMs);
fwd_hopper runs the forward, window, varlen (softcap and ALiBi too), padded softcap/ALiBi (fp16; and bf16 softcap
against the fixed max), dropout and paged cases of the Hopper forward's head dims (64, 128, 192, 256) on sm_90 with
1 and 2 pretend SMs, so that each persistent block walks many work items; bwd_hopper runs the backward and window
cases of the Hopper dK/dV kernel's head dims in both modes (and of head dims between them: 72, 96, 144, varlen 80
and 160, on the instantiations whose score products stop short of the row's width) and its modifier rows with
softcap/ALiBi and with dropout (on sm_90); paged_mma
runs the paged cases on the mma.sync forward (which sm_90 otherwise uses only with modifiers or other head dims);
dropout runs forward + backward with dropout on every warp tiling of its Philox draw (and one case on the sm86 rows).

    python3 bench/dev/sanitize_case.py [fwd|bwd|...|paged_mma|decode|decode_deep|decode_walk|decode_warp|fwd_hopper|bwd_hopper ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import cli  # noqa: E402
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import configs  # noqa: E402
from fa2cupy.options import KernelOptions  # noqa: E402

#: The KernelOptions every call of the checks below passes (a group sets it: the kernels it sanitizes).
KERNEL_OPTIONS = KernelOptions()

CASES = (
    B.Case(1, 64, 64, 2, 2, 64, False, "fp16"),      # exactly one tile
    B.Case(1, 65, 65, 2, 2, 64, True, "bf16"),       # one past a tile, causal
    B.Case(2, 37, 91, 4, 2, 40, True, "bf16"),       # headdim 40 (padded), GQA, causal sq < sk
    B.Case(1, 33, 129, 2, 2, 256, False, "fp16"),    # headdim 256
    B.Case(1, 129, 33, 4, 1, 128, True, "bf16"),     # MQA, causal sq > sk: fully masked rows
    B.Case(2, 1, 77, 2, 2, 128, True, "fp16"),       # one query
    B.Case(1, 100, 100, 3, 3, 33, False, "bf16"),    # odd headdim
)

# (case, deterministic): forward + backward.
BWD_CASES = (
    (B.Case(1, 64, 64, 2, 2, 64, False, "fp16"), False),     # exactly one tile
    (B.Case(1, 65, 65, 2, 2, 64, True, "bf16"), True),       # one past a tile, causal
    (B.Case(1, 37, 91, 4, 2, 40, True, "bf16"), False),      # headdim 40, GQA, causal sq < sk
    (B.Case(1, 37, 91, 4, 2, 40, True, "bf16"), True),
    (B.Case(1, 33, 70, 2, 2, 256, False, "fp16"), True),     # headdim 256
    (B.Case(1, 33, 70, 2, 2, 256, True, "fp16"), False),
    (B.Case(1, 97, 33, 4, 1, 128, True, "bf16"), False),     # MQA, causal sq > sk: dead rows
    (B.Case(1, 97, 33, 4, 1, 128, True, "bf16"), True),
    (B.Case(1, 1, 77, 2, 2, 128, True, "fp16"), False),      # one query
)


# (batch, seqlen_q, nheads, nheads_kv, headdim or (q's and k's, v's), capacity, seqlen_new, causal, page_size or
# None, num_splits)
DECODE_CASES = (
    (3, 1, 8, 2, 128, 256, 1, False, None, 3),   # split-KV, GQA 4, append one token
    (2, 4, 8, 2, 64, 96, 2, True, 16, 0),        # paged (16-key pages), speculative 4 queries, causal
    (2, 3, 6, 3, 256, 64, 0, True, None, 1),     # headdim 256, one split, no append
    (1, 1, 4, 1, 40, 48, 3, False, 16, 2),       # headdim 40, MQA
    (1, 1, 32, 8, 128, 2048, 1, False, None, 0),  # the bar's heads: 16 splits
    (1, 1, 8, 1, 128, 4096, 1, False, 16, 40),    # 40 splits: the last block merges them in three chunks
    (1, 1, 32, 8, 128, 2048, 0, False, 64, 0),    # paged bar heads, no append: block_table read before the wait
    (2, 2, 16, 4, (192, 128), 512, 2, True, None, 3),  # DeepSeek's q/k and v head dims
    (2, 1, 8, 2, (64, 128), 256, 1, False, 32, 2),     # v wider than q and k, paged
)


def run_decode_cases(deep=None, warp_items=None, sms=None) -> int:
    """DECODE_CASES with KernelOptions.decode_deep_ring ``deep``, decode_warp_items ``warp_items`` (with warp items,
    every case takes one split) and sm_count ``sms``; how many failed."""
    global KERNEL_OPTIONS
    KERNEL_OPTIONS = KernelOptions(decode_deep_ring=deep, decode_warp_items=warp_items, sm_count=sms)
    try:
        return sum(not check_decode(i, *case[:-1], 1 if warp_items else case[-1])
                   for i, case in enumerate(DECODE_CASES))
    finally:
        KERNEL_OPTIONS = KernelOptions()


def check_decode(i, batch, sq, h, hkv, d, cap, new, causal, page, splits) -> bool:
    """One flash_attn_with_kvcache call against flash_attn_func over each row's keys (after the append)."""
    import cupy as cp

    import fa2cupy

    rng = np.random.default_rng(100 + i)
    d, dv = d if isinstance(d, tuple) else (d, d)
    lens = rng.integers(0, cap - new + 1, size=batch).astype(np.int32)
    lens[0] = cap - new

    def randn(*shape):
        return cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(cp.float16)

    q, kc, vc = randn(batch, sq, h, d), randn(batch, cap, hkv, d), randn(batch, cap, hkv, dv)
    kn, vn = (randn(batch, new, hkv, d), randn(batch, new, hkv, dv)) if new else (None, None)
    ke, ve = kc.copy(), vc.copy()
    for b in range(batch):
        if new:
            ke[b, lens[b]:lens[b] + new], ve[b, lens[b]:lens[b] + new] = kn[b], vn[b]
    extra = {}
    if page:
        pages = cap // page
        perm = rng.permutation(batch * pages).astype(np.int32)
        kc_in, vc_in = (cp.empty((batch * pages, page, hkv, w), dtype=cp.float16) for w in (d, dv))
        kc_in[cp.asarray(perm)] = kc.reshape(batch * pages, page, hkv, d)
        vc_in[cp.asarray(perm)] = vc.reshape(batch * pages, page, hkv, dv)
        extra["block_table"] = cp.asarray(perm.reshape(batch, pages))
    else:
        kc_in, vc_in = kc, vc
    out = fa2cupy.flash_attn_with_kvcache(q, kc_in, vc_in, k=kn, v=vn, cache_seqlens=cp.asarray(lens),
                                          causal=causal, num_splits=splits, kernel_options=KERNEL_OPTIONS, **extra)
    worst = 0.0
    for b in range(batch):
        n = int(lens[b]) + new
        if n == 0:
            worst = max(worst, float(cp.abs(out[b].astype(cp.float32)).max()))
            continue
        ref = fa2cupy.flash_attn_func(q[b:b + 1], ke[b:b + 1, :n], ve[b:b + 1, :n], causal=causal)
        worst = max(worst, float(cp.abs(out[b:b + 1].astype(cp.float32) - ref.astype(cp.float32)).max()))
    ok = worst < 3e-3
    print(f"decode {i}: b{batch} sq{sq} h{h}/{hkv} d{d}/{dv} cap{cap} new{new} causal={causal} page={page} "
          f"splits={splits}: max|diff| {worst:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


# (sq, sk, h, hkv, d, causal, window_size): forward + backward with a sliding window.
WINDOW_CASES = (
    (130, 200, 4, 2, 64, False, (20, 5)),
    (200, 90, 2, 1, 128, True, (16, 0)),  # sq > sk: rows and keys with nothing visible
    (130, 200, 4, 2, 192, False, (20, 5)),
    (200, 90, 2, 1, 256, True, (16, 0)),
    (70, 70, 2, 2, 40, False, (0, -1)),
    (400, 400, 2, 1, 128, False, (150, 20)),  # bands of several tiles: the window forward's warps lead
    (300, 350, 2, 2, 96, True, (70, 0)),
)


def check_window(i, sq, sk, h, hkv, d, causal, window) -> bool:
    """Forward and backward with a sliding window against the float64 reference (fa2cupy check's bounds)."""
    import cupy as cp

    import fa2cupy
    from fa2cupy import testing
    from fa2cupy.reference import attention_ref

    rng = np.random.default_rng(200 + i)
    q, k, v, dout = (cp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(cp.float16)
                     for s in ((1, sq, h, d), (1, sk, hkv, d), (1, sk, hkv, d), (1, sq, h, d)))
    kw = dict(causal=causal, window_size=window, kernel_options=KERNEL_OPTIONS)
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    grads = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, **kw)
    host = [cp.asnumpy(x).astype(np.float64) for x in (q, k, v, dout, out)]
    ref, _ = attention_ref(*host[:3], causal=causal, window_size=window)
    ok = np.abs(host[4] - ref).max() <= testing.out_bound("fp16", np.abs(ref).max())
    for name, err, bound in testing.gradient_errors([cp.asnumpy(g) for g in grads], host[3], *host[:3], host[4],
                                                    "fp16", None, causal, window):
        ok &= err <= bound
    print(f"window {i}: sq{sq} sk{sk} h{h}/{hkv} d{d} causal={causal} window={window}: {'ok' if ok else 'FAIL'}",
          flush=True)
    return bool(ok)

# (sq, sk, h, hkv, d, causal, softcap, alibi): padded forward with a score modifier on the Hopper rows that take
# them (configs.hopper_takes_mods), ragged ends on both sides; ALiBi alone runs the ALiBi-only kernels (at every
# head dim, without a mask or causal).
MODS_CASES = (
    (150, 190, 4, 2, 64, False, 3.0, True),
    (150, 190, 4, 2, 64, True, 0.0, True),
    (130, 200, 4, 2, 128, True, 5.0, False),
    (200, 90, 2, 1, 128, False, 0.0, True),
    (130, 200, 4, 2, 192, True, 3.0, True),
    (130, 200, 4, 2, 192, False, 3.0, True),
    (130, 200, 4, 2, 192, False, 0.0, True),
    (200, 150, 2, 1, 256, True, 5.0, False),
    (200, 150, 2, 1, 256, True, 0.0, True),
    (90, 200, 2, 2, 256, False, 0.0, True),
    (300, 200, 2, 1, 192, False, 3.0, False),  # (deterministic: walks rotated, more query tiles than key tiles)
    (260, 130, 2, 1, 256, False, 0.0, True),
)
# MODS_CASES' fields for bf16 softcap without ALiBi, q scaled by 8 so that the logits reach both ends of the cap: at
# softcap <= 50 the Hopper rows above d = 64 take P against a fixed reference max (HopperFwdTraits::kCapFixedMax), in
# one pass with the tanh on tiles without a mask; 60 keeps the running max.
CAP_FIXED_CASES = (
    (150, 330, 4, 2, 128, False, 30.0, False),
    (330, 200, 4, 2, 128, True, 50.0, False),
    (130, 200, 4, 2, 192, True, 30.0, False),
    (200, 150, 2, 1, 256, False, 50.0, False),
    (200, 150, 2, 1, 256, True, 60.0, False),
)


def check_mods(i, sq, sk, h, hkv, d, causal, softcap, alibi, backward=False, dtype="fp16", q_scale=1.0,
               deterministic=False) -> bool:
    """Forward (and with ``backward`` the backward, ``deterministic`` or not) with softcap / ALiBi against the
    float64 reference (fa2cupy check's bounds); q scaled by ``q_scale`` before rounding to ``dtype``."""
    import cupy as cp

    import fa2cupy
    from fa2cupy import testing
    from fa2cupy.reference import attention_ref, attention_ref_backward

    rng = np.random.default_rng(250 + i)
    rounded = [B.round_host(rng.standard_normal(s, dtype=np.float32) * (q_scale if n == 0 else 1.0), dtype)
               for n, s in enumerate(((2, sq, h, d), (2, sk, hkv, d), (2, sk, hkv, d)))]
    q, k, v = (B.to_device(payload, dtype, "cupy") for payload, _ in rounded)
    slopes = rng.uniform(0, 0.3, (2, h)).astype(np.float32) if alibi else None
    slopes_d = None if slopes is None else cp.asarray(slopes)
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes_d,
                                          kernel_options=KERNEL_OPTIONS, return_attn_probs=True)
    host = [values for _, values in rounded] + [cp.asnumpy(out).astype(np.float64)]
    ref, _ = attention_ref(*host[:3], causal=causal, softcap=softcap, alibi_slopes=slopes)
    ok = np.abs(host[3] - ref).max() <= testing.out_bound(dtype, np.abs(ref).max())
    if backward:
        dout_payload, dout64 = B.round_host(rng.standard_normal(out.shape, dtype=np.float32), dtype)
        dout = B.to_device(dout_payload, dtype, "cupy")
        grads = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, softcap=softcap,
                                            alibi_slopes=slopes_d, deterministic=deterministic,
                                            kernel_options=KERNEL_OPTIONS)
        refs = attention_ref_backward(dout64, *host[:3], None, causal, (-1, -1), softcap, slopes, out=host[3])
        for _, err, bound in testing.gradient_errors([cp.asnumpy(g) for g in grads], dout64, *host[:3], host[3],
                                                     dtype, None, causal, ref_grads=refs):
            ok &= err <= bound
    passes = (" (+ deterministic backward)" if deterministic else " (+ backward)") if backward else ""
    print(f"mods {i}: {dtype} sq{sq} sk{sk} h{h}/{hkv} d{d} causal={causal} softcap={softcap} alibi={alibi}{passes}: "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return bool(ok)


# More backward cases for the Hopper dK/dV kernel (every head dim of its table): several key blocks and query tiles,
# the ring's slots and dS buffers reused, GQA sums, ragged ends on both sides.
HOPPER_BWD_CASES = (
    B.Case(1, 200, 300, 4, 2, 128, False, "bf16"),
    B.Case(2, 190, 130, 2, 1, 128, True, "fp16"),
    B.Case(1, 200, 300, 4, 2, 64, False, "fp16"),
    B.Case(2, 190, 130, 2, 1, 64, True, "bf16"),
    B.Case(1, 200, 300, 4, 2, 192, True, "bf16"),
    B.Case(2, 190, 130, 2, 1, 256, False, "fp16"),
    B.Case(1, 300, 200, 4, 2, 64, False, "bf16"),  # (deterministic: walks rotated, more query tiles than key tiles)
    B.Case(1, 300, 200, 2, 1, 192, False, "fp16"),
    B.Case(1, 200, 300, 4, 2, 72, True, "bf16"),   # (the 128 row, score products over 80 columns)
    B.Case(2, 190, 130, 2, 1, 96, False, "fp16"),  # (over 96)
    B.Case(1, 130, 200, 2, 1, 144, True, "bf16"),  # (the 192 row, over 160)
)

# (lengths, h, hkv, d, causal, window_size, softcap, alibi, deterministic): varlen forward + backward.
VARLEN_CASES = (
    ((70, 0, 1, 130), 4, 2, 64, True, (-1, -1), 0.0, False, False),
    ((33, 90), 2, 1, 128, False, (16, 4), 2.0, True, True),
    ((65,), 2, 2, 40, True, (-1, -1), 5.0, True, False),
    ((70, 0, 1, 130), 4, 2, 256, True, (-1, -1), 0.0, False, False),
    ((33, 150), 2, 1, 192, True, (-1, -1), 3.0, True, False),
)

# Varlen cases for the Hopper dK/dV kernel (no modifiers; dQ added atomically, or in turns when deterministic): empty
# and one-row sequences, key blocks past a sequence's end.
HOPPER_BWD_VARLEN_CASES = (
    ((70, 0, 1, 130), 4, 2, 128, True, (-1, -1), 0.0, False, False),
    ((33, 190), 2, 1, 128, False, (16, 4), 0.0, False, False),
    ((70, 0, 1, 130), 4, 2, 64, True, (-1, -1), 0.0, False, False),
    ((33, 190), 2, 1, 64, False, (16, 4), 0.0, False, False),
    ((70, 0, 1, 130), 4, 2, 192, True, (-1, -1), 0.0, False, False),
    ((33, 190), 2, 1, 256, False, (16, 4), 0.0, False, False),
    ((70, 0, 1, 130), 4, 2, 128, True, (-1, -1), 0.0, False, True),  # deterministic: the turns per sequence
    ((33, 190), 2, 1, 64, False, (16, 4), 0.0, False, True),
    ((70, 0, 1, 130), 4, 2, 80, True, (-1, -1), 0.0, False, False),  # (score products over 80 of the 128 row's)
    ((33, 190), 2, 1, 160, False, (-1, -1), 0.0, False, True),
)
# Softcap / ALiBi on the Hopper dK/dV kernel's varlen modifier rows (KernelOptions(hopper_backward_mods=True), head
# dims 64, 192 and 256); the padded ones (every head dim) run MODS_CASES.
HOPPER_BWD_MODS_CASES = (
    ((70, 0, 1, 130), 4, 2, 64, True, (-1, -1), 5.0, True, False),
    ((33, 190), 2, 1, 64, False, (16, 4), 0.0, True, True),
    ((150,), 2, 2, 64, False, (-1, -1), 3.0, False, False),
    ((70, 0, 1, 130), 4, 2, 192, True, (-1, -1), 5.0, True, False),
    ((70, 0, 1, 130), 4, 2, 192, False, (-1, -1), 3.0, True, True),
    ((33, 190), 2, 1, 256, False, (16, 4), 3.0, False, True),
)
# Dropout on the Hopper kernels' varlen modifier rows (d = 192: forward and dK/dV kernel), check_varlen's fields and
# the dropout probability: empty and one-row sequences, a window with softcap and ALiBi, both backward modes.
HOPPER_DROPOUT_VARLEN_CASES = (
    ((70, 0, 1, 130), 4, 2, 192, True, (-1, -1), 0.0, False, False, 0.3),
    ((33, 190), 2, 1, 192, False, (16, 4), 3.0, True, True, 0.1),
)


def varlen_dropout_refs(q, k, v, dout, out, cu, ref_kw, dropout_p, seed, offset):
    """(out, (dq, dk, dv)) of the float64 reference for a varlen dropout call whose q and k/v share ``cu``, sequence
    by sequence: sequence b drops what batch entry b of a padded call with the same seed and offset drops
    (fa2cupy.dropout_mask), with the dropout probability the kernels realise (a multiple of 1/256)."""
    import cupy as cp

    import fa2cupy
    from fa2cupy.forward import realised_dropout_p
    from fa2cupy.reference import attention_ref, attention_ref_backward

    longest = max(1, int(np.diff(cu).max()))
    mask = cp.asnumpy(fa2cupy.dropout_mask(len(cu) - 1, q.shape[1], longest, longest, dropout_p, seed, offset))
    ref, grads = np.zeros(out.shape), [np.zeros(x.shape) for x in (q, k, v)]
    slopes = ref_kw["alibi_slopes"]
    for b in range(len(cu) - 1):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        n = rows.stop - rows.start
        if n == 0:
            continue
        kw = dict(ref_kw, alibi_slopes=None if slopes is None else slopes[b:b + 1],
                  dropout_p=realised_dropout_p(dropout_p), dropout_mask=mask[b:b + 1, :, :n, :n])
        ref[rows] = attention_ref(q[None, rows], k[None, rows], v[None, rows], **kw)[0][0]
        g = attention_ref_backward(dout[None, rows], q[None, rows], k[None, rows], v[None, rows], out=out[None, rows],
                                   **kw)
        for x, gx in zip(grads, g):
            x[rows] = gx[0]
    return ref, grads


def check_varlen(i, lengths, h, hkv, d, causal, window, softcap, alibi, det, dropout_p=0.0) -> bool:
    """Varlen (with softcap / ALiBi, and dropout) forward and backward against the float64 reference."""
    import cupy as cp

    import fa2cupy
    from fa2cupy import testing
    from fa2cupy.forward import realised_dropout_p
    from fa2cupy.reference import attention_ref_varlen, attention_ref_varlen_backward

    rng = np.random.default_rng(300 + i)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1]) + 3  # three rows past the last sequence
    q, k, v, dout = (cp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(cp.float16)
                     for s in ((total, h, d), (total, hkv, d), (total, hkv, d), (total, h, d)))
    slopes = cp.asarray(rng.uniform(0, 0.3, (len(lengths), h)).astype(np.float32)) if alibi else None
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    ref_kw = dict(kw, alibi_slopes=None if slopes is None else cp.asnumpy(slopes))
    kw["kernel_options"] = KERNEL_OPTIONS
    if dropout_p:
        kw.update(dropout_p=dropout_p, dropout_seed=600 + i, dropout_offset=8)
    cu_d = cp.asarray(cu)
    m = max(lengths)
    out, lse, _ = fa2cupy.flash_attn_varlen_func(q, k, v, cu_d, cu_d, m, m, return_attn_probs=True, **kw)
    grads = fa2cupy.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_d, cu_d, m, m, deterministic=det, **kw)
    host = [cp.asnumpy(x).astype(np.float64) for x in (q, k, v, dout, out)]
    if dropout_p:
        ref, refs = varlen_dropout_refs(*host, cu, ref_kw, dropout_p, 600 + i, 8)
    else:
        ref, _ = attention_ref_varlen(*host[:3], cu, cu, **ref_kw)
        refs = attention_ref_varlen_backward(host[3], *host[:3], cu, cu, out=host[4], **ref_kw)
    keep = 1 - realised_dropout_p(dropout_p)
    rows = slice(0, int(cu[-1]))
    ok = np.abs(host[4][rows] - ref[rows]).max() <= testing.out_bound("fp16", np.abs(ref).max()) / keep
    floor = testing.gradient_floor(d ** -0.5 / keep, d, np.abs(host[3]).max(), np.abs(host[2]).max(),
                                   np.abs(host[0]).max())
    for g, r in zip(grads, refs):
        ok &= np.abs(cp.asnumpy(g).astype(np.float64)[rows] - r[rows]).max() <= testing.gradient_bound(
            "fp16", np.abs(r).max(), floor)
    print(f"varlen {i}: lengths {lengths} h{h}/{hkv} d{d} causal={causal} window={window} softcap={softcap} "
          f"alibi={alibi} deterministic={det}{f' dropout_p={dropout_p}' if dropout_p else ''}: "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return bool(ok)


# (b, sq, sk, h, hkv, d, causal, dropout_p, deterministic, softcap): forward + backward with dropout. The head dims
# reach every warp tiling of the dropout draw (16 or 32 rows and keys per warp, both backward kernels), the softcap
# the kernels' path with modifiers and dropout together; DROPOUT_SM86 runs its case on the sm86 rows (16-key dQ
# tiles, 16-row dK/dV blocks).
DROPOUT_CASES = (
    (1, 70, 90, 2, 1, 64, True, 0.3, False, 0.0),
    (2, 33, 33, 2, 2, 128, False, 0.5, True, 0.0),
    (1, 77, 100, 2, 1, 160, True, 0.3, True, 0.0),    # 16-row forward warps, 16-key dK/dV warps
    (1, 50, 130, 2, 2, 256, False, 0.2, False, 0.0),  # 16-query dK/dV warps
    (1, 65, 65, 4, 2, 64, True, 0.1, True, 5.0),      # softcap and dropout
)
DROPOUT_SM86 = ((1, 45, 70, 2, 1, 224, False, 0.4, True, 0.0),)
# Dropout on the Hopper kernels' padded modifier rows (on sm_90 the forward's and dK/dV kernel's at d = 128 and 256),
# DROPOUT_CASES' fields: ragged ends on both sides, causal with sq != sk, GQA, softcap and dropout together.
HOPPER_DROPOUT_CASES = (
    (1, 150, 190, 4, 2, 128, True, 0.3, False, 0.0),
    (2, 130, 70, 2, 1, 128, False, 0.1, True, 5.0),
    (1, 130, 200, 4, 2, 256, True, 0.2, True, 0.0),
    (1, 200, 90, 2, 1, 256, False, 0.3, False, 3.0),
)


def check_dropout(i, b, sq, sk, h, hkv, d, causal, p, det, softcap=0.0, backward=True) -> bool:
    """Dropout forward (and with ``backward`` the backward) against the reference applying fa2cupy.dropout_mask's
    mask, with the dropout probability the kernels realise (a multiple of 1/256)."""
    import cupy as cp

    import fa2cupy
    from fa2cupy import testing
    from fa2cupy.forward import realised_dropout_p
    from fa2cupy.reference import attention_ref, attention_ref_backward

    rng = np.random.default_rng(400 + i)
    q, k, v, dout = (cp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(cp.float16)
                     for s in ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)))
    kw = dict(causal=causal, softcap=softcap, dropout_p=p, dropout_seed=1000 + i, dropout_offset=8,
              kernel_options=KERNEL_OPTIONS)
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    grads = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, deterministic=det, **kw) if backward else ()
    mask = cp.asnumpy(fa2cupy.dropout_mask(b, h, sq, sk, p, 1000 + i, 8))
    host = [cp.asnumpy(x).astype(np.float64) for x in (q, k, v, dout, out)]
    pr = realised_dropout_p(p)
    ref, ref_lse = attention_ref(*host[:3], causal=causal, softcap=softcap, dropout_p=pr, dropout_mask=mask)
    ok = np.abs(host[4] - ref).max() <= testing.out_bound("fp16", np.abs(ref).max()) / (1 - pr)
    lse_h = cp.asnumpy(lse).astype(np.float64)  # (the lse of the undropped softmax; +inf where no key is seen)
    live = np.isfinite(ref_lse)
    ok &= bool(np.all(lse_h[~live] == np.inf)) and bool(
        np.all(np.abs(lse_h[live] - ref_lse[live]) <= 1e-3 * (1 + np.abs(ref_lse[live]))))
    refs = attention_ref_backward(host[3], *host[:3], causal=causal, softcap=softcap, out=host[4], dropout_p=pr,
                                  dropout_mask=mask) if backward else ()
    floor = testing.gradient_floor(d ** -0.5 / (1 - pr), d, np.abs(host[3]).max(), np.abs(host[2]).max(),
                                   np.abs(host[0]).max())
    for g, r in zip(grads, refs):
        ok &= np.abs(cp.asnumpy(g).astype(np.float64) - r).max() <= testing.gradient_bound("fp16", np.abs(r).max(), floor)
    print(f"dropout {i}: b{b} sq{sq} sk{sk} h{h}/{hkv} d{d} causal={causal} p={p} deterministic={det} "
          f"softcap={softcap}{'' if backward else ' (forward only)'}: {'ok' if ok else 'FAIL'}", flush=True)
    return bool(ok)


# (lengths_q, lengths_k, h, hkv, d, page_size, window_size): causal paged varlen forward + backward.
PAGED_CASES = (
    ((70, 0, 1, 130), (90, 3, 40, 130), 4, 2, 64, 16, (-1, -1)),
    ((33, 90), (100, 17), 2, 1, 128, 48, (16, 4)),
    ((70, 0, 1, 130), (90, 3, 40, 130), 4, 2, 256, 16, (-1, -1)),
    ((33, 90), (100, 17), 2, 1, 192, 48, (16, 4)),
    ((65,), (65,), 2, 2, 40, 1, (-1, -1)),
)


def check_paged(i, lengths_q, lengths_k, h, hkv, d, page_size, window) -> bool:
    """Paged varlen (block_table) against the packed varlen call on the same keys: bitwise forward, deterministic
    backward (dq bitwise, dk/dv summed onto pages)."""
    import cupy as cp

    import fa2cupy
    from fa2cupy import paging

    rng = np.random.default_rng(500 + i)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q, dout = (rng.standard_normal((int(cu_q[-1]), h, d), dtype=np.float32).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((int(cu_k[-1]), hkv, d), dtype=np.float32).astype(np.float16) for _ in range(2))
    table, num_pages = paging.shuffled_block_table(rng, lengths_k, page_size, spare_pages=2, unused=0)
    k_pages, v_pages = (rng.standard_normal((num_pages, page_size, hkv, d), dtype=np.float32).astype(np.float16)
                        for _ in range(2))
    for pages, packed in ((k_pages, k), (v_pages, v)):
        paging.write_pages(np, pages, packed, cu_k, table)
    q, dout, k, v, k_pages, v_pages, table, cu_qd, cu_kd = (
        cp.asarray(x) for x in (q, dout, k, v, k_pages, v_pages, table, cu_q, cu_k))
    mq, mk = max(lengths_q), max(lengths_k)
    kw = dict(causal=True, window_size=window, deterministic=True, kernel_options=KERNEL_OPTIONS)
    out_p, lse_p, _ = fa2cupy.flash_attn_varlen_func(q, k_pages, v_pages, cu_qd, cu_kd, mq, mk, block_table=table,
                                                     return_attn_probs=True, **kw)
    out, lse, _ = fa2cupy.flash_attn_varlen_func(q, k, v, cu_qd, cu_kd, mq, mk, return_attn_probs=True, **kw)
    ok = bool(cp.array_equal(out_p, out)) and bool(cp.array_equal(lse_p, lse))
    dq_p, dk_p, dv_p = fa2cupy.flash_attn_varlen_backward(dout, q, k_pages, v_pages, out, lse, cu_qd, cu_kd, mq, mk,
                                                          block_table=table, **kw)
    dq, dk, dv = fa2cupy.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_qd, cu_kd, mq, mk, **kw)
    ok &= bool(cp.array_equal(dq_p, dq))
    pages_of = cp.asarray(np.concatenate([table[b, np.arange(n) // page_size] for b, n in enumerate(lengths_k)]))
    slots = cp.asarray(np.concatenate([np.arange(n) % page_size for n in lengths_k]))
    ok &= bool(cp.array_equal(dk_p[pages_of, slots], dk)) and bool(cp.array_equal(dv_p[pages_of, slots], dv))
    fa2cupy.check_device_errors()
    print(f"paged {i}: lengths q {lengths_q} k {lengths_k} h{h}/{hkv} d{d} page {page_size} window={window}: "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return ok


def check_forward(i, case) -> bool:
    """cli.run_check_case's forward check (the float64 reference, ``fa2cupy check``'s bounds) with KERNEL_OPTIONS."""
    import fa2cupy
    from fa2cupy.reference import attention_ref
    from fa2cupy.testing import to_numpy64

    host = B.host_inputs(case, i)
    dev = {n: B.to_device(p, case.dtype, "cupy") for n, (p, _) in host.items()}
    out, lse, _ = fa2cupy.flash_attn_func(dev["q"], dev["k"], dev["v"], causal=case.causal, return_attn_probs=True,
                                          kernel_options=KERNEL_OPTIONS)
    ref_out, ref_lse = attention_ref(host["q"][1], host["k"][1], host["v"][1], causal=case.causal)
    r = cli.compare(case, to_numpy64(out), to_numpy64(lse), np.asarray(ref_out, np.float64),
                    np.asarray(ref_lse, np.float64))
    print(f"{KERNEL_OPTIONS.sm_count} SMs:", cli.check_row(i, r), flush=True)
    return r.passed


def main(groups) -> int:
    global KERNEL_OPTIONS
    ok, msg = cli.probe_gpu()
    if not ok:
        print(msg)
        return 2
    print(cli.check_header(), flush=True)
    bad = total = 0
    if "fwd" in groups:
        for i, case in enumerate(CASES):
            r = cli.run_check_case(case, seed=i, backward=False)
            print(cli.check_row(i, r), flush=True)
            bad += not r.passed
            total += 1
    if "bwd" in groups:
        for j, (case, det) in enumerate(BWD_CASES, start=len(CASES)):
            r = cli.run_check_case(case, seed=j, backward=True, deterministic=det)
            print(cli.check_row(j, r), flush=True)
            bad += not r.passed
            total += 1
    if "window" in groups:
        for i, case in enumerate(WINDOW_CASES):
            bad += not check_window(i, *case)
            total += 1
    if "varlen" in groups:
        for i, case in enumerate(VARLEN_CASES):
            bad += not check_varlen(i, *case)
            total += 1
    if "paged" in groups:
        for i, case in enumerate(PAGED_CASES):
            bad += not check_paged(i, *case)
            total += 1
    if "paged_mma" in groups:  # the paged cases on the mma.sync forward (on sm_90 the Hopper one takes most)
        KERNEL_OPTIONS = KernelOptions(hopper_forward=False)
        for i, case in enumerate(PAGED_CASES):
            bad += not check_paged(i, *case)
            total += 1
        KERNEL_OPTIONS = KernelOptions()
    if "dropout" in groups:
        for i, case in enumerate(DROPOUT_CASES):
            bad += not check_dropout(i, *case)
            total += 1
        from fa2cupy import pipeline

        real_family = configs.arch_family
        configs.arch_family = lambda arch: "sm86"  # (the sm86 rows fit any sm_80+ GPU's shared memory)
        pipeline.forget_plans()
        for i, case in enumerate(DROPOUT_SM86, start=len(DROPOUT_CASES)):
            bad += not check_dropout(i, *case)
            total += 1
        configs.arch_family = real_family
        pipeline.forget_plans()
    if "decode" in groups:
        bad, total = bad + run_decode_cases(), total + len(DECODE_CASES)
    if "decode_deep" in groups:  # the decode cases with the deep ring wherever a row has one (d=128, sm_90)
        bad, total = bad + run_decode_cases(deep=True), total + len(DECODE_CASES)
    if "decode_walk" in groups:  # the decode cases on a pretend 2-SM GPU: blocks walk several items, both rings
        for deep in (False, True):
            bad, total = bad + run_decode_cases(deep=deep, sms=2), total + len(DECODE_CASES)
    if "decode_warp" in groups:  # one split, warps streaming whole items (d=128, sm_90), on 1 and 2 pretend SMs
        for sms in (1, 2):
            for deep in (False, True):
                bad += run_decode_cases(deep=deep, warp_items=True, sms=sms)
                total += len(DECODE_CASES)
    if "bwd_hopper" in groups:  # the backward and window cases of the Hopper dK/dV kernel's head dims, on sm_90
        for j, (case, det) in enumerate(BWD_CASES, start=len(CASES)):
            if case.headdim in configs.BACKWARD_HOPPER_TABLE:  # (deterministic: the dQ reductions in turns)
                r = cli.run_check_case(case, seed=j, backward=True, deterministic=det)
                print(cli.check_row(j, r), flush=True)
                bad += not r.passed
                total += 1
        for j, case in enumerate(HOPPER_BWD_CASES, start=len(CASES) + len(BWD_CASES)):
            for det in (False, True):
                r = cli.run_check_case(case, seed=j, backward=True, deterministic=det)
                print(cli.check_row(j, r), flush=True)
                bad += not r.passed
                total += 1
        for i, case in enumerate(c for c in WINDOW_CASES if c[4] in configs.BACKWARD_HOPPER_TABLE):
            bad += not check_window(i, *case)
            total += 1
        for i, case in enumerate(HOPPER_BWD_VARLEN_CASES):
            bad += not check_varlen(i, *case)
            total += 1
        KERNEL_OPTIONS = KernelOptions(hopper_backward_mods=True)
        for i, case in enumerate(HOPPER_BWD_MODS_CASES):
            bad += not check_varlen(i, *case)
            total += 1
        for i, case in enumerate(c for c in MODS_CASES if c[4] in configs.HOPPER_BWD_MODS_HEADDIMS):
            for det in (False, True):  # (padded: d = 128's rows too)
                bad += not check_mods(i, *case, backward=True, deterministic=det)
                total += 1
        for i, case in enumerate(HOPPER_DROPOUT_CASES, start=len(DROPOUT_CASES) + len(DROPOUT_SM86)):
            bad += not check_dropout(i, *case)  # dropout on the modifier rows
            total += 1
        for i, case in enumerate(HOPPER_DROPOUT_VARLEN_CASES):
            bad += not check_varlen(i, *case)
            total += 1
        KERNEL_OPTIONS = KernelOptions()
    if "fwd_hopper" in groups:
        for sms in (1, 2):  # (masked calls of every length on the Hopper forward too)
            KERNEL_OPTIONS = KernelOptions(hopper_masked_min_seqlen=0, sm_count=sms)
            for i, case in enumerate(c for c in CASES if c.headdim in configs.FORWARD_HOPPER_TABLE):
                bad += not check_forward(i, case)
                total += 1
            for i, case in enumerate(c for c in WINDOW_CASES if c[4] in configs.FORWARD_HOPPER_TABLE):
                bad += not check_window(i, *case)
                total += 1
            for i, case in enumerate(c for c in VARLEN_CASES if c[3] in configs.FORWARD_HOPPER_TABLE):
                bad += not check_varlen(i, *case)
                total += 1
            for i, case in enumerate(c for c in PAGED_CASES if c[4] in configs.FORWARD_HOPPER_TABLE):  # paged K/V
                bad += not check_paged(i, *case)
                total += 1
            for i, case in enumerate(MODS_CASES):
                bad += not check_mods(i, *case)
                total += 1
            for i, case in enumerate(CAP_FIXED_CASES, start=len(MODS_CASES)):
                bad += not check_mods(i, *case, dtype="bf16", q_scale=8.0)
                total += 1
            for i, case in enumerate(HOPPER_DROPOUT_CASES, start=len(DROPOUT_CASES) + len(DROPOUT_SM86)):
                bad += not check_dropout(i, *case, backward=False)  # dropout on the modifier rows
                total += 1
            for i, case in enumerate(HOPPER_DROPOUT_VARLEN_CASES):
                bad += not check_varlen(i, *case)
                total += 1
        KERNEL_OPTIONS = KernelOptions()
    print(f"{total - bad}/{total} passed")
    return 1 if bad else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main(sys.argv[1:] or ("fwd", "bwd", "window", "varlen", "paged", "dropout", "decode", "decode_deep",
                                   "decode_walk", "decode_warp")))
