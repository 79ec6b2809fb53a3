"""Public entry points. Data flows one way: arrays in -> checks -> config -> launch -> arrays out, in the caller's
framework, on the caller's stream."""

from __future__ import annotations

import dataclasses
import math

import cupy

from . import arrays, backward, checks, decode, device_errors, forward, packed, paging

_arch_by_device: dict[int, int] = {}


def _arch(device: int) -> int:
    arch = _arch_by_device.get(device)
    if arch is None:
        arch = _arch_by_device[device] = int(cupy.cuda.Device(device).compute_capability)
    return arch


def _kernel_ready(x, headdim: int):
    """A view or copy of CuPy array ``x`` that the kernels can read: head dim padded with zeros to a multiple
    of 8, 16-byte aligned rows, and row strides that fit the kernels' 32-bit row arithmetic.

    Zero padding is exact: padded q/k columns add 0 to every score and padded v columns only produce output
    columns that are sliced away.
    """
    padded = -(-headdim // 8) * 8
    if padded != headdim:
        wide = cupy.zeros(x.shape[:3] + (padded,), dtype=x.dtype)
        wide[..., :headdim] = x
        return wide
    item = x.itemsize
    aligned = x.data.ptr % 16 == 0 and all(s % (8 * item) == 0 for s in x.strides[:3])
    if not aligned or abs(x.strides[1]) // item >= forward.MAX_ROW_STRIDE:
        return cupy.ascontiguousarray(x)
    return x


def _elem_strides(x) -> tuple:
    return tuple(s // x.itemsize for s in x.strides)


def _device_of(info) -> int:
    """The CUDA device a call runs on: its array's, or the current one for host NumPy inputs."""
    return info.device[1] if info.device[0] == "cuda" else cupy.cuda.runtime.getDevice()


def _describe_optional(x, name: str):
    """ArrayInfo of an optional array argument (alibi_slopes, dropout_rng_state), or None."""
    return None if x is None else arrays.describe(x, name)


def _contiguous(x, info):
    """A C-contiguous CuPy view of a small side array (cu_seqlens, lse, the dropout rng state): the caller's own
    memory when it already is contiguous, else a copy; None for None."""
    return None if x is None else cupy.ascontiguousarray(arrays.to_cupy(x, info))


def _used_in_place(used, given) -> bool:
    """Whether the kernel-ready CuPy arrays ``used`` are the caller's ``given`` arrays themselves (same memory, no
    copy made while adapting them), so that a later call with the same metadata may launch on the given pointers.
    False for arrays without a fast path (NumPy, JAX)."""
    metas = [arrays.fast_meta(g) for g in given]
    return all(m is not None and u.data.ptr == m[1] for u, m in zip(used, metas))


def _alibi_ready(alibi_slopes, info):
    """(CuPy slopes with a contiguous head axis or None, their batch stride in elements or None, whether the
    caller's array is used as is). (nheads,) slopes have batch stride 0."""
    if alibi_slopes is None:
        return None, None, True
    given = arrays.to_cupy(alibi_slopes, info)
    slopes = given if given.strides[-1] == 4 and given.data.ptr % 4 == 0 else cupy.ascontiguousarray(given)
    return slopes, (slopes.strides[0] // 4 if slopes.ndim == 2 else 0), slopes is given


class _CachedCall:
    """What a validated call left behind for identical later calls (same metadata, aligned pointers): the plan
    and the (shape, dtype) of every array the call allocates, in allocation order."""

    __slots__ = ("plan", "device", "framework", "allocations")

    def __init__(self, plan, device, framework, allocations):
        self.plan, self.device, self.framework, self.allocations = plan, device, framework, allocations

    def allocate(self):
        """[(array in the caller's framework, device pointer)] for every allocation, on the current stream."""
        return [arrays.new_empty_raw(shape, dtype, self.framework, self.device) for shape, dtype in self.allocations]


#: Validated plans by call metadata (see arrays.fast_meta): a repeated call skips checks, array adaptation and
#: planning, which are ~90% of the host time of a small problem.
_cached_calls: dict = {}
_MAX_CACHED_CALLS = 1024


def _cached_lookup(kind: str, inputs, options):
    """(key, cached call or None, input pointers) for the fast path; key None when the call cannot be cached
    (a framework without a fast path, an unhashable option). ``inputs`` may hold None for an absent optional
    array: the key records the absence and its pointer is 0. A cached call is returned only if every pointer
    is 16-byte aligned and its device is the current one."""
    metas, pointers, bits = [], [], 0
    fast_meta = arrays.fast_meta
    for x in inputs:
        if x is None:
            metas.append(None)
            pointers.append(0)
            continue
        meta = fast_meta(x)
        if meta is None:
            return None, None, None
        metas.append(meta[0])
        pointers.append(meta[1])
        bits |= meta[1]
    key = (kind, tuple(metas), options)
    try:
        cached = _cached_calls.get(key)
    except TypeError:  # an unhashable option (say a list window_size): take the checked path
        return None, None, None
    if cached is not None and (bits & 15 or cupy.cuda.runtime.getDevice() != cached.device):
        cached = None
    return key, cached, pointers


def _remember(key, cached: _CachedCall) -> None:
    if key is None:
        return
    if len(_cached_calls) >= _MAX_CACHED_CALLS:
        _cached_calls.clear()
    _cached_calls[key] = cached


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    dropout_seed=None,
    dropout_offset=0,
    dropout_rng_state=None,
):
    """Exact attention ``softmax(q k^T * softmax_scale) v`` by FlashAttention-2, flash-attn 2.x compatible.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``; k, v: ``(batch, seqlen_k, nheads_kv, headdim)``. float16 or
            bfloat16, all the same dtype, from CuPy, PyTorch, JAX (device arrays) or NumPy (copied to the current
            GPU). ``nheads`` must be a multiple of ``nheads_kv`` (MQA/GQA: query head ``h`` reads K/V head
            ``h // (nheads // nheads_kv)``). ``headdim`` 1..256. The last axis must be contiguous; the other
            axes may have any strides (e.g. a ``(batch, nheads, seqlen, headdim)`` tensor viewed with
            ``transpose(1, 2)``).
        softmax_scale: scale of the scores; default ``1 / sqrt(headdim)``.
        causal: bottom-right aligned causal mask: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k -
            seqlen_q``. A query that sees no key outputs 0 (and its lse is +inf).
        window_size: ``(left, right)`` sliding-window (local) attention, flash-attn semantics: query ``i`` sees key
            ``j`` iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``; -1 = no limit on
            that side; with ``causal`` the right side is 0. Key tiles outside every row's window are skipped, so
            the cost falls with the window.
        softcap: ``> 0`` passes the scaled scores through ``softcap * tanh(s / softcap)`` (Gemma 2, Grok).
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``: adds the ALiBi bias ``-slope * |i + seqlen_k -
            seqlen_q - j|`` to the (capped) scores.
        dropout_p: in [0, 1): each entry of P is dropped with this probability, realised as the nearest multiple
            of 1/256 (0 below 1/512: ``fa2cupy.forward.realised_dropout_p``), and the kept ones scaled by
            ``1 / (1 - p)`` of that realised p (Philox in the kernel; see :func:`dropout_mask`).
        dropout_seed, dropout_offset: with ``dropout_p > 0``, the Philox seed (required) and offset, ints in
            [0, 2**64): the same pair gives the same mask, bit for bit, and flash_attn_backward needs the same pair.
            (``fa2cupy.torch`` draws them from torch's CUDA generator.) ``dropout_rng_state``, a device uint32 array
            (4,) = (seed lo, seed hi, offset lo, offset hi), gives them from GPU memory instead (``fa2cupy.jax``).
        deterministic: accepted for compatibility; the forward is always deterministic.
        return_attn_probs: also return the log-sum-exp (see Returns).

    Returns:
        ``out`` shaped and typed like q, in q's framework; with ``return_attn_probs=True`` the tuple
        ``(out, softmax_lse, probs)`` with ``softmax_lse`` float32 ``(batch, nheads, seqlen_q)``, natural log, and
        ``probs`` None without dropout; with dropout the float32 ``(batch, nheads, seqlen_q, seqlen_k)``
        probabilities the output was made of, ``P o Z / (1 - p)`` (for tests at small sizes: it is recomputed;
        None with ``dropout_rng_state``).

    Raises:
        TypeError / ValueError naming the offending argument for bad shapes, dtypes, devices or layouts.
    """
    key = None
    if not forward._debug_poison and dropout_rng_state is None:
        options = (dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)
        key, cached, ptrs = _cached_lookup("fwd", (q, k, v, alibi_slopes), options)
        if cached is not None and (not dropout_p or not return_attn_probs):
            seed, offset = checks.check_dropout_rng(dropout_p, dropout_seed, dropout_offset)
            stream_ptr = arrays.caller_stream_ptr(cached.framework, cached.device)
            (out, out_ptr), (lse, lse_ptr) = cached.allocate()
            forward.run_forward(cached.plan, ptrs[0], ptrs[1], ptrs[2], out_ptr, lse_ptr, stream_ptr,
                                alibi_slopes=ptrs[3], dropout_seed=seed, dropout_offset=offset,
                                framework=cached.framework, device=cached.device)
            return (out, lse, None) if return_attn_probs else out
    return _flash_attn_checked(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, key, dropout_seed, dropout_offset, dropout_rng_state,
    )


flash_attn_qkvpacked_func, flash_attn_kvpacked_func = packed.make_packed(flash_attn_func)


def _flash_attn_checked(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    return_attn_probs, cache_key, dropout_seed=None, dropout_offset=0, dropout_rng_state=None,
):
    """The full path: describe, validate, adapt (copy where the kernels need it), plan, launch; and remember
    the plan under ``cache_key`` when the inputs were used in place."""
    q_info, k_info, v_info = arrays.describe(q, "q"), arrays.describe(k, "k"), arrays.describe(v, "v")
    alibi_info = _describe_optional(alibi_slopes, "alibi_slopes")
    shape = checks.check_forward_args(
        q_info,
        k_info,
        v_info,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_info,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    state_info = _describe_optional(dropout_rng_state, "dropout_rng_state")
    seed, offset = checks.check_dropout_rng(dropout_p, dropout_seed, dropout_offset, state_info)
    scale = checks.default_scale(shape.headdim) if softmax_scale is None else float(softmax_scale)
    framework = q_info.framework
    device = _device_of(q_info)
    padded = -(-shape.headdim // 8) * 8

    with cupy.cuda.Device(device):
        stream = arrays.caller_stream(framework, device)
        with stream:  # copies made while adapting inputs belong on the caller's stream too
            q_in, k_in, v_in = arrays.to_cupy(q, q_info), arrays.to_cupy(k, k_info), arrays.to_cupy(v, v_info)
            qc, kc, vc = (_kernel_ready(x, shape.headdim) for x in (q_in, k_in, v_in))
            if scale < 0:
                # The kernel's running max is over raw scores, valid for a positive scale only:
                # softmax(c * q k^T) == softmax(|c| * (-q) k^T).
                qc, scale = -qc, -scale
            out_shape = (shape.batch, shape.seqlen_q, shape.nheads, padded)
            lse_shape = (shape.batch, shape.nheads, shape.seqlen_q)
            out_native, out = arrays.new_empty(out_shape, shape.dtype, framework, device)
            lse_native, lse = arrays.new_empty(lse_shape, "float32", framework, device)
            if forward._debug_poison:
                out.fill(float("nan"))
                lse.fill(float("nan"))
            slopes, slopes_stride, slopes_in_place = _alibi_ready(alibi_slopes, alibi_info)
            plan = forward.plan_forward(
                qc.shape, kc.shape, tuple(_elem_strides(x) for x in (qc, kc, vc, out)), shape.dtype, scale,
                bool(causal), _arch(device), window_size=window_size, softcap=float(softcap),
                alibi_batch_stride=slopes_stride, dropout_p=float(dropout_p),
            )
            state = _contiguous(dropout_rng_state, state_info) if dropout_p else None
            forward.run_forward(plan, qc.data.ptr, kc.data.ptr, vc.data.ptr, out.data.ptr, lse.data.ptr, stream.ptr,
                                alibi_slopes=slopes.data.ptr if slopes is not None else 0, dropout_seed=seed,
                                dropout_offset=offset, rng_state=state.data.ptr if state is not None else 0,
                                framework=framework, device=device)
            if qc is q_in and kc is k_in and vc is v_in and slopes_in_place:  # later calls may skip to launch
                _remember(cache_key, _CachedCall(plan, device, framework,
                                                 ((out_shape, shape.dtype), (lse_shape, "float32"))))
            result = arrays.make_result(out_native, out, framework)
            if padded != shape.headdim:
                result = result[..., : shape.headdim]
            if not return_attn_probs:
                return result
            probs = None
            if dropout_p and state is None:  # (with dropout_rng_state the seed is not known here: no probabilities)
                probs_view = _dropped_probs(qc, kc, lse, scale, causal, window_size, float(softcap), slopes,
                                            float(dropout_p), seed, offset, stream.ptr)
                probs = arrays.from_cupy(probs_view, framework)
            return result, arrays.make_result(lse_native, lse, framework), probs


def dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, dropout_seed, dropout_offset=0):
    """The dropout keep mask the kernels draw for these parameters: a CuPy bool array ``(batch, nheads, seqlen_q,
    seqlen_k)``, True where the score is kept (current device and stream). For tests and analysis at small sizes;
    the attention kernels never materialise it."""
    for name, value in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if seqlen_q > checks.MAX_GRID_YZ or batch * nheads > checks.MAX_GRID_YZ:
        raise ValueError(f"dropout_mask covers seqlen_q and batch * nheads up to {checks.MAX_GRID_YZ} each")
    p = checks._real(dropout_p, "dropout_p")
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout_p must be in (0, 1), got {dropout_p!r}")
    seed, offset = checks.check_dropout_rng(p, dropout_seed, dropout_offset)
    mask = cupy.empty((batch, nheads, seqlen_q, seqlen_k), dtype=cupy.uint8)
    forward.dropout_mask(batch, nheads, seqlen_q, seqlen_k, p, seed, offset, cupy.cuda.get_current_stream().ptr,
                         mask.data.ptr)
    return mask.view(cupy.bool_)


def _dropped_probs(q, k, lse, scale, causal, window_size, softcap, slopes, dropout_p, seed, offset, stream_ptr):
    """float32 ``P o Z / (1 - p)`` recomputed from the kernel's lse (return_attn_probs with dropout): q, k the
    kernel-ready CuPy arrays, lse (batch, nheads, seqlen_q). Small sizes only: it materialises every score."""
    from .reference import _visible

    batch, sq, nheads, _ = q.shape
    sk, nheads_kv = k.shape[1], k.shape[2]
    kr = cupy.repeat(k.astype(cupy.float32), nheads // nheads_kv, axis=2)
    s = cupy.einsum("bqhd,bkhd->bhqk", q.astype(cupy.float32), kr) * scale
    if softcap > 0:
        s = softcap * cupy.tanh(s / softcap)
    if slopes is not None:
        dist = cupy.abs(cupy.arange(sq)[:, None] + sk - sq - cupy.arange(sk)[None, :]).astype(cupy.float32)
        s = s - cupy.broadcast_to(slopes.reshape(-1, nheads), (batch, nheads))[:, :, None, None] * dist
    visible = _visible(sq, sk, causal, window_size)
    p = cupy.exp(s - lse[..., None])
    if visible is not None:
        p = cupy.where(cupy.asarray(visible), p, 0.0)
    keep = dropout_mask(batch, nheads, sq, sk, dropout_p, seed, offset)
    return cupy.where(keep, p / (1.0 - forward.realised_dropout_p(dropout_p)), 0.0).astype(cupy.float32)


def flash_attn_backward(
    dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
    softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None,
):
    """Gradients of ``flash_attn_func`` (FlashAttention-2 Algorithm 2) w.r.t. q, k and v.

    Args:
        dout: ``(batch, seqlen_q, nheads, headdim)``, the gradient of the loss w.r.t. ``out``.
        q, k, v: the forward's inputs (shapes, dtypes and layouts as in :func:`flash_attn_func`).
        out, softmax_lse: the forward's output and float32 ``(batch, nheads, seqlen_q)`` log-sum-exp, as returned
            by ``flash_attn_func(q, k, v, ..., return_attn_probs=True)`` with the same ``softmax_scale`` and
            ``causal``. Only these O(N) statistics are kept between forward and backward.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as given to the forward (with a softcap the
            gradient goes through the tanh exactly; the ALiBi bias has none).
        dropout_p, dropout_seed, dropout_offset, dropout_rng_state: as given to the forward: the kernels regenerate
            its keep mask.
        deterministic: False accumulates dQ across key tiles with fp32 atomics (fastest; the summation order,
            hence the last bits, can change between runs). True computes dQ in a separate kernel that walks the
            key tiles in a fixed order: bit-identical results run to run, at the cost of recomputing Q K^T and
            dO V^T once more (two extra matmuls of the five).

    Returns:
        ``(dq, dk, dv)`` in the inputs' framework and dtype; dq shaped like q, dk/dv like k/v (for MQA/GQA the
        gradient of each K/V head sums over the query heads that share it).

    Raises:
        TypeError / ValueError naming the offending argument.
    """
    key = None
    if not backward._debug_poison and dropout_rng_state is None:
        inputs = (dout, q, k, v, out, softmax_lse, alibi_slopes)
        key, cached, ptrs = _cached_lookup(
            "bwd", inputs, (softmax_scale, causal, window_size, deterministic, softcap, dropout_p)
        )
        if cached is not None:
            return _cached_backward(cached, ("dout", "q", "k", "v", "out", "lse", "alibi_slopes"), ptrs, dropout_p,
                                    dropout_seed, dropout_offset)
    return _flash_attn_backward_checked(
        dout, q, k, v, out, softmax_lse, softmax_scale, causal, window_size, deterministic, softcap, alibi_slopes, key,
        dropout_p, dropout_seed, dropout_offset, dropout_rng_state,
    )


def _accumulator(plan, framework, device, made, views) -> tuple:
    """The plan's fp32 dQ accumulator (atomics only; its rows as the plan's kernel pads them), appended to ``made``
    and ``views``; its allocation entry, for the call's cache, or nothing."""
    if plan.dq_accum_shape is None:
        return ()
    made.append(arrays.new_empty(plan.dq_accum_shape, "float32", framework, device))
    views.append(made[-1][1])
    return ((plan.dq_accum_shape, "float32"),)


def _cached_backward(cached, names, ptrs, dropout_p, dropout_seed, dropout_offset):
    """The backward's fast path (flash_attn_backward, flash_attn_varlen_backward): the input pointers ``ptrs``
    under their run_backward ``names``, fresh gradients and workspaces, the cached plan launched. (dq, dk, dv)."""
    seed, offset = checks.check_dropout_rng(dropout_p, dropout_seed, dropout_offset)
    stream_ptr = arrays.caller_stream_ptr(cached.framework, cached.device)
    allocated = cached.allocate()
    pointers = dict(zip(names, ptrs), dropout_seed=seed, dropout_offset=offset)
    pointers.update(zip(("dq", "dk", "dv", "dsum", "dq_accum"), (p for _, p in allocated)))
    backward.run_backward(cached.plan, pointers, stream_ptr)
    return allocated[0][0], allocated[1][0], allocated[2][0]


def _flash_attn_backward_checked(
    dout, q, k, v, out, softmax_lse, softmax_scale, causal, window_size, deterministic, softcap, alibi_slopes,
    cache_key, dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None,
):
    names = ("dout", "q", "k", "v", "out", "softmax_lse")
    infos = [arrays.describe(x, name) for x, name in zip((dout, q, k, v, out, softmax_lse), names)]
    alibi_info = _describe_optional(alibi_slopes, "alibi_slopes")
    shape = checks.check_backward_args(
        *infos, softmax_scale=softmax_scale, causal=causal, window_size=window_size, deterministic=deterministic,
        softcap=softcap, alibi_slopes=alibi_info, dropout_p=dropout_p,
    )
    state_info = _describe_optional(dropout_rng_state, "dropout_rng_state")
    seed, offset = checks.check_dropout_rng(dropout_p, dropout_seed, dropout_offset, state_info)
    scale = checks.default_scale(shape.headdim) if softmax_scale is None else float(softmax_scale)
    framework = infos[1].framework
    device = _device_of(infos[1])
    padded = -(-shape.headdim // 8) * 8
    deterministic = bool(deterministic)

    with cupy.cuda.Device(device):
        stream = arrays.caller_stream(framework, device)
        with stream:
            given = [arrays.to_cupy(x, info) for x, info in zip((dout, q, k, v, out, softmax_lse), infos)]
            ready = [_kernel_ready(x, shape.headdim) for x in given[:5]]
            lse = given[5] if given[5].flags.c_contiguous else cupy.ascontiguousarray(given[5])
            allocations = (
                ((shape.batch, shape.seqlen_q, shape.nheads, padded), shape.dtype),  # dq
                ((shape.batch, shape.seqlen_k, shape.nheads_kv, padded), shape.dtype),  # dk
                ((shape.batch, shape.seqlen_k, shape.nheads_kv, padded), shape.dtype),  # dv
                ((shape.batch, shape.nheads, shape.seqlen_q), "float32"),  # dsum = rowsum(dO * O)
            )  # (and the plan's fp32 dQ accumulator, atomics only)
            made = [arrays.new_empty(s, dt, framework, device) for s, dt in allocations]
            views = [view for _, view in made]
            if backward._debug_poison:
                for view in views[:3]:
                    view.fill(float("nan"))
            dout_c, q_c, k_c, v_c, out_c = ready
            strides = {n: _elem_strides(x) for n, x in zip(("dout", "q", "k", "v", "out"), ready)}
            strides.update({n: _elem_strides(x) for n, x in zip(("dq", "dk", "dv"), views)})
            slopes, slopes_stride, slopes_in_place = _alibi_ready(alibi_slopes, alibi_info)
            plan = backward.plan_backward(
                q_c.shape, k_c.shape, strides, shape.dtype, scale, bool(causal), deterministic, _arch(device),
                window_size=window_size, softcap=float(softcap), alibi_batch_stride=slopes_stride,
                dropout_p=float(dropout_p),
            )
            allocations += _accumulator(plan, framework, device, made, views)
            pointers = {n: x.data.ptr for n, x in zip(("dout", "q", "k", "v", "out"), ready)}
            pointers.update(lse=lse.data.ptr, dropout_seed=seed, dropout_offset=offset)
            state = _contiguous(dropout_rng_state, state_info) if dropout_p else None
            if state is not None:
                pointers["rng_state"] = state.data.ptr
            if slopes is not None:
                pointers["alibi_slopes"] = slopes.data.ptr
            pointers.update({n: x.data.ptr for n, x in zip(("dq", "dk", "dv", "dsum", "dq_accum"), views)})
            backward.run_backward(plan, pointers, stream.ptr)
            if all(r is g for r, g in zip(ready, given[:5])) and lse is given[5] and slopes_in_place:
                _remember(cache_key, _CachedCall(plan, device, framework, allocations))
            results = [arrays.make_result(native, view, framework) for native, view in made[:3]]
            if padded != shape.headdim:
                results = [r[..., : shape.headdim] for r in results]
            return tuple(results)


def _varlen_view(x, info, headdim: int):
    """(total, heads, d) CuPy array -> kernel-ready (1, total, heads, d') view (see _kernel_ready)."""
    return _kernel_ready(arrays.to_cupy(x, info)[None], headdim)


def _varlen_strides(x) -> tuple:
    """Element strides of a (1, total, heads, d) view for the kernels: batch stride 0 (cu_seqlens give the rows)."""
    return (0,) + _elem_strides(x)[1:]


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    dropout_seed=None,
    dropout_offset=0,
    dropout_rng_state=None,
):
    """Attention over packed sequences of different lengths, no padding work (flash-attn 2.x).

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_kv, headdim)``: the sequences' tokens one after
            another (dtypes, head grouping and layout rules as in :func:`flash_attn_func`).
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` on the GPU: sequence ``b`` is rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (and of k/v with cu_seqlens_k). Lengths may be 0.
        max_seqlen_q, max_seqlen_k: ints, the longest sequence (the grid is sized for it).
        softmax_scale, causal, window_size, softcap, alibi_slopes (``(nheads,)`` or ``(batch, nheads)``),
            dropout_p, dropout_seed, dropout_offset, dropout_rng_state, deterministic: as for
            :func:`flash_attn_func`; masks are
            aligned per sequence, and the dropout mask of sequence b is that of batch entry b of a padded call.
        return_attn_probs: also return the log-sum-exp (the third element is None: no probabilities for varlen).
        block_table: int32 ``(batch, max_pages)`` on the GPU for paged K/V: k and v are then page pools
            ``(num_pages, page_size, nheads_kv, headdim)`` (any page size), and key ``j`` of sequence ``b`` is row
            ``j % page_size`` of page ``block_table[b, j // page_size]``; cu_seqlens_k counts each sequence's keys
            (``max_seqlen_k <= max_pages * page_size``). The forward kernel reads the pages in place. A page index
            outside ``[0, num_pages)`` is found on the GPU (ValueError at the next call, as for cu_seqlens).

    Returns:
        ``out`` ``(total_q, nheads, headdim)``; with ``return_attn_probs`` ``(out, softmax_lse, None)``, lse float32
        ``(nheads, total_q)``. Rows past ``cu_seqlens_q[-1]`` are not written (as in flash-attn).

    Raises:
        TypeError / ValueError naming the argument. cu_seqlens values live on the GPU and are checked there: a
        sequence whose bounds do not fit the arrays or exceed max_seqlen is not computed, and a ValueError naming it
        is raised at the next call or at ``fa2cupy.check_device_errors()``.
    """
    device_errors.raise_pending()
    key = None
    if not forward._debug_poison and dropout_rng_state is None:
        inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_table)
        options = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                   return_attn_probs)
        key, cached, ptrs = _cached_lookup("varlen_fwd", inputs, options)
        if cached is not None:
            seed, offset = checks.check_dropout_rng(dropout_p, dropout_seed, dropout_offset)
            stream_ptr = arrays.caller_stream_ptr(cached.framework, cached.device)
            (out, out_ptr), (lse, lse_ptr) = cached.allocate()
            forward.run_forward(cached.plan, ptrs[0], ptrs[1], ptrs[2], out_ptr, lse_ptr, stream_ptr, ptrs[3], ptrs[4],
                                ptrs[5], seed, offset, 0, ptrs[6], cached.framework, cached.device)
            return (out, lse, None) if return_attn_probs else out
    return _flash_attn_varlen_checked(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, dropout_seed,
        dropout_offset, dropout_rng_state, key)


def _flash_attn_varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_attn_probs, block_table, dropout_seed, dropout_offset, dropout_rng_state,
                               cache_key):
    """flash_attn_varlen_func's full path (as _flash_attn_checked is flash_attn_func's)."""
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
    infos = [arrays.describe(x, n) for x, n in zip((q, k, v, cu_seqlens_q, cu_seqlens_k), names)]
    alibi_info = _describe_optional(alibi_slopes, "alibi_slopes")
    table_info = _describe_optional(block_table, "block_table")
    shape, total_q, total_k = checks.check_varlen_args(
        *infos, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_info, deterministic=deterministic,
        return_attn_probs=return_attn_probs, block_table=table_info)
    state_info = _describe_optional(dropout_rng_state, "dropout_rng_state")
    seed, offset = checks.check_dropout_rng(dropout_p, dropout_seed, dropout_offset, state_info)
    scale = checks.default_scale(shape.headdim) if softmax_scale is None else float(softmax_scale)
    framework = infos[0].framework
    device = _device_of(infos[0])
    padded = -(-shape.headdim // 8) * 8
    with cupy.cuda.Device(device):
        stream = arrays.caller_stream(framework, device)
        with stream:
            qc = _varlen_view(q, infos[0], shape.headdim)
            if table_info is None:
                kc, vc = (_varlen_view(x, info, shape.headdim) for x, info in zip((k, v), infos[1:3]))
                kv_strides, paged = tuple(_varlen_strides(x) for x in (kc, vc)), None
            else:  # page pools: their page strides go where the batch strides go
                kc, vc = (_kernel_ready(arrays.to_cupy(x, info), shape.headdim) for x, info in zip((k, v), infos[1:3]))
                kv_strides = (_elem_strides(kc), _elem_strides(vc))
                table = _contiguous(block_table, table_info)
                paged = (kc.shape[0], kc.shape[1], table.shape[1])
            cu_q, cu_k = (_contiguous(x, info) for x, info in zip((cu_seqlens_q, cu_seqlens_k), infos[3:]))
            if scale < 0:  # as in flash_attn_func: the running max needs a positive scale
                qc, scale = -qc, -scale
            out_native, out = arrays.new_empty((total_q, shape.nheads, padded), shape.dtype, framework, device)
            lse_native, lse = arrays.new_empty((shape.nheads, total_q), "float32", framework, device)
            if forward._debug_poison:
                out.fill(float("nan"))
                lse.fill(float("nan"))
            slopes, slopes_stride, slopes_in_place = _alibi_ready(alibi_slopes, alibi_info)
            plan = forward.plan_forward(
                (shape.batch, shape.seqlen_q, shape.nheads, padded), (shape.batch, shape.seqlen_k, shape.nheads_kv,
                                                                      padded),
                (_varlen_strides(qc),) + kv_strides + (_varlen_strides(out[None]),), shape.dtype, scale,
                bool(causal), _arch(device), window_size=window_size, softcap=float(softcap),
                alibi_batch_stride=slopes_stride, varlen_totals=(total_q, total_k), dropout_p=float(dropout_p),
                paged=paged,
            )
            state = _contiguous(dropout_rng_state, state_info) if dropout_p else None
            forward.run_forward(plan, qc.data.ptr, kc.data.ptr, vc.data.ptr, out.data.ptr, lse.data.ptr, stream.ptr,
                                cu_q.data.ptr, cu_k.data.ptr, slopes.data.ptr if slopes is not None else 0, seed,
                                offset, state.data.ptr if state is not None else 0,
                                table.data.ptr if paged is not None else 0, framework, device)
            used = (qc, kc, vc, cu_q, cu_k) + ((table,) if paged is not None else ())
            given = (q, k, v, cu_seqlens_q, cu_seqlens_k) + ((block_table,) if paged is not None else ())
            if cache_key is not None and padded == shape.headdim and slopes_in_place and _used_in_place(used, given):
                _remember(cache_key, _CachedCall(plan, device, framework, (
                    ((total_q, shape.nheads, padded), shape.dtype), ((shape.nheads, total_q), "float32"))))
            result = arrays.make_result(out_native, out, framework)
            if padded != shape.headdim:
                result = result[..., : shape.headdim]
            if not return_attn_probs:
                return result
            return result, arrays.make_result(lse_native, lse, framework), None


def flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
    causal=False, window_size=(-1, -1), deterministic=False, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
    dropout_seed=None, dropout_offset=0, dropout_rng_state=None, block_table=None,
):
    """Gradients of :func:`flash_attn_varlen_func` w.r.t. q, k and v.

    Args:
        dout, out: ``(total_q, nheads, headdim)``; softmax_lse: float32 ``(nheads, total_q)`` as the forward
            returned it; the other arguments as given to the forward. ``deterministic`` as in
            :func:`flash_attn_backward`.
        block_table: as given to the forward (paged K/V). The pages the sequences use are gathered into packed
            K/V first (on the GPU, no host synchronisation), and dk/dv are summed back onto the pages.

    Returns:
        ``(dq, dk, dv)`` shaped like q, k, v. Rows outside every sequence (past ``cu_seqlens[-1]``) are zero, so
        autograd wrappers can hand the gradients on as they are; with block_table, dk/dv are zero on every page row
        no sequence reads, and a page shared by several sequences gets the sum of their gradients.
    """
    device_errors.raise_pending()
    if block_table is not None:
        return _paged_varlen_backward(
            dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
            dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, deterministic=deterministic,
                 softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                 dropout_offset=dropout_offset, dropout_rng_state=dropout_rng_state))
    key = None
    given_arrays = (dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k)
    if not backward._debug_poison and dropout_rng_state is None:
        inputs = given_arrays + (alibi_slopes,)
        options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, deterministic, softcap, dropout_p)
        key, cached, ptrs = _cached_lookup("varlen_bwd", inputs, options)
        if cached is not None:
            return _cached_backward(cached, ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                                             "alibi_slopes"), ptrs, dropout_p, dropout_seed, dropout_offset)
    names = ("dout", "q", "k", "v", "out", "softmax_lse", "cu_seqlens_q", "cu_seqlens_k")
    infos = dict((n, arrays.describe(x, n)) for x, n in zip(given_arrays, names))
    alibi_info = _describe_optional(alibi_slopes, "alibi_slopes")
    shape, total_q, total_k = checks.check_varlen_args(
        infos["q"], infos["k"], infos["v"], infos["cu_seqlens_q"], infos["cu_seqlens_k"], max_seqlen_q, max_seqlen_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_info, deterministic=deterministic, dropout_p=dropout_p)
    state_info = _describe_optional(dropout_rng_state, "dropout_rng_state")
    seed, offset = checks.check_dropout_rng(dropout_p, dropout_seed, dropout_offset, state_info)
    checks.check_varlen_backward_args(infos["dout"], infos["out"], infos["softmax_lse"], infos["q"], shape.nheads)
    scale = checks.default_scale(shape.headdim) if softmax_scale is None else float(softmax_scale)
    framework = infos["q"].framework
    device = _device_of(infos["q"])
    padded = -(-shape.headdim // 8) * 8
    deterministic = bool(deterministic)
    with cupy.cuda.Device(device):
        stream = arrays.caller_stream(framework, device)
        with stream:
            ready = {n: _varlen_view(x, infos[n], shape.headdim) for x, n in zip(given_arrays[:5], names[:5])}
            lse = _contiguous(softmax_lse, infos["softmax_lse"])
            cu_q, cu_k = (_contiguous(x, infos[n]) for x, n in zip(given_arrays[6:], names[6:]))
            allocations = (
                ((total_q, shape.nheads, padded), shape.dtype),  # dq
                ((total_k, shape.nheads_kv, padded), shape.dtype),  # dk
                ((total_k, shape.nheads_kv, padded), shape.dtype),  # dv
                ((shape.nheads, total_q), "float32"),  # dsum
            )  # (and the plan's fp32 dQ accumulator, atomics only)
            made = [arrays.new_empty(s, dt, framework, device) for s, dt in allocations]
            views = [view for _, view in made]
            if backward._debug_poison:
                for view in views[:3]:
                    view.fill(float("nan"))
            strides = {n: _varlen_strides(x) for n, x in ready.items()}
            strides.update({n: _varlen_strides(x[None]) for n, x in zip(("dq", "dk", "dv"), views)})
            slopes, slopes_stride, slopes_in_place = _alibi_ready(alibi_slopes, alibi_info)
            plan = backward.plan_backward(
                (shape.batch, shape.seqlen_q, shape.nheads, padded),
                (shape.batch, shape.seqlen_k, shape.nheads_kv, padded), strides, shape.dtype, scale, bool(causal),
                deterministic, _arch(device), window_size=window_size, softcap=float(softcap),
                alibi_batch_stride=slopes_stride, varlen_totals=(total_q, total_k), dropout_p=float(dropout_p),
            )
            allocations += _accumulator(plan, framework, device, made, views)
            pointers = {n: x.data.ptr for n, x in ready.items()}
            pointers.update(lse=lse.data.ptr, cu_seqlens_q=cu_q.data.ptr, cu_seqlens_k=cu_k.data.ptr,
                            dropout_seed=seed, dropout_offset=offset)
            state = _contiguous(dropout_rng_state, state_info) if dropout_p else None
            if state is not None:
                pointers["rng_state"] = state.data.ptr
            if slopes is not None:
                pointers["alibi_slopes"] = slopes.data.ptr
            pointers.update({n: x.data.ptr for n, x in zip(("dq", "dk", "dv", "dsum", "dq_accum"), views)})
            backward.run_backward(plan, pointers, stream.ptr)  # (it zeroes the rows past the last sequence too)
            used = tuple(ready[n] for n in names[:5]) + (lse, cu_q, cu_k)
            if key is not None and padded == shape.headdim and slopes_in_place and _used_in_place(used, given_arrays):
                _remember(key, _CachedCall(plan, device, framework, allocations))
            results = [arrays.make_result(native, view, framework) for native, view in made[:3]]
            if padded != shape.headdim:
                results = [r[..., : shape.headdim] for r in results]
            return tuple(results)


def _paged_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           block_table, options):
    """flash_attn_varlen_backward for paged K/V: gathers each sequence's keys from its pages into packed K/V of
    batch * max_seqlen_k rows (an upper bound on the keys, so no host synchronisation is needed to size them), runs
    the packed backward, and sums dk/dv back onto the pages (in float32: pages may be shared)."""
    given = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, cu_seqlens_q=cu_seqlens_q,
                 cu_seqlens_k=cu_seqlens_k, block_table=block_table)
    infos = {n: arrays.describe(x, n) for n, x in given.items()}
    optional = {n: options[n] for n in ("alibi_slopes", "dropout_rng_state") if options[n] is not None}
    infos.update({n: arrays.describe(x, n) for n, x in optional.items()})
    checks.check_varlen_args(
        *(infos[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")), max_seqlen_q, max_seqlen_k,
        block_table=infos["block_table"], alibi_slopes=infos.get("alibi_slopes"),
        **{n: options[n] for n in ("softmax_scale", "causal", "window_size", "softcap", "deterministic", "dropout_p")})
    framework = infos["q"].framework
    device = _device_of(infos["q"])
    with cupy.cuda.Device(device):
        stream = arrays.caller_stream(framework, device)
        with stream:
            c = {n: arrays.to_cupy(x, infos[n]) for n, x in {**given, **optional}.items()}
            k_pages, v_pages, table = c["k"], c["v"], c["block_table"]
            rows = max(1, table.shape[0] * int(max_seqlen_k))
            packed_cu_k, page, slot, inside = paging.key_pages(cupy, c["cu_seqlens_k"], table, rows,
                                                               k_pages.shape[1], k_pages.shape[0])
            k_packed, v_packed = (paging.gather(cupy, x, page, slot, inside) for x in (k_pages, v_pages))
            options = {**options, **{n: c[n] for n in optional}}
            dq, dk, dv = flash_attn_varlen_backward(c["dout"], c["q"], k_packed, v_packed, c["out"], c["softmax_lse"],
                                                    c["cu_seqlens_q"], packed_cu_k, max_seqlen_q, max_seqlen_k,
                                                    **options)
            grads = [dq] + [paging.sum_onto_pages(cupy, g, x.shape, page, slot, inside)
                            for g, x in ((dk, k_pages), (dv, v_pages))]
            return tuple(arrays.make_result(None, g, framework) for g in grads)


flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func = packed.make_varlen_packed(flash_attn_varlen_func)


def merge_attention_states(outs, lses):
    """Merges attention results computed over disjoint sets of keys into attention over their union.

    If ``out_i, lse_i = flash_attn_func(q, k_i, v_i, return_attn_probs=True)[:2]`` for key/value sets that
    partition ``k, v`` (e.g. a shared prefix and per-request suffixes in cascade attention, or the shards of
    context parallelism), the result equals ``flash_attn_func(q, k, v, return_attn_probs=True)[:2]`` up to rounding:
    ``lse = log(sum_i exp(lse_i))`` and ``out = sum_i exp(lse_i - lse) * out_i``.

    Args:
        outs: sequence of n >= 1 arrays ``(batch, seqlen_q, nheads, headdim)``, float16 or bfloat16, all alike.
        lses: sequence of n float32 arrays ``(batch, nheads, seqlen_q)``. A part whose lse is +inf (flash-attn's
            mark of a row that saw no key) or -inf has weight 0; a row no part saw gives 0 and lse +inf.

    Returns:
        ``(out, lse)`` in the inputs' framework: out shaped and typed like ``outs[0]``, lse float32
        ``(batch, nheads, seqlen_q)``.
    """
    outs, lses = list(outs), list(lses)
    out_infos = [arrays.describe(x, f"outs[{i}]") for i, x in enumerate(outs)]
    lse_infos = [arrays.describe(x, f"lses[{i}]") for i, x in enumerate(lses)]
    n, batch, seqlen_q, nheads, headdim, dtype = checks.check_merge_args(out_infos, lse_infos)
    framework = out_infos[0].framework
    device = _device_of(out_infos[0])
    padded = -(-headdim // 8) * 8
    with cupy.cuda.Device(device):
        stream = arrays.caller_stream(framework, device)
        with stream:
            # Stacked copies in one row order ((batch, seqlen_q, nheads) for both): the kernel reads each part once.
            parts = cupy.zeros((n, batch, seqlen_q, nheads, padded), dtype=arrays.to_cupy(outs[0], out_infos[0]).dtype)
            for i, (x, info) in enumerate(zip(outs, out_infos)):
                parts[i, ..., :headdim] = arrays.to_cupy(x, info)
            stats = cupy.stack([arrays.to_cupy(x, info).transpose(0, 2, 1) for x, info in zip(lses, lse_infos)])
            stats = cupy.ascontiguousarray(stats)
            out = cupy.empty((batch, seqlen_q, nheads, padded), dtype=parts.dtype)
            lse = cupy.empty((batch, seqlen_q, nheads), dtype=cupy.float32)
            decode.launch_merge(parts.reshape(n, -1, padded), stats.reshape(n, -1), out.reshape(-1, padded),
                                lse.reshape(-1), stream)
            out = out[..., :headdim] if padded != headdim else out
            lse = cupy.ascontiguousarray(lse.transpose(0, 2, 1))
            return arrays.from_cupy(out, framework), arrays.from_cupy(lse, framework)


def _cache_usable_in_place(x, name: str) -> None:
    item = x.itemsize
    if x.data.ptr % 16 or any(s % (8 * item) for s in x.strides[:3]) or x.strides[3] != item:
        raise ValueError(
            f"{name} must have a contiguous last axis, 16-byte aligned rows and strides that are multiples of 8 "
            f"elements (it is updated and read in place, never copied); got strides {x.strides} bytes"
        )
    if abs(x.strides[1]) // item >= forward.MAX_ROW_STRIDE:
        raise ValueError(f"{name} has a row stride of {x.strides[1] // item} elements; at most "
                         f"{forward.MAX_ROW_STRIDE - 1} are supported")


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of a few new query tokens over a KV cache, appending new keys/values in place (flash-attn 2.x).

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)`` fp16/bf16, seqlen_q small (1 for decoding, a few for
            speculative decoding). headdim a multiple of 8, at most 256.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_kv, headdim)``, or with ``block_table`` paged
            ``(num_pages, page_size, nheads_kv, headdim)`` with page_size a multiple of 16. Read and written in
            place (never copied).
        k, v: optional ``(batch, seqlen_new, nheads_kv, headdim)``, written into the cache at slots
            ``cache_seqlens[b] ...`` before attending.
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)`` in q's dtype, ``rotary_dim <= headdim``
            and ``seqlen_ro`` at least the cache capacity (flash-attn's rule). The new keys are rotated at their
            slots ``cache_seqlens[b] + t`` before they are written; q is rotated (into a temporary: the caller's q
            and k are never modified) at ``cache_seqlens[b] + t`` with ``causal`` or a local window, else every
            query at ``cache_seqlens[b]``. With ``cache_leftpad`` the positions are still these slots, pad
            included (flash-attn's convention). flash-attn requires k, v with rotary; here q alone is rotated
            when they are absent.
        rotary_interleaved: True rotates column pairs (0, 1), (2, 3), ... (GPT-J); False pairs column i with
            i + rotary_dim / 2 (GPT-NeoX).
        cache_seqlens: int or int32 ``(batch,)``: the cache slots in use per batch row before the append (None:
            the whole cache, non-paged only). With ``cache_leftpad`` it counts the pad too.
        cache_batch_idx: int32 ``(batch,)``: the cache row of each batch row (non-paged only).
        cache_leftpad: int32 ``(batch,)``: row b's valid keys start at slot ``cache_leftpad[b]`` (``0 <=
            cache_leftpad[b] <= cache_seqlens[b]``); the slots before it are ignored, and the masks, ALiBi and
            ``seqlen_k_b = cache_seqlens[b] - cache_leftpad[b] + seqlen_new`` count from it. Not with block_table.
        block_table: int32 ``(batch, max_pages)``: page indices of each row's cache, in order.
        softmax_scale: multiplier of q.k; None means ``1 / sqrt(headdim)``.
        causal: bottom-right aligned within each row: new query i sees keys up to ``seqlen_k_b - seqlen_q + i``.
        window_size: ``(left, right)`` sliding window, bottom-right aligned per row: query i sees key j iff
            ``i + seqlen_k_b - seqlen_q - left <= j <= i + seqlen_k_b - seqlen_q + right``; -1 = no limit on that
            side; ``causal`` sets right to 0. Key tiles outside every row's window are not read.
        softcap: ``> 0`` caps the scaled scores at ``softcap * tanh(s / softcap)``.
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``: adds ``-slope * |i + seqlen_k_b - seqlen_q -
            j|`` to the (capped) scores, before the mask.
        num_splits: 0 picks the split-KV count from the GPU size and the problem; a positive count is honoured
            (up to 256; more is clamped, as flash-attn clamps at 128).
        return_softmax_lse: also return the float32 ``(batch, nheads, seqlen_q)`` log-sum-exp.

    Returns:
        ``out`` like q, or ``(out, softmax_lse)``; a row with no key gives 0 (lse +inf).

    Raises:
        TypeError / ValueError naming the argument for bad shapes, dtypes and host-side values (an int
        cache_seqlens, window_size, softcap, rotary_cos shorter than the cache). Values inside device arrays
        (cache_seqlens, cache_batch_idx, block_table, cache_leftpad, and the rotary positions they imply) are
        checked by the kernels, without a synchronisation: a bad one leaves the caches untouched, makes the
        affected rows NaN, and raises ValueError at the next call or at ``fa2cupy.check_device_errors()``.
    """
    device_errors.raise_pending()
    key = None
    if not forward._debug_poison:
        # Arrays in decode.INPUTS order (None where absent), so the pointers come back ready for the launch.
        seqlens_array = None if cache_seqlens is None or isinstance(cache_seqlens, int) else cache_seqlens
        options = (type(cache_seqlens), softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                   return_softmax_lse)
        key, cached, inputs = _cached_lookup(
            "kvcache", (q, k_cache, v_cache, k, v, seqlens_array, cache_batch_idx, block_table, rotary_cos,
                        rotary_sin, cache_leftpad, alibi_slopes), options)
        if cached is not None:
            # A repeat of a validated call: launch with the cached plan (only an int cache_seqlens is checked).
            plan = cached.plan
            fixed = _fixed_seqlen(cache_seqlens, plan.capacity, plan.seqlen_new, plan.rotary_span, plan.seqlen_ro)
            device, framework = cached.device, cached.framework
            stream_ptr = arrays.caller_stream_ptr(framework, device)
            out, out_ptr = arrays.new_empty_raw(*cached.allocations[0], framework, device)
            lse = lse_ptr = q_rotated = 0
            if return_softmax_lse:
                lse, lse_ptr = arrays.new_empty_raw(*cached.allocations[1], framework, device)
            if plan.rotary is not None:
                q_buffer, q_rotated = arrays.new_empty_raw(*cached.allocations[-1], framework, device)
            decode.run_decode(plan, inputs, out_ptr, lse_ptr, fixed, stream_ptr,
                              plan.workspace(stream_ptr, framework, device), device_errors.pointers(device),
                              q_rotated)
            return (out, lse) if return_softmax_lse else out
    return _flash_attn_with_kvcache_checked(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
        return_softmax_lse, key)


def _fixed_seqlen(cache_seqlens, capacity: int, seqlen_new: int, rotary_span: int = 0, seqlen_ro: int = 0) -> int:
    """The kernels' fixed_seqlen argument: an int cache_seqlens (checked here, on the host, where it is), the
    whole cache for None, anything for an array (the kernels read and check the array). ``rotary_span``: with
    rotary, how many positions from cache_seqlens on are rotated (they must lie below ``seqlen_ro``)."""
    if cache_seqlens is None:
        fixed = capacity - seqlen_new
    elif isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache capacity); got "
                             f"cache_seqlens={cache_seqlens}, seqlen_new={seqlen_new}")
        fixed = cache_seqlens
    else:
        return 0
    if rotary_span and fixed + rotary_span > seqlen_ro:
        raise ValueError(f"rotary_cos/rotary_sin have {seqlen_ro} rows but position {fixed + rotary_span - 1} "
                         f"(cache_seqlens={fixed} plus the new tokens) is rotated; they need a row per position")
    return fixed


@dataclasses.dataclass(frozen=True)
class _KvcacheCall:
    """A flash_attn_with_kvcache call's validated metadata (see _check_kvcache_args)."""

    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    headdim: int
    dtype: str
    seqlen_new: int
    page_size: int  # 0: contiguous cache
    capacity: int
    max_pages: int
    fixed_seqlen: int
    scale: float
    causal: bool
    extras: decode.DecodeExtras


def _check_kvcache_args(infos: dict, cache_seqlens, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, rotary_interleaved=True, num_splits=0) -> _KvcacheCall:
    """Validates a flash_attn_with_kvcache call from its arrays' descriptions (``infos``: argument name ->
    ArrayInfo for each array given, cache_seqlens included when it is an array) and its scalar options; needs no
    GPU. Raises TypeError / ValueError naming the argument and what is allowed."""
    if ("k" in infos) != ("v" in infos):
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    if ("rotary_cos" in infos) != ("rotary_sin" in infos):
        raise ValueError("rotary_cos and rotary_sin must be given together or both be None")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = choose automatically), got {num_splits!r}")
    if causal is not True and causal is not False:
        checks._check_bool(causal, "causal")
    if rotary_interleaved is not True and rotary_interleaved is not False:
        checks._check_bool(rotary_interleaved, "rotary_interleaved")
    if type(window_size) is not tuple or window_size != (-1, -1):
        checks._check_window(window_size)
    cap = 0.0
    if not (type(softcap) is float and softcap == 0.0):
        cap = checks._real(softcap, "softcap")
        if not (math.isfinite(cap) and cap >= 0.0):
            raise ValueError(f"softcap must be a finite number >= 0 (0 = no softcap), got {softcap!r}")
    if softmax_scale is not None:
        scale = checks._real(softmax_scale, "softmax_scale")
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be None or a finite number, got {softmax_scale!r}")

    q_info, kc_info, vc_info = infos["q"], infos["k_cache"], infos["v_cache"]
    for info in (q_info, kc_info, vc_info):
        if len(info.shape) != 4:
            raise ValueError(f"{info.name} must be 4-D, got shape {info.shape}")
    batch, seqlen_q, nheads, headdim = q_info.shape
    paged = "block_table" in infos
    if kc_info.shape != vc_info.shape:
        raise ValueError(f"k_cache {kc_info.shape} and v_cache {vc_info.shape} must have the same shape")
    nheads_kv = kc_info.shape[2]
    if kc_info.shape[3] != headdim:
        raise ValueError(f"k_cache has headdim {kc_info.shape[3]} but q has {headdim}")
    if min(q_info.shape) < 1 or min(kc_info.shape) < 1:
        raise ValueError(f"q {q_info.shape} and k_cache {kc_info.shape} must have no zero-length axis")
    if headdim % 8 or headdim > 256:
        raise ValueError(f"q has headdim={headdim}; flash_attn_with_kvcache needs a multiple of 8 up to 256 "
                         f"(the caches are used in place, so they cannot be padded)")
    if nheads % nheads_kv:
        raise ValueError(f"q has nheads={nheads}, not a multiple of the caches' nheads_kv={nheads_kv}")
    for info in [q_info, kc_info, vc_info] + [infos[n] for n in ("k", "v") if n in infos]:
        if info.dtype not in checks.SUPPORTED_DTYPES or info.dtype != q_info.dtype:
            raise TypeError(f"{info.name} has dtype {info.dtype}; q, k_cache, v_cache, k and v must share one "
                            f"dtype, float16 or bfloat16")
    seqlen_new = 0
    if "k" in infos:
        for n in ("k", "v"):
            shape = infos[n].shape
            if len(shape) != 4 or shape[0] != batch or shape[2] != nheads_kv or shape[3] != headdim:
                raise ValueError(f"{n} must be (batch, seqlen_new, nheads_kv, headdim) = ({batch}, *, {nheads_kv}, "
                                 f"{headdim}), got {shape}")
        if infos["k"].shape != infos["v"].shape:
            raise ValueError(f"k {infos['k'].shape} and v {infos['v'].shape} must have the same shape")
        seqlen_new = infos["k"].shape[1]
    if paged:
        bt = infos["block_table"]
        if len(bt.shape) != 2 or bt.shape[0] != batch or bt.dtype != "int32":
            raise ValueError(f"block_table must be int32 (batch, max_pages) = ({batch}, *), got {bt.dtype} {bt.shape}")
        if "cache_batch_idx" in infos:
            raise ValueError("cache_batch_idx cannot be combined with block_table (each row's pages say where it is)")
        if "cache_leftpad" in infos:
            raise ValueError("cache_leftpad cannot be combined with block_table (as in flash-attn, left-padded "
                             "caches must be contiguous)")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required with block_table")
        page_size = kc_info.shape[1]
        if page_size % 16:
            raise ValueError(f"k_cache has page_size={page_size} (axis 1 of a paged cache); it must be a multiple "
                             f"of 16")
        max_pages = bt.shape[1]
        capacity = max_pages * page_size
    else:
        page_size = max_pages = 0
        capacity = kc_info.shape[1]
    for name in ("cache_batch_idx", "cache_leftpad"):
        if name in infos:
            ci = infos[name]
            if ci.shape != (batch,) or ci.dtype != "int32":
                raise ValueError(f"{name} must be int32 (batch,) = ({batch},), got {ci.dtype} {ci.shape}")
    if "cache_batch_idx" not in infos and not paged and kc_info.shape[0] < batch:
        raise ValueError(f"k_cache has {kc_info.shape[0]} rows but q has batch={batch}; pass cache_batch_idx")
    if "cache_seqlens" in infos:
        cs = infos["cache_seqlens"]
        if cs.shape != (batch,) or cs.dtype != "int32":
            raise ValueError(f"cache_seqlens must be an int or int32 (batch,) = ({batch},), got {cs.dtype} {cs.shape}")
    if isinstance(cache_seqlens, bool):
        raise TypeError("cache_seqlens must be an int or an int32 array, not a bool")

    # The mask, flash-attn's way: causal is the window's right side 0, and a side of at least the cache capacity
    # is no limit (so it also decides whether q's rotary positions advance, below).
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    left = -1 if left >= capacity else left
    right = -1 if right >= capacity else right
    unlimited = decode.UNLIMITED_WINDOW
    extras = dict(window_left=left if left >= 0 else unlimited, window_right=right if right >= 0 else unlimited,
                  softcap=cap)
    if "alibi_slopes" in infos:
        al = infos["alibi_slopes"]
        if al.dtype != "float32":
            raise TypeError(f"alibi_slopes must be float32, got {al.dtype}")
        if al.shape not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes must be ({nheads},) or ({batch}, {nheads}) = (nheads,) or (batch, nheads), "
                             f"got {al.shape}")
        extras["alibi"] = True
    extras["leftpad"] = "cache_leftpad" in infos
    rotary_span = 0
    if "rotary_cos" in infos:
        cos, sin = infos["rotary_cos"], infos["rotary_sin"]
        for info in (cos, sin):
            if info.dtype != q_info.dtype:
                raise TypeError(f"{info.name} has dtype {info.dtype}; it must be q's dtype, {q_info.dtype}")
            if len(info.shape) != 2 or info.shape[1] < 1:
                raise ValueError(f"{info.name} must be 2-D (seqlen_ro, rotary_dim / 2), got shape {info.shape}")
        if cos.shape != sin.shape:
            raise ValueError(f"rotary_cos {cos.shape} and rotary_sin {sin.shape} must have the same shape")
        seqlen_ro, rotary_dim = cos.shape[0], 2 * cos.shape[1]
        if rotary_dim > headdim:
            raise ValueError(f"rotary_cos has {cos.shape[1]} columns, so rotary_dim = {rotary_dim}; it must be at "
                             f"most headdim = {headdim} (rotary_cos: (seqlen_ro, rotary_dim / 2))")
        if seqlen_ro < capacity:
            raise ValueError(f"rotary_cos/rotary_sin have {seqlen_ro} rows; they need at least one per cache slot, "
                             f"{capacity} (the cache capacity), as in flash-attn")
        advance = left >= 0 or right >= 0
        extras.update(rotary_dim=rotary_dim, seqlen_ro=seqlen_ro, rotary_interleaved=bool(rotary_interleaved),
                      rotary_advance=advance)
        rotary_span = max(seqlen_new, seqlen_q if advance else 1)
    fixed = _fixed_seqlen(cache_seqlens, capacity, seqlen_new, rotary_span, extras.get("seqlen_ro", 0))
    scale = checks.default_scale(headdim) if softmax_scale is None else float(softmax_scale)
    return _KvcacheCall(batch, seqlen_q, nheads, nheads_kv, headdim, q_info.dtype, seqlen_new, page_size, capacity,
                        max_pages, fixed, scale, bool(causal), decode.DecodeExtras(**extras))


def _flash_attn_with_kvcache_checked(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
    softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
    cache_key,
):
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_batch_idx=cache_batch_idx,
                 block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_leftpad=cache_leftpad,
                 alibi_slopes=alibi_slopes)
    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        named["cache_seqlens"] = cache_seqlens
    if (k is None) != (v is None):  # before describing the arrays: a None among them is this error, not a type
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    infos = {name: arrays.describe(x, name) for name, x in named.items() if x is not None}
    framework = arrays.same_framework(list(infos.values()))
    call = _check_kvcache_args(infos, cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved,
                               num_splits=num_splits)
    batch, seqlen_q, nheads, headdim = call.batch, call.seqlen_q, call.nheads, call.headdim
    extras, scale = call.extras, call.scale
    q_info = infos["q"]
    device = _device_of(q_info)
    with cupy.cuda.Device(device):
        stream = arrays.caller_stream(framework, device)
        with stream:
            if framework == "numpy" or (framework == "jax" and call.seqlen_new):
                raise TypeError("flash_attn_with_kvcache appends to k_cache/v_cache in place: pass mutable device "
                                "arrays (CuPy or PyTorch); NumPy arrays are copies and JAX arrays are immutable")
            q_in = arrays.to_cupy(q, q_info)
            qc = _kernel_ready(q_in, headdim)
            if scale < 0:  # the kernel's running max needs a positive scale: softmax(c q k^T) = softmax(|c| (-q) k^T)
                qc, scale = -qc, -scale
            kc, vc = arrays.to_cupy(k_cache, infos["k_cache"]), arrays.to_cupy(v_cache, infos["v_cache"])
            _cache_usable_in_place(kc, "k_cache")
            _cache_usable_in_place(vc, "v_cache")
            given = {"q": qc, "k_cache": kc, "v_cache": vc}
            in_place = qc is q_in
            for name in ("k", "v", "cache_seqlens", "cache_batch_idx", "block_table", "rotary_cos", "rotary_sin",
                         "cache_leftpad"):
                if name not in infos:
                    continue
                x_in = arrays.to_cupy(named[name], infos[name])
                ready = _kernel_ready(x_in, headdim) if name in ("k", "v") else cupy.ascontiguousarray(x_in)
                in_place &= ready is x_in
                given[name] = ready
            if alibi_slopes is not None:
                slopes, batch_stride, as_is = _alibi_ready(alibi_slopes, infos["alibi_slopes"])
                in_place &= as_is
                given["alibi_slopes"] = slopes
                extras = dataclasses.replace(extras, alibi_batch_stride=batch_stride)
            strides = {n: x.strides for n, x in given.items() if x.ndim == 4}
            plan = decode.plan_decode(
                qc.shape, strides, call.dtype, nheads_kv=call.nheads_kv, cache_rows=kc.shape[0],
                capacity=call.capacity, page_size=call.page_size, max_pages=call.max_pages,
                seqlen_new=call.seqlen_new, max_seqlen_k=call.capacity, softmax_scale=scale, causal=call.causal,
                arch=_arch(device), device=device, num_splits=num_splits, item=qc.itemsize, extras=extras)
            allocations = [((batch, seqlen_q, nheads, headdim), call.dtype)]
            if return_softmax_lse:
                allocations.append(((batch, nheads, seqlen_q), "float32"))
            if plan.rotary is not None:  # the rotated q, read by the attention (last: not returned)
                allocations.append(((batch, seqlen_q, nheads, headdim), call.dtype))
            results = [arrays.new_empty(shape, dtype, framework, device) for shape, dtype in allocations]
            if forward._debug_poison:
                for _, view in results:
                    view.fill(float("nan"))
            inputs = [given[n].data.ptr if n in given else 0 for n in decode.INPUTS]
            lse_ptr = results[1][1].data.ptr if return_softmax_lse else 0
            q_rotated = results[-1][1].data.ptr if plan.rotary is not None else 0
            decode.run_decode(plan, inputs, results[0][1].data.ptr, lse_ptr, call.fixed_seqlen, stream.ptr,
                              plan.workspace(stream.ptr, framework, device), device_errors.pointers(device),
                              q_rotated)
            if in_place and framework in ("cupy", "torch"):
                _remember(cache_key, _CachedCall(plan, device, framework, tuple(allocations)))
            results = [arrays.make_result(native, view, framework) for native, view in results]
            results = tuple(results[:2 if return_softmax_lse else 1])
            return results if return_softmax_lse else results[0]
