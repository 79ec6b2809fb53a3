"""JAX wrapper with gradients: ``from fa2cupy.jax import flash_attn_func``.

Works eagerly and inside ``jax.jit``, ``jax.grad``, ``jax.value_and_grad`` and ``jax.vjp`` (and, one call per
batch element, ``jax.vmap``): the forward and the backward are XLA custom calls made with
``jax.experimental.buffer_callback``, whose Python callback receives XLA's device buffers and XLA's CUDA stream.
The callback views the buffers as CuPy arrays (zero-copy, from their device pointers), makes
``cupy.cuda.ExternalStream(ctx.stream)`` CuPy's current stream, so fa2cupy's kernels launch on XLA's stream,
and writes the results into XLA's output buffers. Nothing in it synchronises the host.

The gradient is a ``jax.custom_vjp``: the forward saves ``(q, k, v, out, lse)`` only (no attention
probabilities) and the backward calls :func:`fa2cupy.flash_attn_backward`.

Command buffers (CUDA graphs): the callbacks are declared ``command_buffer_compatible``, so XLA may run the
Python callback once, capture its launches into a CUDA graph and replay that graph on later executions. Two
consequences are handled here:

* every device allocation made inside a callback (fa2cupy's outputs and workspaces) comes from a private,
  never-freed arena per call signature (:class:`_Arena`), because a replayed graph keeps writing to the
  addresses it was captured with; CuPy's pool would hand those addresses to someone else;
* kernels are compiled (NVRTC) and loaded when the call is first traced, by a small warm-up run outside any
  capture, not inside the callback.

Set ``fa2cupy.jax.COMMAND_BUFFER_COMPATIBLE = False`` before tracing to have XLA call the Python callback on
every execution instead.

This module imports jax; ``import fa2cupy`` does not import it.
"""

from __future__ import annotations

import functools
import math
import threading

import cupy
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import fa2cupy
from fa2cupy import arrays, attention, checks, options, packed

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "COMMAND_BUFFER_COMPATIBLE",
]

#: Let XLA capture the callbacks into command buffers (CUDA graphs). Read when a call is traced.
COMMAND_BUFFER_COMPATIBLE = True


# ------------------------------------------------------------------------------------------ device memory


class _Arena:
    """Device memory for the allocations made by one callback signature, kept for the life of the process.

    Allocation ``i`` of a callback run gets block ``i`` (grown if too small; a replaced block is kept too, in
    case a captured graph still uses it). A run always makes the same allocations in the same order for one
    signature, so the blocks are reused run after run. That is safe because all runs of one signature are
    ordered on one XLA stream (the stream is part of the key) and nothing else ever gets these blocks.
    """

    def __init__(self, device: int):
        self.device = device
        self.blocks: list = []
        self.retired: list = []
        self.next = 0

    def malloc(self, size: int):
        i = self.next
        self.next += 1
        if i < len(self.blocks) and self.blocks[i].size >= size:
            mem = self.blocks[i]
        else:
            with cupy.cuda.Device(self.device):
                mem = cupy.cuda.Memory(max(size, 1))
            if i < len(self.blocks):
                self.retired.append(self.blocks[i])
                self.blocks[i] = mem
            else:
                self.blocks.append(mem)
        return cupy.cuda.MemoryPointer(mem, 0)


_arenas: dict = {}
_arenas_lock = threading.Lock()


def _arena(key) -> _Arena:
    with _arenas_lock:
        arena = _arenas.get(key)
        if arena is None:
            arena = _arenas[key] = _Arena(key[1])
        arena.next = 0
        return arena


# ------------------------------------------------------------------------------------------ buffer views


def _pointer(buf) -> int:
    return int(buf.__cuda_array_interface__["data"][0])


def _view(buf, device: int):
    """A CuPy array over an XLA buffer (``jax.experimental.buffer_callback.Buffer``) on ``device``, zero-copy.

    Built from the raw pointer of ``__cuda_array_interface__`` rather than with ``cupy.asarray``, which may
    synchronise on a stream named by the interface.
    """
    shape = tuple(int(n) for n in buf.shape)
    dtype = np.dtype(buf.dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    mem = cupy.cuda.UnownedMemory(_pointer(buf), nbytes, buf, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _copy_into(dst, src, stream) -> None:
    """dst[...] = src on ``stream`` (CuPy's current stream), without any host synchronisation."""
    if src.flags.c_contiguous and src.data.ptr != dst.data.ptr:
        # cudaMemcpyDeviceToDevice = 3; async and capturable.
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, 3, stream.ptr)
    elif src.data.ptr != dst.data.ptr:
        dst[...] = src  # an elementwise copy kernel on the current stream


def _xla_stream(ctx) -> int:
    try:
        stream = ctx.stream
    except Exception as exc:  # CPU backend: "XLA FFI GPU context is not available"
        raise RuntimeError(
            f"fa2cupy.jax runs on CUDA GPUs; these arrays are on another backend ({exc})"
        ) from exc
    return int(stream() if callable(stream) else stream)


# ------------------------------------------------------------------------------------------ the callbacks
#
# A call's static options are one hashable tuple, opts = (scale, causal, left, right, softcap, has_alibi, varlen,
# dropout_p, paged, kernel_options), varlen being None or (max_seqlen_q, max_seqlen_k) and kernel_options a
# fa2cupy.KernelOptions. Its array inputs are q, k, v, then
# cu_seqlens_q and cu_seqlens_k (varlen), then the block_table (paged), then the ALiBi slopes (has_alibi), then the
# dropout rng state (dropout_p > 0: uint32 (4,) drawn from the caller's key, read by the kernels from GPU memory):
# the "extras" below.


def _split_extras(extras, opts):
    """(cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, rng_state) from the extra inputs, None where
    absent."""
    has_alibi, varlen, dropout_p, paged = opts[5], opts[6], opts[7], opts[8]
    extras = list(extras)
    cu_q, cu_k = (extras.pop(0), extras.pop(0)) if varlen else (None, None)
    table = extras.pop(0) if varlen and paged else None
    slopes = extras.pop(0) if has_alibi else None
    state = extras.pop(0) if dropout_p else None
    return cu_q, cu_k, table, slopes, state


def _kw(opts, state):
    scale, causal, left, right, softcap = opts[:5]
    return dict(softmax_scale=scale, causal=causal, window_size=(left, right), softcap=softcap, dropout_p=opts[7],
                dropout_rng_state=state, kernel_options=opts[9])


def _run_forward(outs, q, k, v, *extras_and_opts):
    """Forward on CuPy arrays, writing into the CuPy arrays ``outs = (out, lse)``; current stream."""
    *extras, opts = extras_and_opts
    cu_q, cu_k, table, slopes, state = _split_extras(extras, opts)
    if opts[6]:
        out, lse = attention.varlen_forward_with_lse(q, k, v, cu_q, cu_k, *opts[6], alibi_slopes=slopes,
                                                     block_table=table, **_kw(opts, state))
    else:  # (out, lse) only: the forward of the custom_vjp never builds attention probabilities
        out, lse = attention.forward_with_lse(q, k, v, alibi_slopes=slopes, **_kw(opts, state))
    stream = cupy.cuda.get_current_stream()
    _copy_into(outs[0], out, stream)
    _copy_into(outs[1], lse, stream)


def _run_backward(outs, dout, q, k, v, out, lse, *extras_and_opts):
    """Backward on CuPy arrays, writing into ``outs = (dq, dk, dv)``; current stream."""
    *extras, opts, deterministic = extras_and_opts
    cu_q, cu_k, table, slopes, state = _split_extras(extras, opts)
    if opts[6]:
        grads = fa2cupy.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, *opts[6],
                                                   deterministic=deterministic, alibi_slopes=slopes,
                                                   block_table=table, **_kw(opts, state))
    else:
        grads = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                            alibi_slopes=slopes, **_kw(opts, state))
    stream = cupy.cuda.get_current_stream()
    for dst, src in zip(outs, grads):
        _copy_into(dst, src, stream)


def _in_callback(kind, run, options, ctx, outs, *inputs):
    stream_ptr = _xla_stream(ctx)
    device = cupy.cuda.runtime.pointerGetAttributes(_pointer(inputs[0])).device
    in_views = [_view(b, device) for b in inputs]
    out_views = [_view(b, device) for b in outs]
    key = (kind, device, stream_ptr, tuple((a.shape, a.dtype.name) for a in in_views), options)
    arena = _arena(key)
    with cupy.cuda.Device(device):
        stream = arrays._external_stream(stream_ptr, device)
        with stream, cupy.cuda.using_allocator(arena.malloc):
            run(out_views, *in_views, *options)


@functools.lru_cache(maxsize=None)
def _forward_callback(opts: tuple):
    # Cached so that equal calls share one callback object: eager calls then hit JAX's compilation cache.
    def callback(ctx, outs, *inputs):
        _in_callback("fwd", _run_forward, (opts,), ctx, outs, *inputs)

    return callback


@functools.lru_cache(maxsize=None)
def _backward_callback(opts: tuple, deterministic: bool):
    def callback(ctx, outs, *inputs):
        _in_callback("bwd", _run_backward, (opts, deterministic), ctx, outs, *inputs)

    return callback


# ------------------------------------------------------------------------------------------ warm-up


_warmed: set = set()


def _warm_up(kind, shape: checks.AttnShape, opts, deterministic) -> None:
    """Compile and load the kernels of a call before XLA runs (and maybe captures) the callback.

    Runs a padded call of the same kernel variant on tiny CuPy arrays (one batch, one kv group, short sequences;
    same head dim, dtype, group size and options; varlen calls use the same kernels) on a private stream, once
    per signature. Best effort: on a machine without a usable GPU it does nothing and the callback itself reports
    the problem.
    """
    group = shape.nheads // shape.nheads_kv
    key = (kind, shape.headdim, shape.dv, shape.dtype, group, opts[:6] + opts[7:8] + opts[9:], deterministic)
    if key in _warmed:
        return
    _warmed.add(key)
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return
    except Exception:  # noqa: BLE001 -- no CUDA driver or device here
        return
    try:
        dtype = arrays._cupy_dtype(shape.dtype)
        sq, sk = min(shape.seqlen_q, 128) or 1, min(shape.seqlen_k, 128) or 1
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            rnd = cupy.random.default_rng(0)

            def make(*dims):
                return rnd.standard_normal(dims, dtype=cupy.float32).astype(dtype)

            padded = opts[:6] + (None,) + opts[7:8] + (False,) + opts[9:]
            extras = ((cupy.ones(group, cupy.float32),) if opts[5] else ()) + (
                (cupy.zeros(4, cupy.uint32),) if opts[7] else ())
            q, k, v = make(1, sq, group, shape.headdim), make(1, sk, 1, shape.headdim), make(1, sk, 1, shape.dv)
            out = cupy.empty((1, sq, group, shape.dv), dtype)
            lse = cupy.empty((1, group, sq), cupy.float32)
            _run_forward((out, lse), q, k, v, *extras, padded)
            if kind == "bwd":
                grads = (cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v))
                _run_backward(grads, make(1, sq, group, shape.dv), q, k, v, out, lse, *extras, padded,
                              deterministic)
        stream.synchronize()
    except Exception:  # noqa: BLE001 -- best effort, see the docstring
        pass


# ------------------------------------------------------------------------------------------ XLA calls


def _info(name, x) -> arrays.ArrayInfo:
    # What describe() would say about a C-contiguous device array (XLA arrays always are).
    shape = tuple(int(n) for n in x.shape)
    return arrays.ArrayInfo(name, "jax", shape, np.dtype(x.dtype).name, arrays._c_strides(shape), ("cuda", 0))


def _forward_call(q, k, v, extras, opts):
    if opts[6]:  # varlen: out like q (with v's head dim), lse (nheads, total_q)
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    result = (jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32))
    call = buffer_callback(
        _forward_callback(opts), result, vmap_method="sequential",
        command_buffer_compatible=COMMAND_BUFFER_COMPATIBLE,
    )
    return call(q, k, v, *extras)


def _backward_call(dout, q, k, v, out, lse, extras, opts, deterministic):
    result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = buffer_callback(
        _backward_callback(opts, deterministic), result, vmap_method="sequential",
        command_buffer_compatible=COMMAND_BUFFER_COMPATIBLE,
    )
    return call(dout, q, k, v, out, lse, *extras)


def _shape_of(q, k, v, opts) -> checks.AttnShape:
    if opts[6]:  # varlen: (total, heads, d) arrays (k: or pages); the warm-up only needs heads, head dims and dtype
        dv = v.shape[-1] if v.shape[-1] != q.shape[2] else 0
        return checks.AttnShape(1, opts[6][0], opts[6][1], q.shape[1], k.shape[-2], q.shape[2],
                                np.dtype(q.dtype).name, dv)
    return checks.check_forward_args(_info("q", q), _info("k", k), _info("v", v))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, extras, opts, deterministic):
    return _forward_call(q, k, v, extras, opts)


def _attention_fwd(q, k, v, extras, opts, deterministic):
    out, lse = _forward_call(q, k, v, extras, opts)
    # the residuals: no probabilities, O(seqlen) besides q, k, v, out
    return (out, lse), (q, k, v, out, lse, extras)


def _attention_bwd(opts, deterministic, residuals, cotangents):
    q, k, v, out, lse, extras = residuals
    dout, _ = cotangents  # lse is returned through stop_gradient: its cotangent is always zero
    _warm_up("bwd", _shape_of(q, k, v, opts), opts, deterministic)
    dq, dk, dv = _backward_call(dout.astype(q.dtype), q, k, v, out, lse, extras, opts, deterministic)
    # cu_seqlens, the ALiBi slopes and the rng state get no gradient (as in flash-attn)
    return dq, dk, dv, tuple(None for _ in extras)


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _attention_jit(q, k, v, extras, opts, deterministic):
    return _attention(q, k, v, extras, opts, deterministic)


def _dropout_extras(dropout_p, dropout_rng) -> tuple[float, tuple]:
    """(dropout_p, (rng state,) or ()): with dropout, four uint32 words drawn from the caller's JAX PRNG key
    (``jax.random.key`` or ``PRNGKey``), a traced array the kernels read from GPU memory."""
    p = 0.0 if (type(dropout_p) is float and dropout_p == 0.0) else checks._real(dropout_p, "dropout_p")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if p == 0.0:
        return 0.0, ()
    if dropout_rng is None:
        raise ValueError("dropout_p > 0 needs dropout_rng, a JAX PRNG key (jax.random.key(seed)): the backward "
                         "regenerates the forward's mask from it")
    return p, (jax.random.bits(dropout_rng, (4,), jnp.uint32),)


def _alibi_info(alibi_slopes):
    if alibi_slopes is None:
        return None, ()
    slopes = alibi_slopes if isinstance(alibi_slopes, jax.Array) else jnp.asarray(alibi_slopes)
    return _info("alibi_slopes", slopes), (slopes,)


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
    dropout_rng=None,
    kernel_options=None,
):
    """Differentiable FlashAttention-2 on JAX GPU arrays, flash-attn 2.x compatible.

    Same arguments and results as :func:`fa2cupy.flash_attn_func`; works on concrete arrays and on traced
    values inside ``jax.jit``, ``jax.grad``, ``jax.value_and_grad``, ``jax.vjp`` and ``jax.vmap`` (the last one
    runs one call per batch element). Gradients flow to ``q``, ``k`` and ``v``.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``; k, v: ``(batch, seqlen_k, nheads_kv, headdim)`` (v's head dim
            may differ: the output takes it); float16 or bfloat16, on one CUDA device.
        softmax_scale: default ``1 / sqrt(headdim)``.
        causal: bottom-right aligned causal mask.
        deterministic: make the backward bit-reproducible run to run (the forward always is).
        window_size: sliding window ``(left, right)``, as in :func:`fa2cupy.flash_attn_func`.
        softcap: as in :func:`fa2cupy.flash_attn_func` (a static option: one compiled callback per value).
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)`` array (an input of the call; no gradient).
        dropout_p, dropout_rng: dropout on the probabilities with its mask drawn from ``dropout_rng``, a JAX PRNG
            key (required with dropout; split it per step as usual); the backward regenerates the same mask.
        return_attn_probs: also return ``softmax_lse``.
        kernel_options: a :class:`fa2cupy.KernelOptions` for the forward and the backward (a static option).

    Returns:
        ``out`` like q with v's head dim; with ``return_attn_probs=True``, ``(out, softmax_lse, None)``,
        ``softmax_lse`` float32 ``(batch, nheads, seqlen_q)`` under ``jax.lax.stop_gradient`` (not differentiable,
        as in flash-attn).

    The kernels run on the arrays' device, on XLA's stream (inside its custom calls).

    Example::

        loss = lambda q, k, v: fa2cupy.jax.flash_attn_func(q, k, v, causal=True).astype(jnp.float32).sum()
        dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    Raises:
        TypeError / ValueError / NotImplementedError with the messages of :func:`fa2cupy.flash_attn_func`,
        when the call is traced.
    """
    p, rng_extras = _dropout_extras(dropout_p, dropout_rng)
    q, k, v = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (q, k, v))
    alibi_info, extras = _alibi_info(alibi_slopes)
    extras += rng_extras
    shape = checks.check_forward_args(
        _info("q", q), _info("k", k), _info("v", v), dropout_p=dropout_p, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_info,
        deterministic=deterministic, return_attn_probs=return_attn_probs,
    )
    scale = 1.0 / math.sqrt(shape.headdim) if softmax_scale is None else float(softmax_scale)
    # hashable: a static argument of the jit
    opts = (scale, bool(causal), int(window_size[0]), int(window_size[1]), float(softcap), alibi_info is not None,
            None, p, False, options.resolve(kernel_options))
    _warm_up("fwd", shape, opts, bool(deterministic))
    out, lse = _attention_jit(q, k, v, extras, opts, bool(deterministic))
    if return_attn_probs:
        return out, jax.lax.stop_gradient(lse), None
    return out


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
    dropout_rng=None,
    kernel_options=None,
):
    """Differentiable :func:`fa2cupy.flash_attn_varlen_func` on JAX GPU arrays (same arguments and results;
    ``max_seqlen_q``/``max_seqlen_k`` are static ints; dropout with ``dropout_rng`` and ``kernel_options`` as in
    :func:`flash_attn_func`).
    Gradients flow to q, k and v (with block_table, to the page pools k and v); rows outside every sequence get
    zero gradients."""
    p, rng_extras = _dropout_extras(dropout_p, dropout_rng)
    q, k, v, cu_q, cu_k = (x if isinstance(x, jax.Array) else jnp.asarray(x)
                           for x in (q, k, v, cu_seqlens_q, cu_seqlens_k))
    table = () if block_table is None else (block_table if isinstance(block_table, jax.Array)
                                            else jnp.asarray(block_table),)
    alibi_info, slopes = _alibi_info(alibi_slopes)
    shape, _, _ = checks.check_varlen_args(
        _info("q", q), _info("k", k), _info("v", v), _info("cu_seqlens_q", cu_q), _info("cu_seqlens_k", cu_k),
        max_seqlen_q, max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_info, deterministic=deterministic,
        return_attn_probs=return_attn_probs, block_table=_info("block_table", table[0]) if table else None)
    scale = 1.0 / math.sqrt(shape.headdim) if softmax_scale is None else float(softmax_scale)
    opts = (scale, bool(causal), int(window_size[0]), int(window_size[1]), float(softcap), alibi_info is not None,
            (int(max_seqlen_q), int(max_seqlen_k)), p, bool(table), options.resolve(kernel_options))
    _warm_up("fwd", shape, opts, bool(deterministic))
    out, lse = _attention_jit(q, k, v, (cu_q, cu_k) + table + slopes + rng_extras, opts, bool(deterministic))
    if return_attn_probs:
        return out, jax.lax.stop_gradient(lse), None
    return out


flash_attn_qkvpacked_func, flash_attn_kvpacked_func = packed.make_packed(flash_attn_func)
flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func = packed.make_varlen_packed(flash_attn_varlen_func)
