"""fa2cupy as a Hugging Face transformers attention implementation::

    import fa2cupy.integrations.transformers  # registers "fa2cupy"
    model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16, attn_implementation="fa2cupy")

Importing this module registers two functions under the name ``"fa2cupy"`` through transformers' public interfaces
(nothing of transformers is patched):

* :func:`fa2cupy_attention_forward` in ``transformers.AttentionInterface``: the attention itself, called by every
  attention layer with ``(batch, heads, seq, dim)`` query, key and value. It takes them zero-copy (the
  ``transpose(1, 2)`` views are what :func:`fa2cupy.torch.flash_attn_func` reads) and calls fa2cupy.torch's kernels:
  the dense one when nothing is padded, the varlen one on the unpadded tokens otherwise (padding masks, packed
  sequences), with the output re-padded with zeros.
* :func:`fa2cupy_mask` in ``transformers.AttentionMaskInterface``: what the models build as "the attention mask" for
  this implementation. Not a (batch, 1, q, kv) matrix: a boolean ``(batch, kv_length)`` mask of the key slots that
  hold tokens (padding and a static cache's unwritten tail are False), or None when every slot does. Causality,
  sliding windows and packed-sequence boundaries are not in it: the kernels apply those from the arguments.

Continuous batching (``model.generate_batch``, transformers' paged cache) runs on fa2cupy's paged varlen kernel
reading transformers' page pools in place, on transformers 5.0-5.18: those switch the model to
``"paged|fa2cupy"`` (:func:`fa2cupy_paged_attention_forward`, also registered here). From 5.19 on, transformers'
continuous batching accepts only its own implementations and hub kernels and refuses ``"fa2cupy"`` with a
ValueError of its own.

Supported: causal and bidirectional attention, GQA/MQA, the module's ``scaling``, right- and left-padded batches,
KV caches (dynamic, static, sliding-window), decoding (one query per sequence against a longer cache, bottom-right
aligned), sliding windows, softcap, attention dropout in training, packed sequences given as ``position_ids``
(batch 1, no mask) or as ``cu_seq_lens_q/k`` + ``max_length_q/k`` keyword arguments, and float32 inputs under
autocast (cast to the autocast dtype). Rejected with an error that names the feature and the alternative: an
arbitrary (additive or 4-D) attention mask, ``output_attentions=True``, attention sinks (``s_aux``), position
biases, mask overlays a model adds to the causal mask (``or_mask_function``/``and_mask_function``, e.g. bidirectional
image tokens) and continuous batching's decode fast path (flash-attn's ``flash_attn_with_kvcache`` with a
``block_table``, which transformers offers only to flash_attention_* implementations).
"""

from __future__ import annotations

import math

try:
    import torch
    import transformers
    from transformers import AttentionInterface, AttentionMaskInterface
except ImportError as exc:  # one line naming the extra
    raise ImportError(
        f"fa2cupy.integrations.transformers needs torch and transformers>=5: pip install 'fa2cupy[transformers]' "
        f"({exc})"
    ) from None

import fa2cupy.torch as fa_torch

__all__ = ["NAME", "PAGED_NAME", "fa2cupy_attention_forward", "fa2cupy_mask", "fa2cupy_paged_attention_forward",
           "sliding_window_to_window_size"]

#: The ``attn_implementation`` name this module registers.
NAME = "fa2cupy"
#: The name transformers 5.0-5.18 switch a model to for continuous batching (``generate_batch``).
PAGED_NAME = "paged|" + NAME

_SDPA_HINT = 'use attn_implementation="sdpa" (or "eager") for this model or call'


def _unsupported(feature: str, alternative: str = _SDPA_HINT) -> NotImplementedError:
    return NotImplementedError(f'attn_implementation="fa2cupy" does not support {feature}; {alternative}')


# ------------------------------------------------------------------------------------------------------ the mask


def fa2cupy_mask(batch_size, kv_length, attention_mask=None, kv_offset=0, q_length=None, q_offset=None,
                 cache_position=None, use_vmap=False, **kwargs):
    """The mask transformers hands to :func:`fa2cupy_attention_forward`: bool ``(batch, kv_length)``, True where a
    key slot holds a token, or None when all of them do.

    ``attention_mask`` is the user's 2-D padding mask over every token so far (past and current); its last
    ``kv_length`` columns are the slots of this layer's keys (a sliding-window cache keeps only the last ones).
    A static cache's keys are longer than the tokens written so far: those slots past the last query
    (``q_offset + q_length``; ``cache_position[-1] + 1`` in the transformers releases that pass cache_position
    instead) are False. ``use_vmap`` is set when the model overlays its own mask function on the causal one
    (``or_mask_function``/``and_mask_function``), which the kernels cannot apply: that raises.
    """
    if use_vmap:
        raise _unsupported("a model-specific mask overlay (or_mask_function/and_mask_function, e.g. bidirectional "
                           "attention among image tokens)", 'use attn_implementation="sdpa" for this model')
    if cache_position is not None:
        q_end = cache_position[-1] + 1
    elif q_length is not None:
        q_end = (q_offset if q_offset is not None else 0) + q_length
    else:
        q_end = None
    compiling = torch.compiler.is_compiling()
    written = None  # slots up to the last query; None: all of them
    if q_end is not None and (isinstance(q_end, torch.Tensor) or kv_offset + kv_length > q_end):
        device = attention_mask.device if attention_mask is not None else kwargs.get("device")
        written = (torch.arange(kv_length, device=device) + kv_offset) < q_end
        if not compiling and bool(written.all()):
            written = None
    if attention_mask is not None:
        if attention_mask.ndim != 2:
            raise _unsupported(f"a {attention_mask.ndim}-D attention mask (only 2-D padding masks)")
        mask = attention_mask[:, -kv_length:].to(torch.bool)
        if mask.shape[1] < kv_length:  # the static cache's unwritten tail
            mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1]), value=False)
        if written is not None:
            mask = mask & written
        if not compiling and bool(mask.all()):
            return None
        return mask
    if written is None:
        return None
    return written.expand(batch_size, kv_length)


# ------------------------------------------------------------------------------------------------- attention


def sliding_window_to_window_size(sliding_window, causal: bool) -> tuple[int, int]:
    """fa2cupy's ``window_size=(left, right)`` for transformers' ``sliding_window``.

    transformers' sliding window is the number of keys a causal query sees, itself included (its mask:
    ``q - sliding_window < k <= q``), so ``left = sliding_window - 1``; fa2cupy's window counts the keys on each
    side besides the query's own position. Bidirectional sliding-window masks are ``|q - k| <= sliding_window``
    (transformers' sliding_window_bidirectional_overlay), hence ``(sliding_window, sliding_window)`` there.
    None is no window, ``(-1, -1)``.
    """
    if sliding_window is None:
        return (-1, -1)
    w = int(sliding_window)
    if w < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window!r}")
    return (w - 1, 0) if causal else (w, w)


def _target_dtype(query: torch.Tensor):
    """float32 inputs are cast to the autocast dtype when autocast is on (the kernels take float16/bfloat16);
    otherwise they are left to fa2cupy's dtype check."""
    if query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return None


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _packed_starts(position_ids: torch.Tensor):
    """For batch-1 ``position_ids`` of packed sequences: the int32 cu_seqlens of the runs (a new sequence starts
    wherever a position is not its predecessor + 1, as transformers' packed-sequence mask has it), or None when
    they are one run."""
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = starts.nonzero().flatten()
    if idx.numel() <= 1:
        return None
    return torch.cat([idx, idx.new_tensor([pos.numel()])]).to(torch.int32)


def _query_slots(mask: torch.Tensor, sq: int) -> torch.Tensor:
    """bool ``(batch, sq)``: which query rows hold tokens, for ``1 < sq < kv_length``. The queries are the ``sq``
    slots that end at each row's last written key (the last ``sq`` columns of a padding mask; a static cache's
    tail lies beyond them)."""
    b, length = mask.shape
    last = length - torch.flip(mask, (1,)).to(torch.int8).argmax(1)  # one past each row's last True
    cols = last[:, None] - sq + torch.arange(sq, device=mask.device)
    return torch.gather(mask, 1, cols.clamp_min(0)) & (cols >= 0)


def _check_kwargs(kwargs, attention_mask):
    if kwargs.get("output_attentions"):
        raise _unsupported("output_attentions=True (the kernels never form the attention probabilities)",
                           'use attn_implementation="eager" to get attention weights')
    if kwargs.get("s_aux") is not None:
        raise _unsupported("attention sinks (s_aux)", 'use attn_implementation="eager" or "sdpa" for this model')
    if kwargs.get("position_bias") is not None:
        raise _unsupported("an additive position bias", 'use attn_implementation="sdpa" for this model')
    if any(kwargs.get(name) is not None for name in ("block_table", "k_cache", "v_cache")):
        raise _unsupported("continuous batching's decode fast path (block_table/k_cache/v_cache: flash-attn's "
                           "flash_attn_with_kvcache)", "leave ContinuousBatchingConfig.max_blocks_per_request unset")
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.ndim != 2):
        raise _unsupported(f"an arbitrary attention mask ({attention_mask.ndim}-D {attention_mask.dtype}; only the "
                           f"2-D boolean padding masks its registered mask function builds)")


def fa2cupy_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                              sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function interface on fa2cupy's kernels.

    ``query`` ``(batch, heads, sq, dim)``, ``key``/``value`` ``(batch, kv_heads, sk, dim)``; ``attention_mask``
    is what :func:`fa2cupy_mask` built (None or bool ``(batch, sk)``). Returns ``(out (batch, sq, heads, dim),
    None)``; padded query rows of ``out`` are zero.
    """
    _check_kwargs(kwargs, attention_mask)
    is_causal = kwargs.get("is_causal")
    causal = bool(module.is_causal if is_causal is None else is_causal)
    window = sliding_window_to_window_size(sliding_window, causal)
    cap = 0.0 if softcap is None else float(softcap)
    # The model passes dropout = 0 outside training (from its config's attention_dropout otherwise).
    p = float(dropout or 0.0)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    opts = dict(dropout_p=p, softmax_scale=float(scale), causal=causal, window_size=window, softcap=cap)
    cache = kwargs.get("cache")
    if cache is not None and "read_index" in kwargs:
        return _continuous_batching_attention(module, query, key, value, cache, opts, kwargs)

    # (batch, seq, heads, dim) views: fa2cupy reads any strides on the first three axes.
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    target = _target_dtype(q)
    if target is not None:
        q, k, v = (x.to(target) for x in (q, k, v))
    head_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim != head_dim:
        if v_dim > head_dim:
            raise _unsupported(f"value head dim {v_dim} > query head dim {head_dim}")
        v = torch.nn.functional.pad(v, (0, head_dim - v_dim))  # zero columns: sliced off the output below
    b, sq, h, d = q.shape
    sk = k.shape[1]

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if attention_mask is None and cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        # Packed sequences with their boundaries given (flattened batch).
        out = fa_torch.flash_attn_varlen_func(q.reshape(-1, h, d), k.reshape(-1, *k.shape[2:]),
                                              v.reshape(-1, *v.shape[2:]), cu_q.to(torch.int32),
                                              cu_k.to(torch.int32), int(max_q), int(max_k), **opts)
        out = out.view(b, sq, h, d)
    elif attention_mask is None:
        position_ids = kwargs.get("position_ids")
        cu = None
        if position_ids is not None and b == 1 and sq == sk and sq > 1 and not torch.compiler.is_compiling():
            cu = _packed_starts(position_ids)
        if cu is None:
            out = fa_torch.flash_attn_func(q, k, v, **opts)
        else:  # packed sequences: one varlen call over the runs of position_ids
            max_len = int((cu[1:] - cu[:-1]).max())
            out = fa_torch.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max_len, max_len, **opts)[None]
    else:
        out = _padded_attention(q, k, v, attention_mask, opts)
    if v_dim != head_dim:
        out = out[..., :v_dim]
    return out, None


def _padded_attention(q, k, v, mask, opts):
    """Attention over the key slots ``mask`` marks, the query rows gathered likewise; the kernels see only tokens
    (varlen), and the output is scattered back into zeros."""
    b, sq, h, d = q.shape
    if k.shape[1] > mask.shape[1]:
        raise ValueError(f"attention mask covers {mask.shape[1]} key slots but the keys have {k.shape[1]}")
    mask = mask[:, : k.shape[1]] if mask.shape[1] > k.shape[1] else mask
    kb, ks = mask.nonzero(as_tuple=True)
    k_lens = mask.sum(1, dtype=torch.int32)
    cu_k, max_k = _cu_seqlens(k_lens), int(k_lens.max())
    k_tok, v_tok = k[kb, ks], v[kb, ks]  # the one copy unpadding needs: (total_k, kv_heads, dim)
    if sq == 1:  # decoding: one query per sequence, a view
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        out = fa_torch.flash_attn_varlen_func(q[:, 0], k_tok, v_tok, cu_q, cu_k, 1, max_k, **opts)
        return out[:, None]
    q_mask = mask if sq == mask.shape[1] else _query_slots(mask, sq)
    qb, qs = q_mask.nonzero(as_tuple=True)
    q_lens = q_mask.sum(1, dtype=torch.int32)
    out_tok = fa_torch.flash_attn_varlen_func(q[qb, qs], k_tok, v_tok, _cu_seqlens(q_lens), cu_k, int(q_lens.max()),
                                              max_k, **opts)
    out = out_tok.new_zeros((b, sq, h, out_tok.shape[-1]))
    return out.index_put((qb, qs), out_tok)


# ---------------------------------------------------------------------------------------- continuous batching


def _continuous_batching_attention(module, query, key, value, cache, opts, kwargs):
    """One layer of transformers' continuous batching (``generate_batch``): the batch's new tokens of every request
    packed into one row (``query`` ``(1, heads, total_q, dim)``, ``key``/``value`` ``(1, kv_heads, total_q, dim)``),
    ``cu_seq_lens_q/k`` and ``max_seqlen_q/k`` bounding each request, and ``cache``, transformers'
    ``PagedAttentionCache``: per layer a pool of ``block_size``-token pages, ``read_index``/``write_index`` the
    pool rows each request reads (its past and new tokens, in order) and writes (its new tokens).

    Full-attention layers write the new keys and values into the pool and run the paged varlen kernel on the pool
    itself: the block table is each request's ``read_index`` rows at page starts divided by the page size (the
    cache hands out whole pages, a request's rows within a page in order), built on the GPU without a host
    round trip. Sliding-window layers keep a ring of pages whose reads and writes the cache orders itself
    (``cache.update``, which gathers the keys), and the varlen kernel runs on what it returns. Causal, bottom-right
    aligned: each request's queries are its last keys. The ``attention_mask`` continuous batching may pass is not
    read: the sequence bounds say everything it would. ``opts``: the kernels' options, as for any other call.
    """
    cu_q, max_q = kwargs["cu_seq_lens_q"], kwargs["max_seqlen_q"]
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):  # models with both layer types: bounds per type
        layer_type = "full_attention" if opts["window_size"] == (-1, -1) else "sliding_attention"
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    q = query[0].transpose(0, 1)  # (total_q, heads, dim) view
    if query.shape[-1] != value.shape[-1]:
        raise _unsupported(f"continuous batching with value head dim {value.shape[-1]} != query head dim "
                           f"{query.shape[-1]}", 'use attn_implementation="sdpa" for this model')
    pool = _paged_pools(module, key, value, cache, kwargs)
    if pool is None:
        k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                            read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        out = fa_torch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(max_q), int(max_k), **opts)
    else:
        k_pages, v_pages, read, page = pool
        table = _block_table(read, cu_k, int(max_k), page)
        out = fa_torch.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, int(max_q), int(max_k),
                                              block_table=table, **opts)
    return out, None


def fa2cupy_paged_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """``"paged|fa2cupy"``: the implementation transformers 5.0-5.18 switch a model loaded with ``"fa2cupy"`` to for
    continuous batching (``generate_batch``). Only that route gives it what it needs, the paged cache; called
    otherwise it raises rather than attend without the padding mask only ``"fa2cupy"`` is given."""
    if kwargs.get("cache") is None or "read_index" not in kwargs:
        raise ValueError(f'attn_implementation="{PAGED_NAME}" is what continuous batching (generate_batch) switches '
                         f'a model to and needs the paged cache it passes; load the model with '
                         f'attn_implementation="{NAME}"')
    return fa2cupy_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _paged_pools(module, key, value, cache, kwargs):
    """For a full-attention layer whose requests read the cache: write the new keys and values into the layer's
    pools and return ``(k_pages, v_pages, read_index, page_size)``, the pools viewed as ``(pages, page_size,
    kv_heads, dim)``. None where ``cache.update`` does the work (sliding-window layers; batches that only write,
    whose new keys are all the keys; a cache without the per-layer pools)."""
    layer = module.layer_idx
    groups, windows = getattr(cache, "layer_index_to_group_indices", None), getattr(cache, "sliding_windows", None)
    if groups is None or windows is None or windows.get(layer, 1) != 1 or not hasattr(cache, "key_cache"):
        return None
    group, index = groups[layer]
    read, write = kwargs["read_index"][group], kwargs["write_index"][group]
    if read.numel() == 0:
        return None
    k_pool, v_pool, page = cache.key_cache[index], cache.value_cache[index], int(cache.block_size)
    k_pool.index_copy_(0, write, key[0].transpose(0, 1))
    v_pool.index_copy_(0, write, value[0].transpose(0, 1))
    shape = (-1, page, *k_pool.shape[1:])
    return k_pool.view(shape), v_pool.view(shape), read, page


def _block_table(read: torch.Tensor, cu_k: torch.Tensor, max_k: int, page: int) -> torch.Tensor:
    """int32 ``(requests, ceil(max_k / page))``: the pages that hold each request's keys, in order. Request r's keys
    are pool rows ``read[cu_k[r]:cu_k[r+1]]``; its j-th page is the one holding row ``read[cu_k[r] + j * page]``.
    Entries past a request's keys are 0 (never read: the kernel stops at the request's length)."""
    pages = max(1, -(-max_k // page))
    offsets = torch.arange(pages, device=read.device, dtype=torch.int64) * page
    lengths = (cu_k[1:] - cu_k[:-1]).to(torch.int64)[:, None]
    used = offsets[None, :] < lengths
    rows = (cu_k[:-1].to(torch.int64)[:, None] + offsets[None, :]).clamp(max=read.numel() - 1)
    return torch.where(used, read[rows] // page, 0).to(torch.int32)


def _register():
    AttentionInterface.register(NAME, fa2cupy_attention_forward)
    AttentionMaskInterface.register(NAME, fa2cupy_mask)
    AttentionInterface.register(PAGED_NAME, fa2cupy_paged_attention_forward)


_register()
