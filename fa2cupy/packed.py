"""flash-attn's packed-input forms, ``flash_attn_qkvpacked_func`` and ``flash_attn_kvpacked_func``, built on any
``flash_attn_func`` with the flash-attn 2.x signature (fa2cupy's own, and the torch and JAX wrappers'): the
packed array is split into views along its "which tensor" axis (no copies for CuPy, PyTorch and NumPy; the
kernels take the strides as they are), so gradients in the wrappers flow back into the packed array. Extra
keyword arguments (fa2cupy's ``dropout_seed`` / ``dropout_offset`` / ``kernel_options``) pass through.
"""

from __future__ import annotations


def split(x, name: str, count: int):
    """``count`` views ``x[:, :, i]`` of ``x`` shaped ``(batch, seqlen, count, nheads, headdim)``."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 5 or shape[2] != count:
        what = "(batch, seqlen, 3, nheads, headdim)" if count == 3 else "(batch, seqlen_k, 2, nheads_k, headdim)"
        raise ValueError(f"{name} must be {what}, got shape {shape}")
    return tuple(x[:, :, i] for i in range(count))


def split_varlen(x, name: str, count: int):
    """``count`` views ``x[:, i]`` of ``x`` shaped ``(total_tokens, count, nheads, headdim)``."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 4 or shape[1] != count:
        what = "(total, 3, nheads, headdim)" if count == 3 else "(total_k, 2, nheads_k, headdim)"
        raise ValueError(f"{name} must be {what}, got shape {shape}")
    return tuple(x[:, i] for i in range(count))


def make_packed(flash_attn_func):
    """(flash_attn_qkvpacked_func, flash_attn_kvpacked_func) calling ``flash_attn_func``."""

    def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                  **dropout_rng):
        """Attention with q, k and v packed in one array ``qkv`` ``(batch, seqlen, 3, nheads, headdim)``
        (self-attention, flash-attn 2.x). Otherwise as ``flash_attn_func`` (device, stream and the other arguments);
        gradients (in the torch and JAX wrappers) flow into ``qkv``.

        Example::

            out = flash_attn_qkvpacked_func(qkv, causal=True)  # qkv: (2, 1024, 3, 8, 64)
        """
        q, k, v = split(qkv, "qkv", 3)
        return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                               deterministic=deterministic, return_attn_probs=return_attn_probs, **dropout_rng)

    def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                 **dropout_rng):
        """Attention with k and v packed in ``kv`` ``(batch, seqlen_k, 2, nheads_k, headdim)`` (flash-attn 2.x);
        q ``(batch, seqlen_q, nheads, headdim)``. Otherwise as ``flash_attn_func`` (device, stream and the other
        arguments).

        Example::

            out = flash_attn_kvpacked_func(q, kv, causal=True)  # q: (2, 1024, 8, 64), kv: (2, 4096, 2, 2, 64)
        """
        k, v = split(kv, "kv", 2)
        return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                               deterministic=deterministic, return_attn_probs=return_attn_probs, **dropout_rng)

    return flash_attn_qkvpacked_func, flash_attn_kvpacked_func


def make_varlen_packed(flash_attn_varlen_func):
    """(flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func) calling ``flash_attn_varlen_func``."""

    def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False, **dropout_rng):
        """Varlen attention with q, k and v packed in ``qkv`` ``(total, 3, nheads, headdim)`` and one
        ``cu_seqlens`` for queries and keys (flash-attn 2.x). Otherwise as ``flash_attn_varlen_func`` (device,
        stream and the other arguments).

        Example::

            out = flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, 250, causal=True)  # qkv: (350, 3, 8, 64)
        """
        q, k, v = split_varlen(qkv, "qkv", 3)
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout_p,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                      return_attn_probs=return_attn_probs, **dropout_rng)

    def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                        alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                        **dropout_rng):
        """Varlen attention with k and v packed in ``kv`` ``(total_k, 2, nheads_k, headdim)`` (flash-attn 2.x);
        q ``(total_q, nheads, headdim)``. Otherwise as ``flash_attn_varlen_func`` (device, stream and the other
        arguments).

        Example::

            out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 250, 300)  # q: (350, 8, 64), kv: (420, 2, 2, 64)
        """
        k, v = split_varlen(kv, "kv", 2)
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                      deterministic=deterministic, return_attn_probs=return_attn_probs, **dropout_rng)

    return flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func
