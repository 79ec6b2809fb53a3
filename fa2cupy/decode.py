"""Decode kernel family (cuda/decode.cu): split-KV decoding with GQA packing over contiguous or paged caches, and
the (out, lse) merge that combines the splits (also public as merge_attention_states)."""

from __future__ import annotations

import numpy as np

from . import build, configs

#: merge_states instantiations by (parts dtype, output dtype): 16-bit parts keep their dtype; fp32 parts (split-KV
#: partial results) are written out in the query's dtype.
MERGE_DTYPES = (("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float16"), ("float32", "bfloat16"))
_TAGS = {**configs.DTYPE_TAGS, "float32": "fa2::f32"}


def merge_name_expression(parts_dtype: str, out_dtype: str) -> str:
    return f"fa2::merge_states<{_TAGS[parts_dtype]}, {_TAGS[out_dtype]}>"


def instantiations(family: str | None = None) -> list[str]:
    """Name expressions of every shipped decode-family instantiation (merge kernels are not per arch family)."""
    return sorted({merge_name_expression(p, o) for p, o in MERGE_DTYPES} | set(configs.decode_instantiations(family)))


def choose_num_splits(batch: int, nheads_kv: int, row_blocks: int, max_seqlen_k: int, sm_count: int,
                      block_n: int) -> int:
    """Splits per batch row so that batch x kv heads x row blocks x splits fills the GPU about 4 blocks per SM
    deep (several one-warp blocks per SM hide memory latency), with at least 4 key tiles per split."""
    blocks = batch * nheads_kv * row_blocks
    want = -(-4 * sm_count // blocks)
    most = max(1, max_seqlen_k // (4 * block_n))
    return max(1, min(want, most, 128))


def launch_decode(q, k_cache, v_cache, block_table, seqlens_k, cache_batch_idx, out_partial, lse_partial, *,
                  page_size: int, softmax_scale: float, causal: bool, arch: int, stream) -> None:
    """The split kernel. q (batch, seqlen_q, nheads, d); caches as in flash_attn_with_kvcache (paged when
    block_table is not None); seqlens_k int32 (batch,) keys per row after the append; cache_batch_idx int32 or
    None; out_partial (splits, batch, seqlen_q, nheads, d) fp32; lse_partial (splits, batch, seqlen_q, nheads)."""
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv = k_cache.shape[2]
    group = nheads // nheads_kv
    splits = out_partial.shape[0]
    config = configs.decode_config(arch, headdim)
    paged = block_table is not None
    function = build.get_kernel("decode", config.name_expression(q.dtype.name, causal, paged), config.smem_bytes)
    item = q.itemsize
    args = (q, k_cache, v_cache, block_table if paged else np.uint64(0), seqlens_k,
            cache_batch_idx if cache_batch_idx is not None else np.uint64(0), out_partial, lse_partial)
    for array in (q, k_cache, v_cache):
        b_stride, r_stride, h_stride, _ = array.strides
        args += (np.int64(b_stride // item), np.int32(r_stride // item), np.int64(h_stride // item))
    args += (np.int32(batch), np.int32(seqlen_q), np.int32(nheads), np.int32(group), np.int32(headdim),
             np.int32(page_size), np.int32(block_table.shape[1] if paged else 0), np.float32(softmax_scale),
             np.float32(softmax_scale * 1.4426950408889634))
    row_blocks = -(-seqlen_q * group // 16)
    grid = (splits, nheads_kv * row_blocks, batch)
    function(grid, (32, 1, 1), args, shared_mem=config.smem_bytes, stream=stream)


def launch_merge(parts, lses, out, lse_out, stream) -> None:
    """parts: (n, rows, d) contiguous CuPy array (fp16/bf16/fp32), lses: (n, rows) float32 contiguous; out: (rows, d)
    contiguous 16-bit, lse_out: (rows,) float32. ``d`` a multiple of 8. Rows order is the caller's, the same in
    parts and lses."""
    n, rows, headdim = parts.shape
    function = build.get_kernel("decode", merge_name_expression(parts.dtype.name, out.dtype.name), 0)
    args = (parts, lses, out, lse_out, np.int32(n), np.int64(rows), np.int32(headdim))
    function(((rows + 7) // 8, 1, 1), (256, 1, 1), args, shared_mem=0, stream=stream)
