"""fa2cupy as the flash-attention implementation of ``torch.nn.functional.scaled_dot_product_attention``.

Importing this module registers the name ``"fa2cupy"`` with torch's flash-attention registry
(``torch.nn.attention.register_flash_attention_impl``); it changes nothing else. The user opts in with::

    import fa2cupy.integrations.torch_sdpa
    torch.nn.attention.activate_flash_attention_impl("fa2cupy")

From then on the CUDA kernels of the aten flash-attention ops are fa2cupy's, so SDPA on its flash backend, and what
is built on these ops (``torch.nn.attention.varlen``, ``context_parallel``'s ring attention), run fa2cupy's forward
and backward, eagerly and under ``torch.compile`` (inductor calls the aten ops at run time; their fake
implementations stay torch's, so the outputs here follow torch's meta functions' shapes, dtypes and strides).
``torch.nn.attention.restore_flash_attention_impl()`` gives the ops back to torch's own kernels.

The ops overridden (each only where the installed torch has it) and what fa2cupy does with their arguments:

* ``_scaled_dot_product_flash_attention`` / ``..._backward``: SDPA's ``(batch, heads, seq, dim)`` tensors, seen as
  fa2cupy's ``(batch, seq, heads, dim)`` through ``transpose(1, 2)`` (no copy: fa2cupy reads any strides but the
  last axis'); key/value may have fewer heads (SDPA's ``enable_gqa``).
* ``_flash_attention_forward`` / ``_flash_attention_backward``: dense ``(batch, seq, heads, dim)`` tensors, or with
  ``cum_seq_q`` packed ``(total, heads, dim)`` ones (fa2cupy's varlen functions; ``block_table`` with
  ``seqused_k``: paged keys and values, forward only, as in torch).
* ``_flash_attention_forward_no_dropout_inplace``: the same forward, written into the caller's ``out``.

``scale`` (None: ``1/sqrt(dim)``), ``is_causal`` (bottom-right aligned, as torch's flash kernel), the window sizes
(None or -1: unbounded) and ``alibi_slopes`` map onto fa2cupy's arguments of the same meaning. The log-sum-exp is
fa2cupy's: float32, natural log, ``(batch, heads, seq_q)`` dense and ``(heads, total_q)`` packed, unpadded, as
torch's flash kernel returns it. Dropout draws a Philox seed and offset from torch's CUDA generator
(``torch.manual_seed`` reproduces it); they travel to the backward in the ``rng_state`` output, a uint64 ``(2,)``
device tensor {seed, offset}, which is the uint32 ``(4,)`` {seed lo, seed hi, offset lo, offset hi} fa2cupy's
``dropout_rng_state`` reads: the backward regenerates the forward's mask without a host synchronisation. The mask is
fa2cupy's (its realised ``p`` is a multiple of 1/256), not bit-for-bit the one torch's kernel would draw.

Refused with an error that names the feature: attention probabilities (``return_debug_mask=True``),
``seqused_k`` without ``block_table``, dropout while a CUDA graph is being captured (the seed is drawn on the
host), tensors that are not float16/bfloat16 CUDA tensors; fa2cupy's own checks
name any other argument it cannot take (e.g. a head dim above 256). ``num_splits`` is a scheduling hint that fa2cupy
has no use for: its varlen forward never splits a row's keys, so results never depend on the batch's composition.
"""

from __future__ import annotations

import warnings

import torch

if not hasattr(getattr(torch.nn, "attention", None), "register_flash_attention_impl"):
    raise ImportError(
        f"fa2cupy.integrations.torch_sdpa needs torch >= 2.11 (torch.nn.attention.register_flash_attention_impl); "
        f"torch {torch.__version__} is installed")

import fa2cupy  # noqa: E402
from fa2cupy import attention  # noqa: E402

__all__ = ["IMPL_NAME", "register"]

#: The name under which the implementation is registered with torch.
IMPL_NAME = "fa2cupy"

#: The fa2cupy.KernelOptions every call passes (None: fa2cupy's defaults); the GPU tests set debug_poison here.
_KERNEL_OPTIONS = None

#: What to do instead, appended to the errors for what fa2cupy cannot compute.
_ALTERNATIVE = ("use another SDPA backend (torch.nn.attention.sdpa_kernel) or give the flash backend back to torch's "
                "kernel with torch.nn.attention.restore_flash_attention_impl()")


class _Handle:
    """Keeps the aten kernels registered; ``remove()`` unregisters them, so the dispatcher runs torch's own kernels
    again."""

    def __init__(self, library: torch.library.Library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _implementations() -> dict:
    """aten op name -> its fa2cupy implementation."""
    return {
        "_scaled_dot_product_flash_attention": sdpa_flash_forward,
        "_scaled_dot_product_flash_attention_backward": sdpa_flash_backward,
        "_flash_attention_forward": flash_attention_forward,
        "_flash_attention_forward_no_dropout_inplace": flash_attention_forward_no_dropout_inplace,
        "_flash_attention_backward": flash_attention_backward,
    }


def overridden_ops() -> dict:
    """aten op name -> its fa2cupy implementation, for the ops the installed torch has (older releases lack
    ``_flash_attention_forward_no_dropout_inplace``)."""
    return {name: fn for name, fn in _implementations().items() if hasattr(torch.ops.aten, name)}


def register() -> _Handle:
    """The registry's ``register_fn``: puts fa2cupy's kernels on the CUDA dispatch key of the aten flash-attention
    ops (their default overloads: the fp8 ``quantized`` ones stay torch's) and returns the handle whose
    ``remove()`` takes them off again."""
    library = torch.library.Library("aten", "IMPL", "CUDA")
    with warnings.catch_warnings():
        # Overriding torch's CUDA kernel is the point; the dispatcher's warning about it is not news to the user.
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*previously registered kernel")
        for name, fn in overridden_ops().items():
            library.impl(name, fn, "CUDA")
    return _Handle(library)


# ---------------------------------------------------------------------------------------------- helpers


def _check_inputs(op: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{op}: fa2cupy computes flash attention in float16 or bfloat16 only, got {t.dtype}; "
                            f"{_ALTERNATIVE}")
        if t.device.type != "cuda":
            raise ValueError(f"{op}: fa2cupy needs CUDA tensors, got one on {t.device}; {_ALTERNATIVE}")


def _window(left, right) -> tuple[int, int]:
    """aten's window sizes (None or -1: no limit) as fa2cupy's ``window_size``."""
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def _unsigned(x: int) -> int:
    return int(x) & 0xFFFFFFFFFFFFFFFF


def _draw_dropout(device: torch.device) -> tuple[int, int, torch.Tensor]:
    """(seed, offset, rng_state) of one dropout call: the Philox seed and offset drawn from torch's CUDA generator
    (advancing it, as fa2cupy.torch does), and the same two as aten's uint64 ``(2,)`` rng_state on ``device``."""
    from fa2cupy.torch import _draw_dropout_rng

    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError(
            "fa2cupy's SDPA dropout draws its seed and offset on the host, which a CUDA graph would freeze into every "
            f"replay; capture without dropout, or {_ALTERNATIVE}")
    seed, offset = _draw_dropout_rng(device)
    # int64 on the way over (the host-to-device copy of every dtype), seen as aten's uint64 there
    state = torch.tensor([seed, offset], dtype=torch.int64, device=device).view(torch.uint64)
    return _unsigned(seed), _unsigned(offset), state


def _rng_outputs(device: torch.device, dropout_p: float) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """fa2cupy's dropout arguments for a forward, and aten's (rng_state, unused) outputs."""
    unused = torch.empty((), dtype=torch.uint64, device=device)
    if dropout_p > 0:
        seed, offset, state = _draw_dropout(device)
        return dict(dropout_p=dropout_p, dropout_seed=seed, dropout_offset=offset), state, unused
    return dict(dropout_p=0.0), torch.zeros((2,), dtype=torch.uint64, device=device), unused


def _backward_dropout(dropout_p: float, rng_state: torch.Tensor) -> dict:
    """fa2cupy's dropout arguments for a backward: the forward's seed and offset read on the GPU from rng_state."""
    if not dropout_p > 0:
        return dict(dropout_p=0.0)
    if rng_state is None or rng_state.dtype != torch.uint64 or tuple(rng_state.shape) != (2,):
        raise ValueError("a backward with dropout needs the rng_state its fa2cupy forward returned (uint64 (2,)); "
                         f"got {None if rng_state is None else (rng_state.dtype, tuple(rng_state.shape))}")
    return dict(dropout_p=float(dropout_p), dropout_rng_state=rng_state.view(torch.uint32))


def _refuse_debug_mask(op: str, return_debug_mask: bool) -> None:
    if return_debug_mask:
        raise NotImplementedError(
            f"{op}: fa2cupy never materialises the attention probabilities (return_debug_mask=True); compute them "
            f"with the math backend (torch.nn.attention.sdpa_kernel(SDPBackend.MATH)), or call "
            f"fa2cupy.flash_attn_func(..., return_attn_probs=True) at small sizes")


def _laid_out_like(result: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``result`` with the strides of ``torch.empty_like(template)``, which torch's meta functions promise for these
    ops' outputs (compiled graphs index them with those strides); copied only where fa2cupy's layout differs."""
    want = torch.empty_like(template, device="meta").stride()
    if result.stride() == want or result.numel() <= 1:
        return result
    laid = torch.empty_like(template)
    laid.copy_(result)
    return laid


def _empty_debug_mask(query: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=query.dtype, device=query.device)


# ---------------------------------------------------------------------------------------------- forward


def _forward(op, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
             scale, window_size_left, window_size_right, seqused_k, alibi_slopes, block_table):
    """(out laid out like query, lse, rng_state, unused): the shared body of the forward ops."""
    _refuse_debug_mask(op, return_debug_mask)
    _check_inputs(op, query, key, value)
    dropout, rng_state, unused = _rng_outputs(query.device, float(dropout_p))
    common = dict(softmax_scale=None if scale is None else float(scale), causal=bool(is_causal),
                  window_size=_window(window_size_left, window_size_right), alibi_slopes=alibi_slopes,
                  deterministic=False, kernel_options=_KERNEL_OPTIONS, **dropout)
    if cum_seq_q is None:
        if cum_seq_k is not None or block_table is not None or seqused_k is not None:
            raise ValueError(f"{op}: cum_seq_k, block_table and seqused_k need cum_seq_q (the packed varlen form)")
        out, lse = attention.forward_with_lse(query, key, value, **common)
    else:
        if block_table is not None:
            if seqused_k is None:
                raise ValueError(f"{op}: block_table needs seqused_k, the number of keys of each sequence")
            # fa2cupy counts the keys of paged sequence b as cu_seqlens_k[b + 1] - cu_seqlens_k[b].
            cum_seq_k = torch.nn.functional.pad(torch.cumsum(seqused_k, 0, dtype=torch.int32), (1, 0))
        elif seqused_k is not None:
            raise NotImplementedError(
                f"{op}: fa2cupy has no seqused_k for packed (non-paged) keys; pack only the used keys into "
                f"cum_seq_k, pass block_table with seqused_k, or {_ALTERNATIVE}")
        if cum_seq_k is None:
            raise ValueError(f"{op}: packed queries (cum_seq_q) need cum_seq_k, or block_table with seqused_k")
        out, lse = attention.varlen_forward_with_lse(query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k),
                                                     block_table=block_table, **common)
    return _laid_out_like(out, query), lse, rng_state, unused


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """``aten::_flash_attention_forward`` -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)."""
    del num_splits  # a scheduling hint: fa2cupy's varlen forward never splits a row's keys
    out, lse, rng_state, unused = _forward(
        "_flash_attention_forward", query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes, block_table)
    return out, lse, rng_state, unused, _empty_debug_mask(query)


def flash_attention_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                               is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                                               window_size_right=None, seqused_k=None, alibi_slopes=None,
                                               block_table=None, num_splits=None):
    """``aten::_flash_attention_forward_no_dropout_inplace``: the forward written into ``out``; -> logsumexp."""
    del num_splits
    op = "_flash_attention_forward_no_dropout_inplace"
    if dropout_p != 0:
        raise ValueError(f"{op} takes no dropout, got dropout_p={dropout_p!r}")
    result, lse, _, _ = _forward(op, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, is_causal,
                                 return_debug_mask, scale, window_size_left, window_size_right, seqused_k,
                                 alibi_slopes, block_table)
    out.copy_(result)
    return lse


def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention`` on ``(batch, heads, seq, dim)`` tensors -> (output, logsumexp,
    cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)."""
    out, lse, rng_state, unused = _forward(
        "_scaled_dot_product_flash_attention", query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        None, None, query.size(2), key.size(2), dropout_p, is_causal, return_debug_mask, scale, None, None, None,
        None, None)
    return (out.transpose(1, 2), lse, None, None, query.size(2), key.size(2), rng_state, unused,
            _empty_debug_mask(query))


# ---------------------------------------------------------------------------------------------- backward


def _backward(op, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
              is_causal, rng_state, scale, window_size_left, window_size_right):
    """(dq, dk, dv) laid out like query, key, value: the shared body of the backward ops."""
    _check_inputs(op, grad_out, query, key, value, out)
    common = dict(softmax_scale=None if scale is None else float(scale), causal=bool(is_causal),
                  window_size=_window(window_size_left, window_size_right),
                  deterministic=torch.are_deterministic_algorithms_enabled(), kernel_options=_KERNEL_OPTIONS,
                  **_backward_dropout(float(dropout_p), rng_state))
    if grad_out.stride(-1) != 1:  # e.g. the expanded gradient of out.sum(): fa2cupy needs a contiguous last axis
        grad_out = grad_out.contiguous()
    if cum_seq_q is None:
        grads = fa2cupy.flash_attn_backward(grad_out, query, key, value, out, logsumexp, **common)
    else:
        grads = fa2cupy.flash_attn_varlen_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                                   int(max_q), int(max_k), **common)
    return tuple(_laid_out_like(g, x) for g, x in zip(grads, (query, key, value)))


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                             window_size_right=None):
    """``aten::_flash_attention_backward`` -> (grad_query, grad_key, grad_value)."""
    del unused
    return _backward("_flash_attention_backward", grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                     max_q, max_k, dropout_p, is_causal, rng_state, scale, window_size_left, window_size_right)


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, philox_seed, philox_offset, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention_backward`` on ``(batch, heads, seq, dim)`` tensors -> (grad_query,
    grad_key, grad_value). ``philox_seed`` is the forward's rng_state."""
    del philox_offset, cum_seq_q, cum_seq_k  # the offset rides in rng_state; SDPA's tensors are dense
    t = [x.transpose(1, 2) for x in (grad_out, query, key, value, out)]
    dq, dk, dv = _backward("_scaled_dot_product_flash_attention_backward", *t, logsumexp, None, None, max_q, max_k,
                           dropout_p, is_causal, philox_seed, scale, None, None)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


torch.nn.attention.register_flash_attention_impl(IMPL_NAME, register_fn=register)
