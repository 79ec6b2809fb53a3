"""The public entry points' names, where fa2cupy's package namespace finds them: defined in
:mod:`fa2cupy.attention` (dense, packed and varlen attention, their backward, the dropout mask) and
:mod:`fa2cupy.kvcache` (decoding over a KV cache, merging attention states), each a thin function over
:mod:`fa2cupy.pipeline`."""

from .attention import (  # noqa: F401
    dropout_mask,
    flash_attn_backward,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_backward,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache, merge_attention_states  # noqa: F401
