"""Forward kernel family (cuda/fwd.cu): grid, arguments and launch on CuPy arrays."""

from __future__ import annotations

import math

import numpy as np

from . import build, configs

#: Tests set this to fill out and lse with NaN before every launch, so an element the kernel fails to write
#: shows up as NaN instead of as whatever the allocator happened to hand back.
_debug_poison = False

_LOG2E = 1.4426950408889634
#: Row strides travel as 32-bit ints (the kernel steps K/V rows with them); the interface copies anything wider.
MAX_ROW_STRIDE = 1 << 24


def launch_forward(q, k, v, out, lse, *, softmax_scale: float, causal: bool, arch: int, stream, config=None) -> None:
    """Runs the FA2 forward on CuPy arrays already validated by the interface.

    q, out: ``(batch, seqlen_q, nheads, d)``; k, v: ``(batch, seqlen_k, nheads_kv, d)``; lse:
    ``(batch, nheads, seqlen_q)`` float32 contiguous. ``d`` is a multiple of 8 (<= 256); the last axis is
    contiguous, the other strides are multiples of 8 elements and below ``MAX_ROW_STRIDE`` for the row axis, and
    every base pointer is 16-byte aligned. Launches on ``stream`` (a ``cupy.cuda.Stream``). ``config``
    overrides the table's choice (tuning only).
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dtype = q.dtype.name
    if config is None:
        config = configs.forward_config(arch, headdim, dtype, causal)
    kernel = build.get_kernel("fwd", config.name_expression(dtype, causal), config.smem_bytes)
    if _debug_poison:
        out.fill(math.nan)
        lse.fill(math.nan)
    item = q.itemsize
    args = (q, k, v, out, lse)
    for array in (q, k, v, out):
        batch_stride, row_stride, head_stride, _ = array.strides
        args += (np.int64(batch_stride // item), np.int32(row_stride // item), np.int64(head_stride // item))
    args += (
        np.int32(seqlen_q),
        np.int32(seqlen_k),
        np.int32(nheads),
        np.int32(nheads // nheads_kv),
        np.int32(headdim),
        np.float32(softmax_scale),
        np.float32(softmax_scale * _LOG2E),
    )
    grid = ((seqlen_q + config.block_m - 1) // config.block_m, nheads, batch)
    kernel.kernel(grid, (config.threads, 1, 1), args, shared_mem=config.smem_bytes, stream=stream)
