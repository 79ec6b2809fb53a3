"""Decode kernel family (cuda/decode.cu): launches on CuPy arrays. So far: the (out, lse) merge."""

from __future__ import annotations

import numpy as np

from . import build, configs

#: merge_states instantiations by (parts dtype, output dtype): 16-bit parts keep their dtype; fp32 parts (split-KV
#: partial results) are written out in the query's dtype.
MERGE_DTYPES = (("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float16"), ("float32", "bfloat16"))
_TAGS = {**configs.DTYPE_TAGS, "float32": "fa2::f32"}


def merge_name_expression(parts_dtype: str, out_dtype: str) -> str:
    return f"fa2::merge_states<{_TAGS[parts_dtype]}, {_TAGS[out_dtype]}>"


def instantiations() -> list[str]:
    """Name expressions of every shipped decode-family instantiation."""
    return sorted(merge_name_expression(p, o) for p, o in MERGE_DTYPES)


def launch_merge(parts, lses, out, lse_out, stream) -> None:
    """parts: (n, rows, d) contiguous CuPy array (fp16/bf16/fp32), lses: (n, rows) float32 contiguous; out: (rows, d)
    contiguous 16-bit, lse_out: (rows,) float32. ``d`` a multiple of 8. Rows order is the caller's, the same in
    parts and lses."""
    n, rows, headdim = parts.shape
    function = build.get_kernel("decode", merge_name_expression(parts.dtype.name, out.dtype.name), 0)
    args = (parts, lses, out, lse_out, np.int32(n), np.int64(rows), np.int32(headdim))
    function(((rows + 7) // 8, 1, 1), (256, 1, 1), args, shared_mem=0, stream=stream)
