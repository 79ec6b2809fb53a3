"""PyTorch autograd wrapper: ``from fa2cupy.torch import flash_attn_func``.

The forward and backward are registered as PyTorch custom operators (``torch.library.custom_op``):

* ``torch.ops.fa2cupy.flash_attn_forward(q, k, v, softmax_scale, causal, window_left, window_right,
  deterministic, softcap, alibi_slopes, dropout_p, dropout_seed, dropout_offset, kernel_options) -> (out, lse)``,
  ``kernel_options`` an int standing for a :class:`fa2cupy.KernelOptions` (fa2cupy.options.handle; 0: defaults)
* ``torch.ops.fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, <the same options>) -> (dq, dk, dv)``
* ``torch.ops.fa2cupy.flash_attn_varlen_forward`` / ``flash_attn_varlen_backward``: the same for packed
  sequences, with ``cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k`` after q, k, v

each with a fake (meta) implementation, so they trace into ``torch.compile(fullgraph=True)`` graphs as single
opaque nodes, and the pair is tied together with ``torch.library.register_autograd``. The autograd context
keeps only ``q, k, v, out, lse`` (O(seqlen) memory besides the inputs; no attention probabilities): the
backward recomputes them tile by tile, as FlashAttention-2 does.

The op bodies hand the tensors to fa2cupy's forward (its ``(out, lse)`` entry point, which never builds attention
probabilities) and to :func:`fa2cupy.flash_attn_backward` directly: zero-copy, on torch's current stream, outputs
from torch's caching allocator, so the ops also work under ``torch.cuda.graph`` capture (after a warm-up call has
compiled the kernels).

This module imports torch; ``import fa2cupy`` does not import it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

import fa2cupy
from fa2cupy import attention, checks, options, packed

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
]


def _contiguous_last_axis(t: torch.Tensor) -> torch.Tensor:
    # fa2cupy reads any strides except a strided last axis; autograd can hand over e.g. an expanded
    # gradient (all strides 0) for ``out.sum()``.
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------- forward op


@torch.library.custom_op("fa2cupy::flash_attn_forward", mutates_args=())
def _flash_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, deterministic: bool, softcap: float, alibi_slopes: Optional[torch.Tensor], dropout_p: float,
    dropout_seed: int, dropout_offset: int, kernel_options: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """out ``(b, sq, h, d_v)`` (v's head dim) contiguous in q's dtype and lse ``(b, h, sq)`` float32.
    ``deterministic`` is only carried to the backward (the forward is always deterministic). ``kernel_options``: a
    KernelOptions' handle (fa2cupy.options.handle; 0 is the defaults)."""
    # detach(): the autograd wrapper already handles the graph; plain tensors take fa2cupy's cached fast path.
    # forward_with_lse: (out, lse) only, never the seqlen^2 probabilities (with dropout the generic
    # flash_attn_func(return_attn_probs=True) builds them for its callers).
    out, lse = attention.forward_with_lse(
        q.detach(), k.detach(), v.detach(), dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        dropout_seed=_unsigned(dropout_seed), dropout_offset=_unsigned(dropout_offset),
        kernel_options=options.from_handle(kernel_options)
    )
    # Odd head dims come back as a slice of a padded buffer; the fake implementation promises contiguous.
    return out.contiguous(), lse


@_flash_attn_forward.register_fake
def _flash_attn_forward_fake(q, k, v, softmax_scale, causal, window_left, window_right, deterministic, softcap,
                             alibi_slopes, dropout_p, dropout_seed, dropout_offset, kernel_options):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))  # (v's head dim)
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse


# --------------------------------------------------------------------------------------------- backward op


@torch.library.custom_op("fa2cupy::flash_attn_backward", mutates_args=())
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
    softcap: float,
    dropout_p: float,
    dropout_seed: int,
    dropout_offset: int,
    alibi_slopes: Optional[torch.Tensor],
    kernel_options: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv: contiguous, shaped and typed like q, k, v."""
    dq, dk, dv = fa2cupy.flash_attn_backward(
        _contiguous_last_axis(dout.detach()),
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse.detach(),
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=(window_left, window_right),
        deterministic=deterministic,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout_p,
        dropout_seed=_unsigned(dropout_seed),
        dropout_offset=_unsigned(dropout_offset),
        kernel_options=options.from_handle(kernel_options),
    )
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_flash_attn_backward.register_fake
def _flash_attn_backward_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                              deterministic, softcap, dropout_p, dropout_seed, dropout_offset, alibi_slopes,
                              kernel_options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --------------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, window_left, window_right, deterministic, softcap, alibi_slopes, dropout_p,
     dropout_seed, dropout_offset, kernel_options) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # nothing else: O(seqlen) memory on top of q, k, v, out
    ctx.alibi_slopes, ctx.kernel_options = alibi_slopes, kernel_options  # (the slopes: not differentiated)
    # The backward regenerates the forward's dropout mask from the same seed and offset.
    ctx.options = (softmax_scale, causal, window_left, window_right, deterministic, softcap, dropout_p, dropout_seed,
                   dropout_offset)
    # lse is an auxiliary output (as in flash-attn): no gradient flows through it.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    del dlse  # lse is non-differentiable
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attn_backward(dout, q, k, v, out, lse, *ctx.options, ctx.alibi_slopes, ctx.kernel_options)
    return (dq, dk, dv) + (None,) * 11


torch.library.register_autograd("fa2cupy::flash_attn_forward", _backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------- public API


def _unsigned(x: int) -> int:
    """A 64-bit seed or offset carried through an op as a signed int64, back to [0, 2**64)."""
    return int(x) & 0xFFFFFFFFFFFFFFFF


@torch.compiler.assume_constant_result
def _interned_handle(kernel_options) -> int:
    return options.handle(kernel_options)


def _options_handle(kernel_options) -> int:
    """:func:`fa2cupy.options.handle` in a form torch.compile traces without a graph break: None (the defaults) is 0
    outright, and a KernelOptions is looked up once, while tracing (its handle is a constant of the graph)."""
    return 0 if kernel_options is None else _interned_handle(kernel_options)


def _draw_dropout_rng(device: torch.device) -> tuple[int, int]:
    """(seed, offset) for one dropout call from torch's default CUDA generator of ``device``, advancing its offset
    (as torch's own dropout does), so torch.manual_seed makes fa2cupy's dropout reproducible. Signed int64s."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    state = gen.get_state()  # the Philox seed and offset, two int64s
    seed, offset = (int(x) for x in state.view(torch.int64)[:2])
    state.view(torch.int64)[1] = offset + 4
    gen.set_state(state)
    return seed, offset


def _reject_unsupported(dropout_p, window_size, softcap, alibi_slopes) -> float:
    # The same rules and messages as fa2cupy.checks.check_forward_args, checked before any op is traced or run
    # (the ops only take the supported arguments). The common spellings skip the helpers. Returns dropout_p.
    p = 0.0
    if not (type(dropout_p) is float and dropout_p == 0.0):
        p = checks._real(dropout_p, "dropout_p")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if not (type(window_size) is tuple and window_size == (-1, -1)):
        checks._check_window(window_size)
    if not (type(softcap) is float and softcap == 0.0):
        cap = checks._real(softcap, "softcap")
        if not (math.isfinite(cap) and cap >= 0.0):
            raise ValueError(f"softcap must be a finite number >= 0, got {softcap!r}")
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 torch.Tensor (nheads,) or (batch, nheads), got "
                        f"{type(alibi_slopes).__name__}")
    return p


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
    kernel_options=None,
):
    """Differentiable FlashAttention-2 on PyTorch CUDA tensors, flash-attn 2.x compatible.

    Same arguments and results as :func:`fa2cupy.flash_attn_func`; gradients flow to ``q``, ``k`` and ``v``
    (``loss.backward()``, ``torch.autograd.grad``). Works eagerly, inside ``torch.compile`` (no graph
    break: the forward and backward are custom ops) and under ``torch.cuda.graph`` capture.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``; k, v: ``(batch, seqlen_k, nheads_kv, headdim)`` (v's head dim
            may differ: the output takes it); float16 or bfloat16 CUDA tensors, last axis contiguous (other axes
            may be strided).
        softmax_scale: default ``1 / sqrt(headdim)``.
        causal: bottom-right aligned causal mask.
        deterministic: make the backward bit-reproducible run to run (the forward always is).
        window_size: sliding window ``(left, right)``, as in :func:`fa2cupy.flash_attn_func`.
        softcap, alibi_slopes: as in :func:`fa2cupy.flash_attn_func` (no gradient flows to the slopes).
        dropout_p: dropout on the attention probabilities, with the seed and offset drawn from torch's CUDA
            generator (``torch.manual_seed`` reproduces it); the backward regenerates the same mask.
        return_attn_probs: also return ``softmax_lse`` (see Returns).
        kernel_options: a :class:`fa2cupy.KernelOptions` for the forward and the backward (None: the defaults).

    Returns:
        ``out`` like q with v's head dim; with ``return_attn_probs=True``, ``(out, softmax_lse, None)`` with
        ``softmax_lse`` float32 ``(batch, nheads, seqlen_q)``, which is not differentiable (as in flash-attn).

    Runs on the tensors' device and torch's current stream, the backward too.

    Example::

        q, k, v = (torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        fa2cupy.torch.flash_attn_func(q, k, v, causal=True).sum().backward()  # q.grad, k.grad, v.grad
    """
    p = _reject_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    if causal is not True and causal is not False:
        checks._check_bool(causal, "causal")
    if deterministic is not True and deterministic is not False:
        checks._check_bool(deterministic, "deterministic")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(int(q.shape[-1]))
    left, right = (int(w) for w in window_size)
    seed, offset = _draw_dropout_rng(q.device) if p > 0 else (0, 0)
    out, lse = _flash_attn_forward(q, k, v, float(softmax_scale), bool(causal), left, right, bool(deterministic),
                                   float(softcap), alibi_slopes, p, seed, offset, _options_handle(kernel_options))
    if return_attn_probs:
        return out, lse, None
    return out


flash_attn_qkvpacked_func, flash_attn_kvpacked_func = packed.make_packed(flash_attn_func)


# --------------------------------------------------------------------------------------------- varlen


@torch.library.custom_op("fa2cupy::flash_attn_varlen_forward", mutates_args=())
def _flash_attn_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    deterministic: bool, softcap: float, alibi_slopes: Optional[torch.Tensor], dropout_p: float, dropout_seed: int,
    dropout_offset: int, block_table: Optional[torch.Tensor], kernel_options: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """out ``(total_q, h, d_v)`` (v's head dim) contiguous and lse ``(h, total_q)`` float32."""
    out, lse = attention.varlen_forward_with_lse(
        q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_seed=_unsigned(dropout_seed),
        dropout_offset=_unsigned(dropout_offset), block_table=block_table,
        kernel_options=options.from_handle(kernel_options))
    return out.contiguous(), lse


@_flash_attn_varlen_forward.register_fake
def _flash_attn_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                    causal, window_left, window_right, deterministic, softcap, alibi_slopes,
                                    dropout_p, dropout_seed, dropout_offset, block_table, kernel_options):
    total, h, _ = q.shape
    return q.new_empty((total, h, v.shape[-1])), q.new_empty((h, total), dtype=torch.float32)


@torch.library.custom_op("fa2cupy::flash_attn_varlen_backward", mutates_args=())
def _flash_attn_varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, deterministic: bool, softcap: float,
    dropout_p: float, dropout_seed: int, dropout_offset: int, alibi_slopes: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], kernel_options: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv like q, k, v (rows outside every sequence are zero: fa2cupy.flash_attn_varlen_backward)."""
    dq, dk, dv = fa2cupy.flash_attn_varlen_backward(
        _contiguous_last_axis(dout.detach()), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), deterministic=deterministic, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=_unsigned(dropout_seed),
        dropout_offset=_unsigned(dropout_offset), block_table=block_table,
        kernel_options=options.from_handle(kernel_options))
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_flash_attn_varlen_backward.register_fake
def _flash_attn_varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale, causal, window_left, window_right, deterministic, softcap,
                                     dropout_p, dropout_seed, dropout_offset, alibi_slopes, block_table,
                                     kernel_options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_varlen_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left, window_right, deterministic, softcap,
     alibi_slopes, dropout_p, dropout_seed, dropout_offset, block_table, kernel_options) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.alibi_slopes, ctx.block_table, ctx.kernel_options = alibi_slopes, block_table, kernel_options
    ctx.options = (max_q, max_k, softmax_scale, causal, window_left, window_right, deterministic, softcap, dropout_p,
                   dropout_seed, dropout_offset)
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, dlse):
    del dlse
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.options, ctx.alibi_slopes,
                                             ctx.block_table, ctx.kernel_options)
    return (dq, dk, dv) + (None,) * 16


torch.library.register_autograd("fa2cupy::flash_attn_varlen_forward", _varlen_backward,
                                setup_context=_setup_varlen_context)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None, *, kernel_options=None,
):
    """Differentiable :func:`fa2cupy.flash_attn_varlen_func` on PyTorch CUDA tensors (same arguments and results,
    ``kernel_options`` as for :func:`flash_attn_func`); gradients flow to q, k and v (with block_table, to the page
    pools k and v)."""
    p = _reject_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    if causal is not True and causal is not False:
        checks._check_bool(causal, "causal")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(int(q.shape[-1]))
    left, right = (int(w) for w in window_size)
    seed, offset = _draw_dropout_rng(q.device) if p > 0 else (0, 0)
    out, lse = _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                          float(softmax_scale), bool(causal), left, right, bool(deterministic),
                                          float(softcap), alibi_slopes, p, seed, offset, block_table,
                                          _options_handle(kernel_options))
    if return_attn_probs:
        return out, lse, None
    return out


flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func = packed.make_varlen_packed(flash_attn_varlen_func)
