"""Public entry points. Data flows one way: arrays in -> checks -> config -> launch -> arrays out, in the caller's
framework, on the caller's stream."""

from __future__ import annotations

import cupy

from . import arrays, checks, forward

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


class _CachedCall:
    """What a validated call left behind for identical later calls (same metadata, aligned pointers)."""

    __slots__ = ("plan", "device", "framework", "out_shape", "lse_shape", "dtype")

    def __init__(self, plan, device, framework, out_shape, lse_shape, dtype):
        self.plan, self.device, self.framework = plan, device, framework
        self.out_shape, self.lse_shape, self.dtype = out_shape, lse_shape, dtype


#: Validated plans by call metadata (see arrays.fast_meta): a repeated call skips checks, array adaptation and
#: planning, which are ~90% of the host time of a small problem.
_cached_calls: dict = {}
_MAX_CACHED_CALLS = 1024


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
        dropout_p, window_size, softcap, alibi_slopes: not implemented yet; anything but the defaults raises
            NotImplementedError naming the feature.
        deterministic: accepted for compatibility; the forward is always deterministic.
        return_attn_probs: also return the log-sum-exp (see Returns).

    Returns:
        ``out`` shaped and typed like q, in q's framework; with ``return_attn_probs=True`` the tuple
        ``(out, softmax_lse, None)`` with ``softmax_lse`` float32 ``(batch, nheads, seqlen_q)``, natural log.

    Raises:
        TypeError / ValueError naming the offending argument for bad shapes, dtypes, devices or layouts.
    """
    key = None
    if not forward._debug_poison:
        q_meta, k_meta, v_meta = arrays.fast_meta(q), arrays.fast_meta(k), arrays.fast_meta(v)
        if q_meta is not None and k_meta is not None and v_meta is not None:
            options = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                       return_attn_probs)
            try:
                key = (q_meta[0], k_meta[0], v_meta[0], options)
                cached = _cached_calls.get(key)
            except TypeError:  # an unhashable option (say a list window_size): take the checked path
                key = cached = None
            if (
                cached is not None
                and not (q_meta[1] | k_meta[1] | v_meta[1]) & 15
                and cupy.cuda.runtime.getDevice() == cached.device
            ):
                stream = arrays.caller_stream(cached.framework, cached.device)
                out, out_ptr = arrays.new_empty_raw(cached.out_shape, cached.dtype, cached.framework, cached.device)
                lse, lse_ptr = arrays.new_empty_raw(cached.lse_shape, "float32", cached.framework, cached.device)
                forward.run_forward(cached.plan, q_meta[1], k_meta[1], v_meta[1], out_ptr, lse_ptr, stream)
                return (out, lse, None) if return_attn_probs else out
    return _flash_attn_checked(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, key,
    )


def _flash_attn_checked(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    return_attn_probs, cache_key,
):
    """The full path: describe, validate, adapt (copy where the kernels need it), plan, launch; and remember
    the plan under ``cache_key`` when the inputs were used in place."""
    q_info, k_info, v_info = arrays.describe(q, "q"), arrays.describe(k, "k"), arrays.describe(v, "v")
    shape = checks.check_forward_args(
        q_info,
        k_info,
        v_info,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    scale = checks.default_scale(shape.headdim) if softmax_scale is None else float(softmax_scale)
    framework = q_info.framework
    device = q_info.device[1] if q_info.device[0] == "cuda" else cupy.cuda.runtime.getDevice()
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
            plan = forward.plan_forward(
                qc.shape, kc.shape, tuple(_elem_strides(x) for x in (qc, kc, vc, out)), shape.dtype, scale,
                bool(causal), _arch(device),
            )
            forward.run_forward(plan, qc.data.ptr, kc.data.ptr, vc.data.ptr, out.data.ptr, lse.data.ptr, stream)
            used_in_place = qc is q_in and kc is k_in and vc is v_in and framework in ("torch", "cupy")
            if cache_key is not None and used_in_place:
                if len(_cached_calls) >= _MAX_CACHED_CALLS:
                    _cached_calls.clear()
                _cached_calls[cache_key] = _CachedCall(plan, device, framework, out_shape, lse_shape, shape.dtype)
            result = arrays.make_result(out_native, out, framework)
            if padded != shape.headdim:
                result = result[..., : shape.headdim]
            if not return_attn_probs:
                return result
            return result, arrays.make_result(lse_native, lse, framework), None
