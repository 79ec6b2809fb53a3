"""The kv-cache and merge entry points, and the public names of :mod:`fa2cupy.attention` (whose entry points run
through :mod:`fa2cupy.pipeline`). Data flows one way: arrays in -> checks -> config -> launch -> arrays out, in the
caller's framework, on the caller's stream."""

from __future__ import annotations

import dataclasses
import math

import cupy

from . import arrays, checks, decode, device_errors, forward
from .attention import (  # noqa: F401 -- public names, re-exported
    dropout_mask,
    flash_attn_backward,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_backward,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    forward_with_lse,
    varlen_forward_with_lse,
)

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


def _device_of(info) -> int:
    """The CUDA device a call runs on: its array's, or the current one for host NumPy inputs."""
    return info.device[1] if info.device[0] == "cuda" else cupy.cuda.runtime.getDevice()


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
