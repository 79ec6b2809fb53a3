"""FlashAttention-2 entry points, flash-attn 2.x compatible: dense, packed and varlen (paged K/V too) forward and
backward, and the dropout keep mask. Each is a thin function over :func:`fa2cupy.pipeline.run` with its call kind.

Every function runs on the inputs' device (the current device for NumPy inputs, which are copied there) and on the
caller's current stream of its framework: torch's current stream for PyTorch tensors, CuPy's current stream
otherwise (JAX inputs are ordered before it through DLPack); the host never waits for the GPU (NumPy results
excepted). The results come back in the inputs' framework. These functions are not differentiable: for gradients
through autograd use :mod:`fa2cupy.torch` or :mod:`fa2cupy.jax`, which call them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import cupy

from . import arrays, backward, checks, configs, device_errors, forward, packed, paging, pipeline, tensor_maps
from .pipeline import alibi_ready, contiguous, elem_strides, kernel_ready, padded_headdim

@dataclass
class _AttentionCall(pipeline.Call):
    """A checked forward or backward call: its problem size (varlen: batch = sequences, seqlens = the maxima) and
    options as the planners take them."""

    shape: checks.AttnShape = None
    scale: float = 0.0
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    dropout_p: float = 0.0
    deterministic: bool = False
    totals: tuple | None = None  # varlen: (total_q, total_k), the packed arrays' rows
    alibi_stride: int | None = None  # the slopes' batch stride in elements (None: no ALiBi), found by adapt
    paged: tuple | None = None  # paged K/V: (num_pages, page_size, max_pages), found by adapt
    per_call_values: bool = False  # dropout seed and offset given per call (not in an rng state array)
    kernel_width: int | None = None  # a wider Hopper kernel's width (the kind's choose) the arrays run at as they are
    own_widths: bool = False  # (v's head dim differing from q's) each array ready at its own head dim (choose)

    @property
    def padded(self) -> int:
        """The head dim the arrays are made ready at: q's and v's, the larger, padded to a multiple of 8 (the
        narrower arrays padded with zeros to it). A wider Hopper kernel may run on them (kernel_width)."""
        return padded_headdim(max(self.shape.headdim, self.shape.dv))

    @property
    def out_width(self) -> int:
        """The forward's output's head dim as allocated: v's (padded to a multiple of 8) with own_widths, else
        padded. (The backward's gradients are all at padded, the dK/dV stores' one bound.)"""
        return padded_headdim(self.shape.dv) if self.own_widths else self.padded

    def dims(self, name: str) -> tuple:
        """(head dim, kernels' head dim) of the array ``name``: v's for v, dout and out, q's for q and k; with
        own_widths the array's own, padded to a multiple of 8 only."""
        own = self.shape.dv if name in ("v", "dout", "out") else self.shape.headdim
        return own, (padded_headdim(own) if self.own_widths else self.padded)

    def ready(self, x, info, name: str):
        """``x`` (a caller's array, named as in dims) as kernel_ready makes it for this call."""
        return kernel_ready(arrays.to_cupy(x, info), *self.dims(name))


def _attention_call(infos: dict, shape, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, values,
                    totals=None) -> _AttentionCall:
    """The checked call, after the shape checks: the dropout seed and offset checked (``values``), the scale
    defaulted, where it runs."""
    state = infos.get("dropout_rng_state")
    seed, offset = checks.check_dropout_rng(dropout_p, *values, state)
    scale = checks.default_scale(shape.headdim) if softmax_scale is None else float(softmax_scale)
    q = infos["q"]
    return _AttentionCall(q.framework, pipeline.device_of(q), (seed, offset), shape, scale, bool(causal),
                          window_size, float(softcap), float(dropout_p), bool(deterministic), totals,
                          per_call_values=bool(dropout_p) and state is None)


def _adapt_side_arrays(call: _AttentionCall, named: dict, infos: dict, ready: dict, names) -> None:
    """Adds the small side arrays among ``names`` that were given to ``ready``: contiguous views, and the ALiBi
    slopes with their batch stride noted in ``call``."""
    for name in names:
        if name not in named:
            continue
        if name == "alibi_slopes":
            ready[name], call.alibi_stride = alibi_ready(named[name], infos[name])
        else:
            ready[name] = contiguous(named[name], infos[name])


def _ready_at_own_widths(call: _AttentionCall, names, make, strides=elem_strides) -> dict:
    """The arrays ``names`` made ready by ``make(name)`` (call.ready, or _varlen_view); with own_widths, each at its
    own head dim, unless one has strides TMA cannot take (``strides(x)``: the kernels' element strides): those calls
    run on the mma.sync kernels, which need one head dim, so all are padded."""
    ready = {n: make(n) for n in names}
    if call.own_widths and not all(tensor_maps.usable(x.shape, strides(x)) for x in ready.values()):
        call.own_widths, call.kernel_width = False, None
        ready = {n: make(n) for n in names}
    return ready


def _fold_negative_scale(call: _AttentionCall, ready: dict) -> None:
    """The forward's running max is over raw scores, valid for a positive scale only:
    softmax(c * q k^T) == softmax(|c| * (-q) k^T)."""
    if call.scale < 0:
        ready["q"], call.scale = -ready["q"], -call.scale


def _OUT_LSE_NONE(outs) -> tuple:
    return outs[0], outs[1], None


_GRADIENTS = operator.itemgetter(0, 1, 2)


class _Attention(pipeline.Kind):
    """What the attention kinds share: the dropout seed and offset checked per call, their outputs sliced back to
    the caller's head dim. ``dropout_at``: where dropout_p is in the kind's options."""

    dropout_at = 0

    def fixed_values(self, call):
        return None if call.per_call_values else call.values

    def values_check(self, call, plan, options):
        dropout_p, check_dropout_rng = options[self.dropout_at], checks.check_dropout_rng
        return lambda values: check_dropout_rng(dropout_p, *values)

    #: Which of the returned outputs (the first ones) have the head dim as their last axis, q's ("q") or v's ("v"):
    #: sliced back to the caller's where the kernels ran on a padded one (the log-sum-exp is not).
    head_dim_outputs = ("v",)

    def choose(self, call, infos, arch, options):
        """On Hopper, a head dim without a Hopper row runs at the next Hopper width up (configs.hopper_pad_width)
        where the Hopper kernel there takes the call; never with paged K/V (the pages are used in place). A call
        whose v has a head dim of its own reads each array at its own where the Hopper kernel takes it at the wider
        one (own_widths): padded calls, and varlen ones where configs.hopper_varlen_own_widths holds (in the
        backward with v the narrower)."""
        if "block_table" in infos:
            return
        s, varlen = call.shape, call.totals is not None
        mask, mods, _, _ = forward.kernel_variant(call.causal, call.window_size, call.softcap,
                                                  "alibi_slopes" in infos, call.dropout_p)

        def takes(width):
            return configs.hopper_takes_call(arch, width, s.dtype, self.is_backward, mask, mods, varlen, s.seqlen_q,
                                             call.deterministic, options, dropout=call.dropout_p > 0)

        width = configs.hopper_pad_width(arch, call.padded, options.hopper_pad_headdim)
        if width is not None and takes(width):
            # The Hopper kernels read the arrays as they are: TMA copies read zeros past their head dim, and a
            # varlen call's ragged tiles (cp.async) stop at it; no output column past it is written.
            call.kernel_width = width
        if s.headdim == s.dv:
            return
        width = call.kernel_width or call.padded
        # (the backward's varlen dK and dV stores are bounded by q's head dim: v no wider)
        own_varlen = configs.hopper_varlen_own_widths(width, padded_headdim(s.headdim), padded_headdim(s.dv)) and (
            not self.is_backward or s.dv < s.headdim)
        if (not varlen or own_varlen) and takes(width):
            # The Hopper kernels' copies (and the forward's output store) are TMA's, which read zeros past an
            # array's columns and write none past the output's: v, or q and k, need no padded copy, and the forward's
            # output has v's head dim (the backward's gradients stay at the wider one, dK and dV's one store bound,
            # and are sliced). Varlen: a sequence's ragged tiles and output rows stop at each array's own head dim
            # (hopper_varlen_own_widths).
            call.own_widths, call.kernel_width = True, width

    is_backward = False  # (for choose)

    def _returned_dims(self, call) -> list:
        """The caller's head dim of each output in head_dim_outputs (they are allocated at _allocated_width)."""
        return [call.shape.dv if which == "v" else call.shape.headdim for which in self.head_dim_outputs]

    def results(self, call, outs, views):
        n = len(self.head_dim_outputs)
        return pipeline.returned_head_dim(outs[:n], self._returned_dims(call), self._allocated_width(call)) + outs[n:]

    @staticmethod
    def _allocated_width(call) -> int:
        """The head dim the outputs that have one are allocated at."""
        return call.padded

    def cached_result(self, call, options):
        n, dims, width = len(self.head_dim_outputs), self._returned_dims(call), self._allocated_width(call)
        result = self.result(options)
        if all(d == width for d in dims):
            return result
        returned_head_dim = pipeline.returned_head_dim  # (the own-width backward's gradients, sliced each call)
        return lambda made: result(returned_head_dim(made[:n], dims, width) + made[n:])


# --------------------------------------------------------------------------------------------- forward


class _Forward(_Attention):
    """flash_attn_func. options: (dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
    return_attn_probs); values: (dropout_seed, dropout_offset)."""

    name = "fwd"
    arrays = ("q", "k", "v", "alibi_slopes", "dropout_rng_state")
    returned = poisoned = ("out", "softmax_lse")
    launch = staticmethod(forward.run_forward)
    no_pointers = forward.NO_POINTERS

    def check(self, infos, options, values):
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs = options
        shape = checks.check_forward_args(
            infos["q"], infos["k"], infos["v"], dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=infos.get("alibi_slopes"),
            deterministic=deterministic, return_attn_probs=return_attn_probs)
        return _attention_call(infos, shape, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               values)

    def adapt(self, call, named, infos):
        ready = _ready_at_own_widths(call, ("q", "k", "v"), lambda n: call.ready(named[n], infos[n], n))
        _fold_negative_scale(call, ready)
        _adapt_side_arrays(call, named, infos, ready, ("alibi_slopes", "dropout_rng_state"))
        return ready

    def plan(self, call, ready, arch, device, options):
        q, k, v = ready["q"], ready["k"], ready["v"]
        strides = (elem_strides(q), elem_strides(k), elem_strides(v), pipeline.c_strides(self._out_shape(call)))
        return forward.plan_forward(
            q.shape, k.shape, strides, call.shape.dtype, call.scale, call.causal, arch, window_size=call.window_size,
            softcap=call.softcap, alibi_batch_stride=call.alibi_stride, dropout_p=call.dropout_p, options=options,
            width=call.kernel_width, headdim_v=v.shape[3] if call.own_widths else None)

    @staticmethod
    def _out_shape(call) -> tuple:
        s = call.shape
        return (s.batch, s.seqlen_q, s.nheads, call.out_width)

    @staticmethod
    def _allocated_width(call) -> int:
        return call.out_width

    def allocations(self, call, plan):
        s = call.shape
        return (("out", self._out_shape(call), s.dtype), ("softmax_lse", (s.batch, s.nheads, s.seqlen_q), "float32"))

    def result(self, options):
        return _OUT_LSE_NONE if options[-1] else pipeline.FIRST  # (return_attn_probs: probabilities added later)


FORWARD = _Forward()


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
    kernel_options=None,
):
    """Exact attention ``softmax(q k^T * softmax_scale) v`` by FlashAttention-2, flash-attn 2.x compatible.

    Runs on the inputs' device (NumPy inputs: copied to the current one) and on the caller's current stream (torch's
    for PyTorch tensors, CuPy's otherwise), without host synchronisation. Not differentiable: for gradients use
    :func:`fa2cupy.torch.flash_attn_func` or :func:`fa2cupy.jax.flash_attn_func`.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``; k: ``(batch, seqlen_k, nheads_kv, headdim)``; v: ``(batch,
            seqlen_k, nheads_kv, headdim_v)``, whose head dim may differ from q's and k's (the output takes it;
            the kernels then run on the larger, the other arrays zero-padded to it). float16 or bfloat16, all the
            same dtype, from CuPy, PyTorch, JAX (device arrays) or NumPy (copied to the current
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
        softcap: ``> 0`` passes the scaled scores through ``softcap * tanh(s / softcap)`` (Gemma 2, Grok); the
            kernels take tanh as ``tanh.approx.f32``, as flash-attn's do (within 1.1e-5 of tanh, H200).
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
        kernel_options: a :class:`fa2cupy.KernelOptions` (None: the defaults): which kernels run, beyond what the
            arguments decide (for A/B timings, tests and debugging).

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim_v)`` typed like q, in q's framework; with
        ``return_attn_probs=True`` the tuple ``(out, softmax_lse, probs)`` with ``softmax_lse`` float32
        ``(batch, nheads, seqlen_q)``, natural log, and ``probs`` None without dropout; with dropout the float32
        ``(batch, nheads, seqlen_q, seqlen_k)`` probabilities the output was made of, ``P o Z / (1 - p)`` (for
        tests at small sizes: it is recomputed; None with ``dropout_rng_state``).

    Raises:
        TypeError / ValueError naming the offending argument for bad shapes, dtypes, devices or layouts.

    Example::

        import cupy, fa2cupy
        q, k, v = (cupy.random.randn(2, 1024, 8, 64).astype(cupy.float16) for _ in range(3))
        out = fa2cupy.flash_attn_func(q, k, v, causal=True)  # (2, 1024, 8, 64) float16
    """
    result = pipeline.run(
        FORWARD, (q, k, v, alibi_slopes, dropout_rng_state),
        (dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs),
        (dropout_seed, dropout_offset), kernel_options)
    if return_attn_probs and dropout_p and dropout_rng_state is None:
        # Only a caller of this function who asks for them gets the probabilities: seqlen_q x seqlen_k floats per
        # head, recomputed here (the autograd wrappers use forward_with_lse, which never builds them).
        out, lse, _ = result
        return out, lse, _dropped_probs(q, k, lse, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        dropout_p, dropout_seed, dropout_offset, kernel_options)
    return result


def forward_with_lse(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, deterministic=False, *, dropout_seed=None, dropout_offset=0,
                     dropout_rng_state=None, kernel_options=None):
    """``(out, softmax_lse)`` of :func:`flash_attn_func` (same arguments), never the probabilities: the forward of
    the autograd wrappers (fa2cupy.torch, fa2cupy.jax), which keep only O(seqlen) statistics for the backward."""
    return pipeline.run(
        FORWARD, (q, k, v, alibi_slopes, dropout_rng_state),
        (dropout_p, softmax_scale, causal, window_size, softcap, deterministic, True),
        (dropout_seed, dropout_offset), kernel_options)[:2]


flash_attn_qkvpacked_func, flash_attn_kvpacked_func = packed.make_packed(flash_attn_func)


def _dropped_probs(q, k, lse, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
                   dropout_offset, kernel_options=None):
    """float32 ``P o Z / (1 - p)`` of a forward with dropout, recomputed from the caller's q, k and the kernel's lse
    ``(batch, nheads, seqlen_q)`` (return_attn_probs); in the caller's framework, on its stream. Small sizes only:
    it materialises every score."""
    from .reference import _visible

    softcap, dropout_p = float(softcap), float(dropout_p)
    infos = [arrays.describe(x, name) for x, name in ((q, "q"), (k, "k"), (lse, "softmax_lse"))]
    framework, device = infos[0].framework, pipeline.device_of(infos[0])
    seed, offset = checks.check_dropout_rng(dropout_p, dropout_seed, dropout_offset)
    with cupy.cuda.Device(device):
        with arrays.caller_stream(framework, device):
            qc, kc, lc = (arrays.to_cupy(x, info) for x, info in zip((q, k, lse), infos))
            batch, sq, nheads, headdim = qc.shape
            sk, nheads_kv = kc.shape[1], kc.shape[2]
            scale = checks.default_scale(headdim) if softmax_scale is None else float(softmax_scale)
            kr = cupy.repeat(kc.astype(cupy.float32), nheads // nheads_kv, axis=2)
            s = cupy.einsum("bqhd,bkhd->bhqk", qc.astype(cupy.float32), kr) * scale
            if softcap > 0:
                s = softcap * cupy.tanh(s / softcap)
            if alibi_slopes is not None:
                slopes = arrays.to_cupy(alibi_slopes, arrays.describe(alibi_slopes, "alibi_slopes"))
                dist = cupy.abs(cupy.arange(sq)[:, None] + sk - sq - cupy.arange(sk)[None, :]).astype(cupy.float32)
                s = s - cupy.broadcast_to(slopes.reshape(-1, nheads), (batch, nheads))[:, :, None, None] * dist
            visible = _visible(sq, sk, causal, window_size)
            p = cupy.exp(s - lc[..., None])
            if visible is not None:
                p = cupy.where(cupy.asarray(visible), p, 0.0)
            keep = dropout_mask(batch, nheads, sq, sk, dropout_p, seed, offset, kernel_options=kernel_options)
            probs = cupy.where(keep, p / (1.0 - forward.realised_dropout_p(dropout_p)), 0.0).astype(cupy.float32)
            return arrays.from_cupy(probs, framework)


# --------------------------------------------------------------------------------------------- backward


class _Backward(_Attention):
    """flash_attn_backward. options: (softmax_scale, causal, window_size, deterministic, softcap, dropout_p);
    values: (dropout_seed, dropout_offset)."""

    name = "bwd"
    dropout_at = 5
    arrays = ("dout", "q", "k", "v", "out", "softmax_lse", "alibi_slopes", "dropout_rng_state")
    returned = poisoned = ("dq", "dk", "dv")
    head_dim_outputs = ("q", "q", "v")  # dq, dk, dv
    is_backward = True
    launch = staticmethod(backward.run_backward)
    no_pointers = backward.NO_POINTERS

    def check(self, infos, options, values):
        softmax_scale, causal, window_size, deterministic, softcap, dropout_p = options
        shape = checks.check_backward_args(
            *(infos[n] for n in self.arrays[:6]), softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            deterministic=deterministic, softcap=softcap, alibi_slopes=infos.get("alibi_slopes"), dropout_p=dropout_p)
        return _attention_call(infos, shape, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               values)

    def adapt(self, call, named, infos):
        ready = _ready_at_own_widths(call, ("dout", "q", "k", "v", "out"), lambda n: call.ready(named[n], infos[n], n))
        _adapt_side_arrays(call, named, infos, ready, ("softmax_lse", "alibi_slopes", "dropout_rng_state"))
        return ready

    def _gradient_shapes(self, call) -> tuple:
        s = call.shape
        return (s.batch, s.seqlen_q, s.nheads, call.padded), (s.batch, s.seqlen_k, s.nheads_kv, call.padded)

    def _strides(self, ready, call) -> dict:
        """The element strides of the inputs and the gradients, as plan_backward takes them."""
        strides = {n: elem_strides(ready[n]) for n in ("dout", "q", "k", "v", "out")}
        dq, dkv = self._gradient_shapes(call)
        strides.update(dq=pipeline.c_strides(dq), dk=pipeline.c_strides(dkv), dv=pipeline.c_strides(dkv))
        return strides

    def plan(self, call, ready, arch, device, options):
        q_shape, k_shape = self._plan_shapes(call, ready)
        return backward.plan_backward(
            q_shape, k_shape, self._strides(ready, call), call.shape.dtype, call.scale, call.causal,
            call.deterministic, arch, window_size=call.window_size, softcap=call.softcap,
            alibi_batch_stride=call.alibi_stride, varlen_totals=call.totals, dropout_p=call.dropout_p,
            options=options, width=call.kernel_width, headdim_v=ready["v"].shape[3] if call.own_widths else None)

    def _plan_shapes(self, call, ready) -> tuple:
        return ready["q"].shape, ready["k"].shape

    def allocations(self, call, plan):
        dtype = call.shape.dtype
        dq, dkv = self._gradient_shapes(call)
        layout = (("dq", dq, dtype), ("dk", dkv, dtype), ("dv", dkv, dtype), ("dsum", plan.dsum_shape, "float32"))
        if plan.dq_accum_shape is not None:  # the fp32 dQ accumulator (atomics only)
            layout += (("dq_accum", plan.dq_accum_shape, "float32"),)
        return layout

    def result(self, options):
        return _GRADIENTS


BACKWARD = _Backward()


def flash_attn_backward(
    dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
    softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None, *,
    kernel_options=None,
):
    """Gradients of ``flash_attn_func`` (FlashAttention-2 Algorithm 2) w.r.t. q, k and v.

    Runs on the inputs' device and the caller's current stream, as :func:`flash_attn_func`. This is the explicit
    backward for callers that keep their own graph; autograd users call :func:`fa2cupy.torch.flash_attn_func` or
    :func:`fa2cupy.jax.flash_attn_func`, whose backward it is.

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
            hence the last bits, can change between runs). True gives bit-identical results run to run: on the
            Hopper backward the key tiles add to each query tile's dQ in turns, in a fixed order (0.80-0.99x the
            speed of False on an H200); on the mma.sync backward a separate kernel computes dQ walking the key
            tiles in a fixed order, at the cost of recomputing Q K^T and dO V^T once more (two extra matmuls of
            the five).
        kernel_options: a :class:`fa2cupy.KernelOptions`, as for :func:`flash_attn_func`.

    Returns:
        ``(dq, dk, dv)`` in the inputs' framework and dtype; dq shaped like q, dk/dv like k/v (for MQA/GQA the
        gradient of each K/V head sums over the query heads that share it).

    Raises:
        TypeError / ValueError naming the offending argument.

    Example::

        out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        dq, dk, dv = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    """
    return pipeline.run(BACKWARD, (dout, q, k, v, out, softmax_lse, alibi_slopes, dropout_rng_state),
                        (softmax_scale, causal, window_size, deterministic, softcap, dropout_p),
                        (dropout_seed, dropout_offset), kernel_options)


# --------------------------------------------------------------------------------------------- varlen


def _varlen_view(x, info, call: _AttentionCall, name: str):
    """(total, heads, d) array -> kernel-ready (1, total, heads, call.padded) CuPy view (see kernel_ready; ``name``
    as for _AttentionCall.ready)."""
    return kernel_ready(arrays.to_cupy(x, info)[None], *call.dims(name))


def _varlen_strides(x) -> tuple:
    """Element strides of a (1, total, heads, d) view for the kernels: batch stride 0 (cu_seqlens give the rows)."""
    return (0,) + elem_strides(x)[1:]


def _packed_strides(heads: int, headdim: int) -> tuple:
    """The kernels' strides of a contiguous (total, heads, headdim) allocation."""
    return (0, heads * headdim, headdim, 1)


class _VarlenForward(_Forward):
    """flash_attn_varlen_func. options: (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
    softcap, deterministic, return_attn_probs); values: (dropout_seed, dropout_offset)."""

    name = "varlen_fwd"
    dropout_at = 2
    arrays = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "block_table", "dropout_rng_state")

    def check(self, infos, options, values):
        max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, probs = options
        shape, total_q, total_k = checks.check_varlen_args(
            *(infos[n] for n in self.arrays[:5]), max_q, max_k, dropout_p=dropout_p, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=infos.get("alibi_slopes"),
            deterministic=deterministic, return_attn_probs=probs, block_table=infos.get("block_table"))
        return _attention_call(infos, shape, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               values, (total_q, total_k))

    def adapt(self, call, named, infos):
        ready = {"q": _varlen_view(named["q"], infos["q"], call, "q")}
        if "block_table" in named:  # page pools: their page strides go where the batch strides go
            ready.update((n, call.ready(named[n], infos[n], n)) for n in ("k", "v"))
            call.paged = (ready["k"].shape[0], ready["k"].shape[1], infos["block_table"].shape[1])
        else:
            ready = _ready_at_own_widths(call, ("q", "k", "v"), lambda n: _varlen_view(named[n], infos[n], call, n),
                                         _varlen_strides)
        _fold_negative_scale(call, ready)
        _adapt_side_arrays(call, named, infos, ready, self.arrays[3:])
        return ready

    def plan(self, call, ready, arch, device, options):
        s, width = call.shape, call.dims("q")[1]  # (q's and k's head dim as made ready: padded, or own_widths' own)
        kv = ready["k"], ready["v"]
        kv_strides = tuple(map(elem_strides if call.paged else _varlen_strides, kv))
        return forward.plan_forward(
            (s.batch, s.seqlen_q, s.nheads, width), (s.batch, s.seqlen_k, s.nheads_kv, width),
            (_varlen_strides(ready["q"]),) + kv_strides + (_packed_strides(s.nheads, call.out_width),), s.dtype,
            call.scale, call.causal, arch, window_size=call.window_size, softcap=call.softcap,
            alibi_batch_stride=call.alibi_stride, varlen_totals=call.totals, dropout_p=call.dropout_p,
            paged=call.paged, options=options, width=call.kernel_width,
            headdim_v=ready["v"].shape[3] if call.own_widths else None)

    def allocations(self, call, plan):
        s, total_q = call.shape, call.totals[0]
        return (("out", (total_q, s.nheads, call.out_width), s.dtype),
                ("softmax_lse", (s.nheads, total_q), "float32"))


VARLEN_FORWARD = _VarlenForward()


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
    kernel_options=None,
):
    """Attention over packed sequences of different lengths, no padding work (flash-attn 2.x).

    Runs on the inputs' device and the caller's current stream, as :func:`flash_attn_func`; not differentiable
    (:func:`fa2cupy.torch.flash_attn_varlen_func`, :func:`fa2cupy.jax.flash_attn_varlen_func` are).

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_kv, headdim)`` (v's head dim may differ, as
            in :func:`flash_attn_func`, page pools included): the sequences' tokens one after another
            (dtypes, head grouping and layout rules as in :func:`flash_attn_func`).
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
        kernel_options: a :class:`fa2cupy.KernelOptions`, as for :func:`flash_attn_func`.

    Returns:
        ``out`` ``(total_q, nheads, headdim)``; with ``return_attn_probs`` ``(out, softmax_lse, None)``, lse float32
        ``(nheads, total_q)``. Rows past ``cu_seqlens_q[-1]`` are not written (as in flash-attn).

    Raises:
        TypeError / ValueError naming the argument. cu_seqlens values live on the GPU and are checked there: a
        sequence whose bounds do not fit the arrays or exceed max_seqlen is not computed, and a ValueError naming it
        is raised at the next call or at ``fa2cupy.check_device_errors()``.

    Example::

        cu = cupy.asarray([0, 100, 350], dtype=cupy.int32)  # two sequences: 100 and 250 tokens
        q, k, v = (cupy.random.randn(350, 8, 64).astype(cupy.float16) for _ in range(3))
        out = fa2cupy.flash_attn_varlen_func(q, k, v, cu, cu, 250, 250, causal=True)
    """
    device_errors.raise_pending()
    return pipeline.run(
        VARLEN_FORWARD, (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_table, dropout_rng_state),
        (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
         return_attn_probs),
        (dropout_seed, dropout_offset), kernel_options)


flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func = packed.make_varlen_packed(flash_attn_varlen_func)


def varlen_forward_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                            deterministic=False, block_table=None, *, dropout_seed=None, dropout_offset=0,
                            dropout_rng_state=None, kernel_options=None):
    """``(out, softmax_lse)`` of :func:`flash_attn_varlen_func` (same arguments): the autograd wrappers' forward."""
    device_errors.raise_pending()
    return pipeline.run(
        VARLEN_FORWARD, (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_table, dropout_rng_state),
        (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, True),
        (dropout_seed, dropout_offset), kernel_options)[:2]


class _VarlenBackward(_Backward):
    """flash_attn_varlen_backward over packed K/V. options: (max_seqlen_q, max_seqlen_k, softmax_scale, causal,
    window_size, deterministic, softcap, dropout_p); values: (dropout_seed, dropout_offset)."""

    name = "varlen_bwd"
    dropout_at = 7
    arrays = ("dout", "q", "k", "v", "out", "softmax_lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes",
              "dropout_rng_state")

    def check(self, infos, options, values):
        max_q, max_k, softmax_scale, causal, window_size, deterministic, softcap, dropout_p = options
        shape, total_q, total_k = checks.check_varlen_args(
            *(infos[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")), max_q, max_k,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=infos.get("alibi_slopes"), deterministic=deterministic, dropout_p=dropout_p,
            block_table=infos.get("block_table"))
        call = _attention_call(infos, shape, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               values, (total_q, total_k))
        checks.check_varlen_backward_args(infos["dout"], infos["out"], infos["softmax_lse"], infos["q"], shape.nheads,
                                          shape.dv)
        return call

    def adapt(self, call, named, infos):
        ready = _ready_at_own_widths(call, ("dout", "q", "k", "v", "out"),
                                     lambda n: _varlen_view(named[n], infos[n], call, n), _varlen_strides)
        _adapt_side_arrays(call, named, infos, ready,
                           ("softmax_lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "dropout_rng_state"))
        return ready

    def _gradient_shapes(self, call) -> tuple:
        s, (total_q, total_k) = call.shape, call.totals
        return (total_q, s.nheads, call.padded), (total_k, s.nheads_kv, call.padded)

    def _strides(self, ready, call):
        s, padded = call.shape, call.padded
        strides = {n: _varlen_strides(ready[n]) for n in ("dout", "q", "k", "v", "out")}
        strides.update(dq=_packed_strides(s.nheads, padded), dk=_packed_strides(s.nheads_kv, padded),
                       dv=_packed_strides(s.nheads_kv, padded))
        return strides

    def _plan_shapes(self, call, ready):
        s, width = call.shape, call.dims("q")[1]  # (q's and k's head dim as made ready)
        return (s.batch, s.seqlen_q, s.nheads, width), (s.batch, s.seqlen_k, s.nheads_kv, width)


VARLEN_BACKWARD = _VarlenBackward()


def _paged_varlen_backward(given: tuple, options: tuple, values: tuple, block_table, kernel_options):
    """flash_attn_varlen_backward with paged K/V: each sequence's keys are gathered from their pages into packed K/V
    of batch * max_seqlen_k rows (an upper bound on the keys, so no host synchronisation is needed to size them),
    the packed backward runs on them (through the pipeline: its plan is reused call after call), and dk/dv are
    summed back onto the pages (in float32: pages may be shared). ``given``, ``options``, ``values`` as
    VARLEN_BACKWARD takes them, with the page pools as k and v."""
    named = {n: x for n, x in zip(VARLEN_BACKWARD.arrays, given) if x is not None}
    named["block_table"] = block_table
    infos = VARLEN_BACKWARD.describe(named)
    call = VARLEN_BACKWARD.check(infos, options, values)  # (with block_table: the pages' rules)
    with cupy.cuda.Device(call.device):
        with arrays.caller_stream(call.framework, call.device):
            c = {n: arrays.to_cupy(x, infos[n]) for n, x in named.items()}
            k_pages, v_pages, table = c["k"], c["v"], c["block_table"]
            rows = max(1, table.shape[0] * int(options[1]))
            packed_cu_k, page, slot, inside = paging.key_pages(cupy, c["cu_seqlens_k"], table, rows,
                                                               k_pages.shape[1], k_pages.shape[0])
            c.update(k=paging.gather(cupy, k_pages, page, slot, inside),
                     v=paging.gather(cupy, v_pages, page, slot, inside), cu_seqlens_k=packed_cu_k)
            dq, dk, dv = pipeline.run(VARLEN_BACKWARD, tuple(c.get(n) for n in VARLEN_BACKWARD.arrays), options,
                                      values, kernel_options)
            grads = [dq] + [paging.sum_onto_pages(cupy, g, x.shape, page, slot, inside)
                            for g, x in ((dk, k_pages), (dv, v_pages))]
            return tuple(arrays.from_cupy(g, call.framework) for g in grads)


def flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
    causal=False, window_size=(-1, -1), deterministic=False, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
    dropout_seed=None, dropout_offset=0, dropout_rng_state=None, block_table=None, *, kernel_options=None,
):
    """Gradients of :func:`flash_attn_varlen_func` w.r.t. q, k and v.

    Runs on the inputs' device and the caller's current stream, as :func:`flash_attn_func`; the explicit backward
    (autograd users call :mod:`fa2cupy.torch` or :mod:`fa2cupy.jax`).

    Args:
        dout, out: ``(total_q, nheads, headdim)``; softmax_lse: float32 ``(nheads, total_q)`` as the forward
            returned it; the other arguments as given to the forward. ``deterministic`` as in
            :func:`flash_attn_backward`.
        block_table: as given to the forward (paged K/V). The pages the sequences use are gathered into packed
            K/V first (on the GPU, no host synchronisation), and dk/dv are summed back onto the pages.
        kernel_options: a :class:`fa2cupy.KernelOptions`, as for :func:`flash_attn_func`.

    Returns:
        ``(dq, dk, dv)`` shaped like q, k, v. Rows outside every sequence (past ``cu_seqlens[-1]``) are zero, so
        autograd wrappers can hand the gradients on as they are; with block_table, dk/dv are zero on every page row
        no sequence reads, and a page shared by several sequences gets the sum of their gradients.

    Example::

        out, lse, _ = fa2cupy.flash_attn_varlen_func(q, k, v, cu, cu, 250, 250, causal=True, return_attn_probs=True)
        dq, dk, dv = fa2cupy.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 250, 250, causal=True)
    """
    device_errors.raise_pending()
    given = (dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_rng_state)
    options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, deterministic, softcap, dropout_p)
    if block_table is not None:
        return _paged_varlen_backward(given, options, (dropout_seed, dropout_offset), block_table, kernel_options)
    return pipeline.run(VARLEN_BACKWARD, given, options, (dropout_seed, dropout_offset), kernel_options)


# --------------------------------------------------------------------------------------------- dropout mask


@dataclass
class _MaskCall(pipeline.Call):
    dims: tuple = ()  # (batch, nheads, seqlen_q, seqlen_k)
    dropout_p: float = 0.0


class _DropoutMask(pipeline.Kind):
    """dropout_mask. options: (batch, nheads, seqlen_q, seqlen_k, dropout_p); values: (seed, offset)."""

    name = "dropout_mask"
    returned = ("mask",)
    cacheable = False
    launch = staticmethod(forward.run_dropout_mask)

    def check(self, infos, options, values):
        for name, value in zip(("batch", "nheads", "seqlen_q", "seqlen_k"), options[:4]):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        batch, nheads, seqlen_q, _, dropout_p = options
        if seqlen_q > checks.MAX_GRID_YZ or batch * nheads > checks.MAX_GRID_YZ:
            raise ValueError(f"dropout_mask covers seqlen_q and batch * nheads up to {checks.MAX_GRID_YZ} each")
        p = checks._real(dropout_p, "dropout_p")
        if not 0.0 < p < 1.0:
            raise ValueError(f"dropout_p must be in (0, 1), got {dropout_p!r}")
        return _MaskCall("cupy", cupy.cuda.runtime.getDevice(), checks.check_dropout_rng(p, *values), options[:4], p)

    def adapt(self, call, named, infos):
        return {}

    def plan(self, call, ready, arch, device, options):
        return forward.plan_dropout_mask(*call.dims, call.dropout_p)

    def allocations(self, call, plan):
        return (("mask", call.dims, "uint8"),)

    def result(self, options):
        return lambda outs: outs[0].view(cupy.bool_)


DROPOUT_MASK = _DropoutMask()


def dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, dropout_seed, dropout_offset=0, *, kernel_options=None):
    """The dropout keep mask the kernels draw for these parameters: a CuPy bool array ``(batch, nheads, seqlen_q,
    seqlen_k)``, True where the score is kept, on the current device and CuPy's current stream. For tests and
    analysis at small sizes; the attention kernels never materialise it.

    Example::

        keep = fa2cupy.dropout_mask(2, 8, 128, 128, 0.1, dropout_seed=1234)  # ~90% True
    """
    return pipeline.run(DROPOUT_MASK, (), (batch, nheads, seqlen_q, seqlen_k, dropout_p),
                        (dropout_seed, dropout_offset), kernel_options)
