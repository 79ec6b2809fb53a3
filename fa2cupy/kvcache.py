"""Decoding entry points: attention of a few new tokens over a KV cache (appended in place), and the merge of
attention results over disjoint key sets. Thin functions over :func:`fa2cupy.pipeline.run` with their call kinds."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import cupy

from . import arrays, checks, decode, device_errors, pipeline
from .pipeline import alibi_ready, kernel_ready


_OUT_LSE = operator.itemgetter(0, 1)


@dataclass
class _KvcacheCheck(pipeline.Call):
    kv: checks.KvcacheCall = None
    scale: float = 0.0
    extras: checks.DecodeExtras = None
    num_splits: int = 0
    return_lse: bool = False
    int_cache_seqlens: bool = False  # cache_seqlens an int: its fixed_seqlen is checked per call


class _Kvcache(pipeline.Kind):
    """flash_attn_with_kvcache. options: (type(cache_seqlens), softmax_scale, causal, window_size, softcap,
    rotary_interleaved, num_splits, return_softmax_lse); values: (cache_seqlens,), which is None for the array slot
    when it is an int (an int is checked per call, not keyed)."""

    name = "kvcache"
    arrays = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table", "rotary_cos",
              "rotary_sin", "cache_leftpad", "alibi_slopes")
    returned = ("out", "softmax_lse")
    poisoned = ("out", "softmax_lse", "q_rotated")
    launch = staticmethod(decode.run_decode)
    no_pointers = decode.NO_POINTERS

    def fixed_values(self, call):
        return None if call.int_cache_seqlens else call.values

    def values_check(self, call, plan, options):
        capacity, new, span, rows = plan.capacity, plan.seqlen_new, plan.rotary_span, plan.seqlen_ro

        def check(values):  # (values: (cache_seqlens,), an int here: the launch's fixed_seqlen as it is)
            fixed = values[0]
            if type(fixed) is int and 0 <= fixed <= capacity - new and (not span or fixed + span <= rows):
                return values
            return (checks.fixed_seqlen(fixed, capacity, new, span, rows),)  # (which raises, naming the argument)

        return check

    def describe(self, named):
        if ("k" in named) != ("v" in named):  # before describing: a None among them is this error, not a type
            raise ValueError("k and v must be given together (new keys and values to append) or both be None")
        return super().describe(named)

    def check(self, infos, options, values):
        _, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, return_lse = options
        cache_seqlens, = values
        framework = arrays.same_framework(list(infos.values()))
        kv = checks.check_kvcache_args(infos, cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                                       window_size=window_size, softcap=softcap,
                                       rotary_interleaved=rotary_interleaved, num_splits=num_splits)
        if framework == "numpy" or (framework == "jax" and kv.seqlen_new):
            raise TypeError("flash_attn_with_kvcache appends to k_cache/v_cache in place: pass mutable device "
                            "arrays (CuPy or PyTorch); NumPy arrays are copies and JAX arrays are immutable")
        return _KvcacheCheck(framework, pipeline.device_of(infos["q"]), (kv.fixed_seqlen,), kv, kv.scale, kv.extras,
                             num_splits, bool(return_lse), isinstance(cache_seqlens, int))

    def adapt(self, call, named, infos):
        ready = {"q": kernel_ready(arrays.to_cupy(named["q"], infos["q"]), call.kv.headdim)}
        if call.scale < 0:  # the kernel's running max needs a positive scale: softmax(c q k^T) = softmax(|c| (-q) k^T)
            ready["q"], call.scale = -ready["q"], -call.scale
        for name in ("k_cache", "v_cache"):
            ready[name] = arrays.to_cupy(named[name], infos[name])
            checks.cache_usable_in_place(ready[name], name)
        widths = {"k": call.kv.headdim, "v": call.kv.dv}  # (the new keys and values, each its cache's head dim)
        for name in self.arrays[3:11]:
            if name in named:
                x = arrays.to_cupy(named[name], infos[name])
                ready[name] = kernel_ready(x, widths[name]) if name in widths else cupy.ascontiguousarray(x)
        if "alibi_slopes" in named:
            ready["alibi_slopes"], stride = alibi_ready(named["alibi_slopes"], infos["alibi_slopes"])
            call.extras = dataclasses.replace(call.extras, alibi_batch_stride=stride)
        return ready

    def plan(self, call, ready, arch, device, options):
        kv, q = call.kv, ready["q"]
        return decode.plan_decode(
            q.shape, {n: x.strides for n, x in ready.items() if x.ndim == 4}, kv.dtype, nheads_kv=kv.nheads_kv,
            cache_rows=ready["k_cache"].shape[0], capacity=kv.capacity, page_size=kv.page_size,
            max_pages=kv.max_pages, seqlen_new=kv.seqlen_new, max_seqlen_k=kv.capacity, softmax_scale=call.scale,
            causal=kv.causal, arch=arch, device=device, num_splits=call.num_splits, item=q.itemsize,
            extras=call.extras, options=options, headdim_v=kv.dv)

    def allocations(self, call, plan):
        kv = call.kv
        q_shape = (kv.batch, kv.seqlen_q, kv.nheads, kv.headdim)
        layout = (("out", q_shape[:3] + (kv.dv,), kv.dtype),)
        if call.return_lse:
            layout += (("softmax_lse", (kv.batch, kv.nheads, kv.seqlen_q), "float32"),)
        if plan.rotary is not None:  # the rotated q, which the attention reads (last: not returned)
            layout += (("q_rotated", q_shape, kv.dtype),)
        return layout

    def result(self, options):
        return _OUT_LSE if options[-1] else pipeline.FIRST


KVCACHE = _Kvcache()


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
    *,
    kernel_options=None,
):
    """Attention of a few new query tokens over a KV cache, appending new keys/values in place (flash-attn 2.x).

    Runs on the inputs' device and the caller's current stream (torch's for PyTorch tensors, CuPy's otherwise),
    without host synchronisation: a decode step costs a dictionary look-up and one to three launches once its
    metadata has been seen. Not differentiable (inference). The caches must be mutable device arrays (CuPy or
    PyTorch; JAX arrays only without k/v, which are read-only there).

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)`` fp16/bf16, seqlen_q small (1 for decoding, a few for
            speculative decoding). headdim a multiple of 8, at most 256.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_kv, headdim)``, or with ``block_table`` paged
            ``(num_pages, page_size, nheads_kv, headdim)`` with page_size a multiple of 16. Read and written in
            place (never copied). v_cache's head dim may differ from q's and k_cache's (a multiple of 8, at most
            256; DeepSeek's 192 / 128, say): the output takes it.
        k, v: optional ``(batch, seqlen_new, nheads_kv, headdim)`` (v with v_cache's head dim), written into the
            cache at slots ``cache_seqlens[b] ...`` before attending.
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
        kernel_options: a :class:`fa2cupy.KernelOptions` (None: the defaults): which decode kernels and launch
            policies run, beyond what the arguments decide (the ``decode_*`` fields).

    Returns:
        ``out`` like q with v_cache's head dim, or ``(out, softmax_lse)``; a row with no key gives 0 (lse +inf).

    Raises:
        TypeError / ValueError naming the argument for bad shapes, dtypes and host-side values (an int
        cache_seqlens, window_size, softcap, rotary_cos shorter than the cache). Values inside device arrays
        (cache_seqlens, cache_batch_idx, block_table, cache_leftpad, and the rotary positions they imply) are
        checked by the kernels, without a synchronisation: a bad one leaves the caches untouched, makes the
        affected rows NaN, and raises ValueError at the next call or at ``fa2cupy.check_device_errors()``.

    Example::

        k_cache = torch.zeros(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)  # and v_cache alike
        lens = torch.tensor([0], device="cuda", dtype=torch.int32)
        out = fa2cupy.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens,
                                              causal=True)  # q, k_new, v_new: (1, 1, 8 or 32, 128)
    """
    device_errors.raise_pending()
    array_seqlens = None if cache_seqlens is None or isinstance(cache_seqlens, int) else cache_seqlens
    return pipeline.run(
        KVCACHE, (q, k_cache, v_cache, k, v, array_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
                  cache_leftpad, alibi_slopes),
        (type(cache_seqlens), softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
         return_softmax_lse),
        (cache_seqlens,), kernel_options)


@dataclass
class _MergeCall(pipeline.Call):
    parts: int = 0
    out_shape: tuple = ()  # (batch, seqlen_q, nheads, headdim)
    dtype: str = ""

    @property
    def padded(self) -> int:
        return pipeline.padded_headdim(self.out_shape[3])


class _Merge(pipeline.Kind):
    """merge_attention_states: arrays (outs, lses), two sequences; no options."""

    name = "merge"
    arrays = ("outs", "lses")
    returned = ("out",)
    poisoned = ("out", "lse_rows")
    cacheable = False
    launch = staticmethod(decode.run_merge)

    def describe(self, named):
        return {f"{group}[{i}]": arrays.describe(x, f"{group}[{i}]") for group in self.arrays
                for i, x in enumerate(named[group])}

    def check(self, infos, options, values):
        outs = [info for name, info in infos.items() if name.startswith("outs[")]
        lses = [info for name, info in infos.items() if name.startswith("lses[")]
        n, batch, seqlen_q, nheads, headdim, dtype = checks.check_merge_args(outs, lses)
        return _MergeCall(outs[0].framework, pipeline.device_of(outs[0]), (), n, (batch, seqlen_q, nheads, headdim),
                          dtype)

    def adapt(self, call, named, infos):
        # Stacked copies in one row order ((batch, seqlen_q, nheads) for both): the kernel reads each part once.
        n, (batch, seqlen_q, nheads, headdim), padded = call.parts, call.out_shape, call.padded
        given = [arrays.to_cupy(x, infos[f"outs[{i}]"]) for i, x in enumerate(named["outs"])]
        parts = cupy.zeros((n, batch, seqlen_q, nheads, padded), dtype=given[0].dtype)
        for i, x in enumerate(given):
            parts[i, ..., :headdim] = x
        stats = cupy.stack([arrays.to_cupy(x, infos[f"lses[{i}]"]).transpose(0, 2, 1)
                            for i, x in enumerate(named["lses"])])
        return {"parts": parts.reshape(n, -1, padded), "lses": cupy.ascontiguousarray(stats).reshape(n, -1)}

    def plan(self, call, ready, arch, device, options):
        parts = ready["parts"]
        return decode.plan_merge(call.parts, parts.shape[1], call.padded, parts.dtype.name, call.dtype)

    def allocations(self, call, plan):
        batch, seqlen_q, nheads, _ = call.out_shape
        return (("out", call.out_shape[:3] + (call.padded,), call.dtype),
                ("lse_rows", (batch, seqlen_q, nheads), "float32"))

    def results(self, call, outs, views):
        lse = cupy.ascontiguousarray(views["lse_rows"].transpose(0, 2, 1))
        out = pipeline.returned_head_dim(outs, call.out_shape[3], call.padded)
        return out + [arrays.from_cupy(lse, call.framework)]

    def result(self, options):
        return _OUT_LSE


MERGE = _Merge()


def merge_attention_states(outs, lses, *, kernel_options=None):
    """Merges attention results computed over disjoint sets of keys into attention over their union.

    Runs on the inputs' device and the caller's current stream, as :func:`fa2cupy.flash_attn_func`; not
    differentiable.

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

    ``kernel_options``: a :class:`fa2cupy.KernelOptions` (debug_poison fills the outputs with NaN first).

    Example::

        o1, l1, _ = fa2cupy.flash_attn_func(q, k[:, :512], v[:, :512], return_attn_probs=True)
        o2, l2, _ = fa2cupy.flash_attn_func(q, k[:, 512:], v[:, 512:], return_attn_probs=True)
        out, lse = fa2cupy.merge_attention_states([o1, o2], [l1, l2])  # == attention over all of k, v
    """
    return pipeline.run(MERGE, (list(outs), list(lses)), (), (), kernel_options)
